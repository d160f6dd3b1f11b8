"""One optimizer step and one validation pass through megatron-core's pipeline schedules."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_train.batch import BatchPreparer
from megatron_train.config import ExperimentConfig
from megatron_train.model import aligns_param_gather, use_transformer_engine
from megatron_train.moe_stats import RouterStats
from megatron_train.optim import select_adam_kernel


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Token-summed loss; megatron divides gradients by the global token count
    (``calculate_per_token_loss``), so the result does not depend on how the batch is split."""
    mask = loss_mask.view(-1).float()
    loss_sum = torch.sum(output_tensor.view(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), mask.sum().detach()])}


def forward_step(prepare: BatchPreparer, data_iterator: Iterator, model):
    """megatron's forward_step_func: run one micro-batch, return output and its loss function."""
    batch = prepare(next(data_iterator))
    output = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"],
        packed_seq_params=batch.get("packed_seq_params"),
    )  # fmt: skip
    return output, partial(_loss_func, batch["loss_mask"])


def _global_mean_loss(losses_reduced: list[dict], device: torch.device) -> float:
    """Mean token loss over the global batch, known on every rank.

    Only the last pipeline stage computes it: sum over micro-batches and data-parallel ranks,
    then broadcast along the pipeline so every rank can log and stop consistently.
    """
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        for item in losses_reduced:
            totals += item["lm loss"].to(torch.float64)
        torch.distributed.all_reduce(
            totals, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
    torch.distributed.broadcast(
        totals,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return (totals[0] / totals[1].clamp(min=1)).item()


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm stopped being finite."""


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step reports."""

    loss: float
    grad_norm: float
    lr: float
    skipped: bool
    moe: dict[str, float] = field(default_factory=dict)
    """The router's figures over the log interval, at logged steps of mixture-of-experts models
    (:class:`RouterStats`)."""

    def check_finite(self, step: int) -> None:
        """Raise :class:`TrainingDiverged` unless loss and gradient norm are finite (the same on
        every rank, so all ranks raise together)."""
        if not (math.isfinite(self.loss) and math.isfinite(self.grad_norm)):
            raise TrainingDiverged(
                f"step {step}: loss {self.loss} / grad norm {self.grad_norm} is not finite. "
                "Lower optimizer.lr, raise optimizer.warmup_steps or check the data."
            )


def _wire_schedule_hooks(cfg: ExperimentConfig, model: list, optimizer) -> None:
    """Give megatron's schedules the grad-sync hooks of our DDP chunks and the optimizer."""
    tconfig = model[0].config
    tconfig.finalize_model_grads_func = finalize_model_grads
    tconfig.grad_scale_func = optimizer.scale_loss
    no_sync = [chunk.no_sync for chunk in model]
    tconfig.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    if cfg.ddp.overlap_grad_reduce:
        sync = [chunk.start_grad_sync for chunk in model]
        tconfig.grad_sync_func = sync[0] if len(sync) == 1 else sync
    if aligns_param_gather(cfg):
        sync = [chunk.start_param_sync for chunk in model]
        tconfig.param_sync_func = sync[0] if len(sync) == 1 else sync


def eval_batches_per_call(pipeline: int, microbatches: int) -> int:
    """Global batches of ``microbatches`` each that a validation runs per schedule call: enough
    that the pipeline's fill and drain (``pipeline - 1`` micro-batch slots a call) are at most a
    tenth of the call: one a call, as Megatron-LM runs them, pays that fill and drain every
    batch (README, "Checkpoints and resume", has the figures)."""
    return math.ceil(9 * (pipeline - 1) / microbatches) or 1


class Stepper:
    """Runs training steps and validation passes for a fixed model, optimizer and batch shape."""

    def __init__(self, cfg: ExperimentConfig, model, optimizer, scheduler, device: torch.device) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        t = cfg.train
        self.seq_length, self.micro_batch_size = cfg.data.seq_length, t.micro_batch_size
        dp = parallel_state.get_data_parallel_world_size()
        self.num_microbatches = t.global_batch_size // (t.micro_batch_size * dp)
        self.eval_batches_per_call = eval_batches_per_call(cfg.parallel.pipeline, self.num_microbatches)
        self.device = device
        _wire_schedule_hooks(cfg, model, optimizer)
        select_adam_kernel(optimizer)
        self._schedule = get_forward_backward_func()
        self._forward_step = partial(
            forward_step, BatchPreparer.for_config(cfg, device, use_transformer_engine(cfg))
        )
        m = cfg.model
        self.router_stats = (
            RouterStats(model, m.num_layers, m.num_experts, self.num_microbatches, device)
            if m.num_experts
            else None
        )

    def _run_schedule(self, data_iterators: list[Iterator], forward_only: bool, num_microbatches: int):
        return self._schedule(
            forward_step_func=self._forward_step,
            data_iterator=data_iterators if len(self.model) > 1 else data_iterators[0],
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=num_microbatches,
            seq_length=self.seq_length,
            micro_batch_size=self.micro_batch_size,
            forward_only=forward_only,
        )

    def train_step(self, data_iterators: list[Iterator], logged: bool = True) -> StepResult:
        """Forward and backward over every micro-batch, then one optimizer and LR step; ``logged``
        (the same on every rank) says whether the step's figures are reported."""
        for chunk in self.model:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = self._run_schedule(data_iterators, False, self.num_microbatches)
        update_successful, grad_norm, _ = self.optimizer.step()
        if update_successful:
            self.scheduler.step(increment=1)
        return StepResult(
            loss=_global_mean_loss(losses, self.device),
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=self.optimizer.param_groups[0]["lr"],
            skipped=not update_successful,
            moe=self.router_stats.after_step(report=logged) if self.router_stats else {},
        )

    @torch.no_grad()
    def evaluate(
        self, data_iterators: list[Iterator], num_batches: int, go_on: Callable[[int], bool]
    ) -> float | None:
        """Mean token loss over ``num_batches`` global batches, without gradients, or None when
        ``go_on`` (told how many are done after each schedule call, and agreed by every rank)
        says to stop early. Several schedule calls, not one for all (:func:`eval_batches_per_call`
        a call), so that a long validation can report progress and give way to a stop signal."""
        for chunk in self.model:
            chunk.eval()
        losses, done = [], 0
        while done < num_batches:
            batches = min(self.eval_batches_per_call, num_batches - done)
            losses += self._run_schedule(data_iterators, True, batches * self.num_microbatches)
            done += batches
            if not go_on(done):
                return None
        return _global_mean_loss(losses, self.device)
