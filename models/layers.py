"""Layers shared by the families' local (non-Transformer Engine) specs.

An RMSNorm that supports sequence parallelism, and core attention through PyTorch's fused
``scaled_dot_product_attention`` with context parallelism and document masks, both drop-ins for
megatron-core's own modules.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

_SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def masked_attention_backends(key_length: int, on_cuda: bool) -> list[SDPBackend] | None:
    """The SDPA kernels PyTorch may choose from for attention with a mask tensor (a document
    mask), where ``auto`` is configured; None leaves the choice to PyTorch. pytorch#196678 (a
    regression of torch 2.11, the lent GPU image's): cuDNN's backward with a mask tensor
    returns NaN in the query gradient at key lengths of 128k + 64 once a row's logsumexp is below
    ln(FLT_MAX); the memory-efficient kernel, which PyTorch chose for masks before cuDNN, does not."""
    if on_cuda and key_length % 128 == 64:
        return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return None


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


def _chunks_in_sequence_order(context: int) -> torch.Tensor:
    """Where chunk j of the 2 x ``context`` sequence chunks sits once gathered in rank order
    (rank i holds chunks i and 2 x context - 1 - i, in that order)."""
    return torch.tensor([2 * j if j < context else 2 * (2 * context - 1 - j) + 1 for j in range(2 * context)])


def _gather_sequence(t: torch.Tensor, group, order: torch.Tensor) -> torch.Tensor:
    """``[seq / CP, ...]`` on each context-parallel rank -> the whole ``[seq, ...]`` in sequence
    order; the backward sums each rank's gradient back onto the rank that owns the slice."""
    gathered = tensor_parallel.gather_from_sequence_parallel_region(t, True, group)
    chunks = gathered.view(order.numel(), -1, *t.shape[1:])
    return chunks.index_select(0, order).view(-1, *t.shape[1:])


class SDPAttention(MegatronModule):
    """Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

    A drop-in for megatron's DotProductAttention (same constructor and forward signature) that
    dispatches to flash / memory-efficient kernels instead of materialising the score matrix.

    Under context parallelism each rank holds two of the sequence's 2 x CP chunks of queries,
    keys and values. Keys and values are all-gathered over the context-parallel group, as in
    Llama 3's training (cheap with grouped-query attention: few key/value heads), and each local
    query chunk attends to the keys up to its own end with a bottom-right causal mask. A document
    mask (``attention_mask``, megatron's convention: True may not attend) holds this rank's query
    rows against the whole sequence.
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
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"SDPAttention supports causal masks only, got {attn_mask_type}")
        head_dim = config.kv_channels
        self.hidden_size_per_partition = divide(
            head_dim * config.num_attention_heads, config.tensor_model_parallel_size
        )
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.backends = None if backend == "auto" else [_SDPA_BACKENDS[backend]]
        # From the config, not the tensors' head counts: where torch.compile treats sizes as symbolic
        # (dynamic shapes), a comparison of them is a symbolic bool, which SDPA refuses.
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.context = config.context_parallel_size
        if self.context > 1:
            self.context_group = parallel_state.get_context_parallel_group()
            self.register_buffer("chunk_order", _chunks_in_sequence_order(self.context), persistent=False)

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
        if self.context > 1:
            key, value = (_gather_sequence(t, self.context_group, self.chunk_order) for t in (key, value))
        # megatron passes [seq, batch, heads, dim]; SDPA wants [batch, heads, seq, dim].
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.dropout_p if self.training else 0.0
        kwargs = dict(scale=self.softmax_scale, enable_gqa=self.heads_per_group > 1)
        # Heads differ per TP rank, so their dropout masks come from the model-parallel RNG.
        rng = (
            tensor_parallel.get_cuda_rng_tracker().fork()
            if dropout_p > 0 and not self.config.sequence_parallel
            else contextlib.nullcontext()
        )
        backends = self.backends
        if backends is None and attention_mask is not None:
            backends = masked_attention_backends(k.size(2), k.is_cuda)
            if backends and self.heads_per_group > 1:
                # The memory-efficient kernel takes no enable_gqa beside a mask (PyTorch would fall
                # back to the math kernel, which holds seq x seq scores a head): the key and value
                # heads are repeated for their query heads instead, as transformers' repeat_kv does.
                k, v = (t.repeat_interleave(self.heads_per_group, dim=1) for t in (k, v))
                kwargs["enable_gqa"] = False
        kernel = sdpa_kernel(backends) if backends else contextlib.nullcontext()
        with rng, kernel:
            if attention_mask is not None:
                out = F.scaled_dot_product_attention(q, k, v, ~attention_mask, dropout_p, **kwargs)
            elif self.context == 1:
                out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, **kwargs)
            else:
                out = self._context_parallel_causal(q, k, v, dropout_p, kwargs)
        seq, batch = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, self.hidden_size_per_partition)

    def _context_parallel_causal(self, q, k, v, dropout_p: float, kwargs: dict) -> torch.Tensor:
        rank = parallel_state.get_context_parallel_rank()
        chunk = q.size(2) // 2
        outputs = []
        for half, index in enumerate((rank, 2 * self.context - 1 - rank)):
            end = (index + 1) * chunk
            q_half = q[:, :, half * chunk : (half + 1) * chunk]
            k_seen, v_seen = k[:, :, :end], v[:, :, :end]
            mask = causal_lower_right(chunk, end)
            outputs.append(F.scaled_dot_product_attention(q_half, k_seen, v_seen, mask, dropout_p, **kwargs))
        return torch.cat(outputs, dim=2)


class RotaryAtPositions(torch.nn.Module):
    """megatron's RoPE table looked up at each token's ``position_ids`` (its place within its
    document once positions restart per document) instead of at its place in the sample.

    GPTModel hands RoPE only a sequence length, so :meth:`attach` has the model leave each
    forward's ``position_ids`` here first. They arrive already split for this context-parallel
    rank, so the table is built for the whole sequence and never split again.
    """

    def __init__(self, rotary: torch.nn.Module) -> None:
        super().__init__()
        self.rotary = rotary
        self.positions: torch.Tensor | None = None

    @classmethod
    def attach(cls, model: torch.nn.Module) -> None:
        """Replace ``model.rotary_pos_emb`` (a GPTModel's) with one that follows ``position_ids``."""
        rotary = cls(model.rotary_pos_emb)
        model.rotary_pos_emb = rotary

        def keep_positions(_module, args, kwargs) -> None:
            rotary.positions = kwargs["position_ids"] if "position_ids" in kwargs else args[1]

        model.register_forward_pre_hook(keep_positions, with_kwargs=True)

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.rotary.get_rotary_seq_len(*args, **kwargs)

    def forward(
        self, max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None
    ) -> torch.Tensor:
        # packed_seq: megatron's whole (cached) table, not this context-parallel rank's slice of it.
        table = self.rotary(max_seq_len, offset, packed_seq=True)  # [seq, 1, 1, dim]
        return table[self.positions.t()].squeeze(2)  # [local seq, batch, 1, dim]
