"""megatron-core's (distributed) Adam and OptimizerParamScheduler from the experiment config."""

from __future__ import annotations

import torch
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_train.config import ExperimentConfig, decay_end


def build_optimizer(
    cfg: ExperimentConfig, model_chunks: list, dtype: torch.dtype
) -> tuple[MegatronOptimizer, OptimizerParamScheduler]:
    """Adam over the model chunks and its LR / weight-decay schedule, counted in optimizer steps:
    the config gives warmup, decay and length in steps, so a resume that changes
    ``train.global_batch_size`` keeps them there (megatron counts samples, which would move the
    decay's end to another step)."""
    o, t = cfg.optimizer, cfg.train
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            clip_grad=o.clip_grad,
            bf16=dtype == torch.bfloat16,
            params_dtype=dtype,
            use_distributed_optimizer=o.distributed,
        ),
        model_chunks,
    )
    end = decay_end(cfg)
    wsd_steps = o.wsd_decay_steps if o.wsd_decay_steps is not None else max(1, end // 10)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.warmup_steps,
        lr_decay_steps=end,
        lr_decay_style=o.decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=t.steps,
        wd_incr_style="constant",
        wsd_decay_steps=wsd_steps if o.decay_style == "WSD" else None,
        lr_wsd_decay_style="linear" if o.decay_style == "WSD" else None,
        # On resume the config, not the checkpoint, decides the schedule's shape (a changed lr or
        # step count takes effect); the step counter always comes from the checkpoint.
        override_opt_param_scheduler=True,
        use_checkpoint_opt_param_scheduler=False,
    )
    return optimizer, scheduler


def select_adam_kernel(optimizer: MegatronOptimizer) -> None:
    """Run torch's Adam(W), megatron-core's fallback without TE or apex, with its fused kernel on
    GPU (the whole update in one pass over the tensors, not one pass per arithmetic step) and its
    default path on CPU.

    A checkpoint's param groups carry these flags, so this is called after any load: the device
    a run trains on picks the kernel, not the one its checkpoint was written on.
    """
    on_gpu = torch.cuda.is_available()
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if type(inner) in (torch.optim.AdamW, torch.optim.Adam):
            for group in inner.param_groups:
                group["fused"], group["foreach"] = on_gpu, (False if on_gpu else None)
