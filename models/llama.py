"""Llama-family decoders (Llama 2/3, Mistral, Qwen2) as megatron-core GPTModels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_train.config import ExperimentConfig, padded_vocab_size
from models.specs import decoder_block_spec

PRESETS: dict[str, dict] = {
    "tiny": dict(
        num_layers=4, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
        num_query_groups=2, max_position_embeddings=1024,
    ),
    "small": dict(
        num_layers=8, hidden_size=512, ffn_hidden_size=1408, num_attention_heads=8,
        num_query_groups=4, max_position_embeddings=2048,
    ),
    "llama2-7b": dict(
        num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
        num_query_groups=32, max_position_embeddings=4096, vocab_size=32000, norm_eps=1e-5,
        rotary_base=10000,
    ),
    "llama3-8b": dict(
        num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
        num_query_groups=8, max_position_embeddings=8192, vocab_size=128256, norm_eps=1e-5,
        rotary_base=500000,
    ),
    "llama3.1-8b": dict(
        num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
        num_query_groups=8, max_position_embeddings=131072, vocab_size=128256, norm_eps=1e-5,
        rotary_base=500000, rope_scaling=True, rope_scaling_factor=8.0,
    ),
    "llama3-70b": dict(
        num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
        num_query_groups=8, max_position_embeddings=8192, vocab_size=128256, norm_eps=1e-5,
        rotary_base=500000,
    ),
}  # fmt: skip


def transformer_config(
    cfg: ExperimentConfig, params_dtype: torch.dtype, use_transformer_engine: bool
) -> TransformerConfig:
    """megatron-core's TransformerConfig for this experiment's model and layout."""
    m, p = cfg.model, cfg.parallel
    on_gpu = torch.cuda.is_available()
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups or m.num_attention_heads,
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
        tensor_model_parallel_size=p.tensor,
        pipeline_model_parallel_size=p.pipeline,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline if (p.virtual_pipeline or 1) > 1 else None,
        sequence_parallel=p.sequence_parallel,
        context_parallel_size=p.context,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        # Weights are initialised afterwards by megatron_train.init, identically for any layout.
        perform_initialization=False,
        use_cpu_initialization=not on_gpu,
        # Fused kernels exist only on GPU (TE / Triton / apex); the CPU path uses plain ops.
        bias_activation_fusion=on_gpu,
        bias_dropout_fusion=on_gpu,
        apply_rope_fusion=use_transformer_engine,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=m.cross_entropy_fusion and on_gpu,
        cross_entropy_fusion_impl="te" if use_transformer_engine else "native",
        calculate_per_token_loss=True,
        deallocate_pipeline_outputs=True,
    )


def build_model_chunks(
    cfg: ExperimentConfig, config: TransformerConfig, use_transformer_engine: bool
) -> list[GPTModel]:
    """One GPTModel per virtual pipeline stage held by this rank (one without VPP)."""
    vpp = config.virtual_pipeline_model_parallel_size
    stages = range(vpp) if vpp else [None]
    chunks = []
    for vp_stage in stages:
        model = GPTModel(
            config=config,
            transformer_layer_spec=decoder_block_spec(
                config, use_transformer_engine, vp_stage, cfg.model.attention_backend
            ),
            vocab_size=padded_vocab_size(cfg.model),
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
        chunks.append(model)
    return chunks
