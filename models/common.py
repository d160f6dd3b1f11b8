"""The TransformerConfig options every family sets the same way: parallel layout, precision,
fusions and activation recomputation, from the experiment config."""

from __future__ import annotations

from typing import Any

import torch

from megatron_train.config import ExperimentConfig, ModelConfig
from megatron_train.megatron_compat import weight_gradient_accumulation_in_torch


def grad_accumulation_fusion(m: ModelConfig) -> bool:
    """Whether weight-gradient GEMMs accumulate straight into ``main_grad``.

    ``model.gradient_accumulation_fusion`` is one switch for every linear: megatron-core's own
    (every spec's output layer among them) need apex's ``fused_weight_gradient_mlp_cuda`` or its
    torch stand-in; Transformer Engine's fuse it themselves. ``auto`` leaves compiled layers
    without it: megatron's linear keeps ``main_grad`` on its autograd context, which torch.compile
    cannot trace, so each layer's graph splits at its linears; ``true`` accepts that split.
    """
    return asks_grad_accumulation_fusion(m) and weight_gradient_accumulation_in_torch()


def asks_grad_accumulation_fusion(m: ModelConfig) -> bool:
    """Whether the config asks for gradient accumulation fusion (``auto``: where not compiled)."""
    asked = m.gradient_accumulation_fusion
    return asked is True or (asked == "auto" and not m.compile)


def one_pass_loss(m: ModelConfig, use_transformer_engine: bool) -> bool:
    """Whether the loss is models/loss.py's compiled passes: ``model.cross_entropy_fusion`` on the
    local spec (Transformer Engine's spec fuses it in TE's kernel), and ``model.compile``, which
    compiles the loss with the layers as torchtitan compiles its loss with the blocks."""
    return (m.cross_entropy_fusion or m.compile) and not use_transformer_engine


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
        gradient_accumulation_fusion=grad_accumulation_fusion(m),
        persist_layer_norm=False,
        # The local spec's fused loss is models/loss.py's (megatron's "native" one writes fp32 copies).
        cross_entropy_loss_fusion=m.cross_entropy_fusion and use_transformer_engine,
        cross_entropy_fusion_impl="te",
        calculate_per_token_loss=True,
        deallocate_pipeline_outputs=True,
        # megatron-core 0.16's default, "full", warns on every config that it is deprecated; the
        # empty list is the same whole-layer scope (and no CUDA graph is captured here).
        cuda_graph_scope=[],
        **recompute_options(m),
    )
