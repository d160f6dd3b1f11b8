"""The TransformerConfig options every family sets the same way: parallel layout, precision,
fusions and activation recomputation, from the experiment config."""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

from megatron_train.config import ExperimentConfig, ModelConfig


def grad_accumulation_fusion_available() -> bool:
    """Whether the weight-gradient GEMM that accumulates straight into fp32 ``main_grad`` exists.

    megatron-core's own linears (every spec's output layer among them) need apex's
    ``fused_weight_gradient_mlp_cuda`` for it, and the option is one switch for all layers, so
    Transformer Engine alone is not enough (Megatron-LM turns it off in that case too).
    """
    return (
        torch.cuda.is_available() and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    )


def recompute_options(m: ModelConfig) -> dict[str, Any]:
    """``model.recompute*`` as megatron-core's recompute granularity, method, layers and modules."""
    if m.recompute == "none":
        return {}
    if m.recompute == "selective":
        return {"recompute_granularity": "selective", "recompute_modules": list(m.recompute_modules)}
    return {
        "recompute_granularity": "full",
        "recompute_method": m.recompute_method,
        "recompute_num_layers": m.recompute_num_layers,
    }


def shared_options(cfg: ExperimentConfig, params_dtype: torch.dtype, use_transformer_engine: bool) -> dict:
    """Layout, precision, fusion and recompute keyword arguments for TransformerConfig."""
    m, p = cfg.model, cfg.parallel
    on_gpu = torch.cuda.is_available()
    return dict(
        tensor_model_parallel_size=p.tensor,
        pipeline_model_parallel_size=p.pipeline,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline if (p.virtual_pipeline or 1) > 1 else None,
        sequence_parallel=p.sequence_parallel,
        context_parallel_size=p.context,
        expert_model_parallel_size=p.expert,
        expert_tensor_parallel_size=p.expert_tensor or p.tensor,
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
        gradient_accumulation_fusion=grad_accumulation_fusion_available(),
        persist_layer_norm=False,
        cross_entropy_loss_fusion=m.cross_entropy_fusion and on_gpu,
        cross_entropy_fusion_impl="te" if use_transformer_engine else "native",
        calculate_per_token_loss=True,
        deallocate_pipeline_outputs=True,
        # megatron-core 0.16's default, "full", warns on every config that it is deprecated; the
        # empty list is the same whole-layer scope (and no CUDA graph is captured here).
        cuda_graph_scope=[],
        **recompute_options(m),
    )
