"""Layers shared by the families' local (non-Transformer Engine) specs.

An RMSNorm that supports sequence parallelism and core attention through PyTorch's fused
``scaled_dot_product_attention``, both drop-ins for megatron-core's own modules.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch.nn.attention import SDPBackend, sdpa_kernel

_SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


class RMSNorm(torch.nn.RMSNorm):
    """PyTorch RMSNorm that works with sequence parallelism.

    megatron's WrappedTorchNorm refuses sequence parallelism only because nothing marks its
    weight: with the sequence sharded over TP ranks each rank sees a different slice of tokens,
    so the weight's gradient must be summed over TP. Tagging the parameter ``sequence_parallel``
    is how megatron's ``finalize_model_grads`` knows to do that.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


class SDPAttention(MegatronModule):
    """Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

    A drop-in for megatron's DotProductAttention (same constructor and forward signature) that
    dispatches to flash / memory-efficient kernels instead of materialising the score matrix.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        backend: str = "auto",
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("context parallelism needs Transformer Engine attention")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention supports causal masks only, got {attn_mask_type}")
        head_dim = config.kv_channels
        self.hidden_size_per_partition = divide(
            head_dim * config.num_attention_heads, config.tensor_model_parallel_size
        )
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.backends = None if backend == "auto" else [_SDPA_BACKENDS[backend]]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("packed sequences and attention bias need Transformer Engine")
        # megatron passes [seq, batch, heads, dim]; SDPA wants [batch, heads, seq, dim].
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        kwargs = dict(is_causal=True, scale=self.softmax_scale, enable_gqa=q.size(1) != k.size(1))
        # Heads differ per TP rank, so their dropout masks come from the model-parallel RNG.
        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if dropout_p > 0 and not self.config.sequence_parallel
            else contextlib.nullcontext()
        )
        kernel = sdpa_kernel(self.backends) if self.backends else contextlib.nullcontext()
        with rng, kernel:
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, **kwargs)
        seq, batch = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, self.hidden_size_per_partition)
