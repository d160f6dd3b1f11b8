"""Our decoders as megatron-core GPTModels: pre-norm RMSNorm, RoPE, grouped-query attention
(optionally with QK-norm), and a SwiGLU MLP or a mixture of SwiGLU experts. Every family builds
its models here; what differs between families is their presets and Hugging Face mapping."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_train.config import ExperimentConfig, ModelConfig
from megatron_train.models import counts
from megatron_train.models import loss as loss_fn
from megatron_train.models.common import one_pass_loss, shared_options
from megatron_train.models.family import Family
from megatron_train.models.hf_tensors import HfMapping, MoeNames, tensors
from megatron_train.models.layers import RotaryAtPositions
from megatron_train.models.specs import decoder_block_spec

_SCALED_OUTPUTS = ("linear_proj.weight", "linear_fc2.weight")


def transformer_config(
    cfg: ExperimentConfig, params_dtype: torch.dtype, use_transformer_engine: bool
) -> TransformerConfig:
    """megatron-core's TransformerConfig for this experiment's model and layout."""
    m = cfg.model
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.query_groups,
        kv_channels=m.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=m.qkv_bias,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        qk_layernorm=m.qk_norm,
        **moe_options(m, use_transformer_engine),
        **shared_options(cfg, params_dtype, use_transformer_engine),
    )


def moe_options(m: ModelConfig, use_transformer_engine: bool) -> dict:
    """``model.num_experts`` and ``model.moe_*`` as megatron-core's MoE options (dropless)."""
    if m.num_experts is None:
        return {}
    return dict(
        num_moe_experts=m.num_experts,
        moe_ffn_hidden_size=m.expert_ffn_hidden_size,
        moe_router_topk=m.moe_router_topk,
        moe_router_score_function=m.moe_router_score_function,
        moe_router_pre_softmax=m.moe_router_pre_softmax,
        moe_router_enable_expert_bias=m.moe_router_expert_bias,
        moe_router_bias_update_rate=m.moe_router_bias_update_rate,
        moe_router_load_balancing_type="aux_loss" if m.moe_aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        # Routing decisions in fp32 whatever the training precision (Megatron-LM's advice).
        moe_router_dtype="fp32",
        moe_shared_expert_intermediate_size=m.moe_shared_expert_ffn_hidden_size,
        moe_token_dispatcher_type=m.moe_token_dispatcher,
        moe_grouped_gemm=use_transformer_engine,
    )


class Decoder(GPTModel):
    """megatron-core's GPTModel, whose loss is :mod:`megatron_train.models.loss`'s where
    ``one_pass_loss`` says so (:func:`megatron_train.models.common.one_pass_loss`)."""

    def __init__(self, *args, one_pass_loss: bool, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.one_pass_loss = one_pass_loss

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if not self.one_pass_loss:
            return super().compute_language_model_loss(labels, logits)
        # As megatron-core's: labels [b, s], logits [s, b, vocab / TP], the loss back as [b, s].
        loss = loss_fn.vocab_parallel_cross_entropy(logits, labels.t().contiguous(), self.pg_collection.tp)
        return loss.t().contiguous()


def build_model_chunks(
    cfg: ExperimentConfig, config: TransformerConfig, use_transformer_engine: bool
) -> list[GPTModel]:
    """One GPTModel per virtual pipeline stage held by this rank (one without VPP)."""
    vpp = config.virtual_pipeline_model_parallel_size
    stages = range(vpp) if vpp else [None]
    chunks = []
    for vp_stage in stages:
        model = Decoder(
            one_pass_loss=one_pass_loss(cfg.model, use_transformer_engine),
            config=config,
            transformer_layer_spec=decoder_block_spec(
                config, use_transformer_engine, vp_stage, cfg.model.attention_backend
            ),
            vocab_size=cfg.model.padded_vocab_size,
            max_sequence_length=cfg.model.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=cfg.model.tie_embeddings,
            position_embedding_type="rope",
            rotary_base=cfg.model.rotary_base,
            rope_scaling=cfg.model.rope_scaling,
            rope_scaling_factor=cfg.model.rope_scaling_factor,
            vp_stage=vp_stage,
        )
        if cfg.data.reset_position_ids and not use_transformer_engine:
            # Transformer Engine's packed sequences restart positions per document themselves.
            RotaryAtPositions.attach(model)
        chunks.append(model)
    return chunks


def initial_value(m: ModelConfig, key: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Norms start at one, biases at zero, matrices from N(0, std), the residual branches' output
    projections with std / sqrt(2 * layers) (GPT-2's and Megatron-LM's scaled init)."""
    name = key.rsplit(".", 1)[-1]
    if "norm" in key and name.endswith("weight"):
        return torch.ones(shape)
    if name.endswith("bias"):
        return torch.zeros(shape)
    std = m.init_method_std
    if key.endswith(_SCALED_OUTPUTS):
        std = std / math.sqrt(2.0 * m.num_layers)
    return torch.empty(shape, device=gen.device).normal_(0.0, std, generator=gen)


def decoder_family(
    name: str,
    presets: Mapping[str, Mapping[str, Any]],
    check: Callable[[ModelConfig], None],
    hf_config: ModuleType,
    moe_names: MoeNames | None = None,
) -> Family:
    """A family of these decoders. It brings its presets, ``check`` (the options its models do
    not have), its config.json module (``ARCHITECTURES``, ``model_options``, ``caveats``,
    ``hf_configs``, ``zero_tensors``) and, for MoE models, where transformers keeps their tensors."""
    mapping = HfMapping(moe_names)
    return Family(
        name=name,
        presets=presets,
        hf_architectures=tuple(hf_config.ARCHITECTURES),
        check=check,
        transformer_config=transformer_config,
        build_model_chunks=build_model_chunks,
        initial_value=initial_value,
        tensors=tensors,
        flops_per_token=counts.flops_per_token,
        hf_model_options=hf_config.model_options,
        hf_caveats=hf_config.caveats,
        hf_configs=hf_config.hf_configs,
        hf_zero_tensors=hf_config.zero_tensors,
        hf_names=mapping.hf_names,
        to_megatron=mapping.to_megatron,
        to_hf=mapping.to_hf,
    )
