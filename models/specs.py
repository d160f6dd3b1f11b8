"""Layer specs for our decoders, dense or mixture-of-experts, with or without QK-norm.

Two implementations of the same layer, with interchangeable checkpoints: Transformer Engine's
fused layers (megatron-core's own TE spec, grouped-GEMM experts) on CUDA, and megatron-core's
parallel linears (its SequentialMLP for experts) with the shared RMSNorm and SDPA attention of
``models/layers.py`` everywhere else. What a layer holds is read from the TransformerConfig.
"""

from __future__ import annotations

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from megatron_train.models.layers import RMSNorm, SDPAttention


def local_layer_spec(config: TransformerConfig, attention_backend: str = "auto") -> ModuleSpec:
    """A decoder layer from megatron-core parallel linears, RMSNorm and SDPA attention."""
    moe = config.num_moe_experts is not None
    qk_norm = RMSNorm if config.qk_layernorm else IdentityOp
    if moe:
        mlp = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts)
    else:
        mlp = ModuleSpec(
            module=MLP,
            submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        )
    # Store norms under TE's names so checkpoints move between the two specs: TE fuses the
    # attention norm into the QKV linear, and the MLP norm into fc1 unless the MLP is an MoE.
    keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
    if not moe:
        keys_map["pre_mlp_layernorm."] = "mlp.linear_fc1.layer_norm_"
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ColumnParallelLinear,
                    core_attention=ModuleSpec(module=SDPAttention, params={"backend": attention_backend}),
                    linear_proj=RowParallelLinear,
                    q_layernorm=qk_norm,
                    k_layernorm=qk_norm,
                ),
            ),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys_map,
        ),
    )


def decoder_block_spec(
    config: TransformerConfig,
    use_transformer_engine: bool,
    vp_stage: int | None,
    attention_backend: str = "auto",
) -> ModuleSpec:
    """The decoder block for this pipeline stage (and virtual stage)."""
    if use_transformer_engine:
        from megatron.core.extensions.transformer_engine import TENorm

        layer = get_gpt_layer_with_transformer_engine_spec(
            num_experts=config.num_moe_experts,
            moe_grouped_gemm=config.moe_grouped_gemm,
            qk_layernorm=config.qk_layernorm,
        )
        final_norm = TENorm
    else:
        layer, final_norm = local_layer_spec(config, attention_backend), RMSNorm
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return ModuleSpec(
        module=TransformerBlock,
        submodules=TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=final_norm),
    )
