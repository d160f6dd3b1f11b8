"""The router's numbers per log interval: the load-balancing loss and how unevenly tokens reach
experts (the worst layer's max / mean tokens per expert), known on every rank. Counting is local
and free; the collectives run only at the steps that are logged."""

from __future__ import annotations

import torch
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter

_AUX_LOSS = "load_balancing_loss"


class RouterStats:
    """Counts tokens per expert in every router of the model chunks during training forwards."""

    def __init__(self, model_chunks: list[torch.nn.Module], num_layers: int, num_experts: int,
                 num_microbatches: int, device: torch.device) -> None:  # fmt: skip
        self.num_layers, self.num_microbatches = num_layers, num_microbatches
        self._steps = 0
        self.tokens = torch.zeros(num_layers, num_experts, dtype=torch.float64, device=device)
        for chunk in model_chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.register_forward_hook(self._count)

    def _count(self, router: TopKRouter, inputs, outputs) -> None:
        # Training forwards only: evaluation runs without grad, and under activation
        # recomputation the first forward does too, so each micro-batch is counted once.
        if torch.is_grad_enabled():
            _, routing_map = outputs
            self.tokens[router.layer_number - 1] += routing_map.sum(dim=0)

    def after_step(self, report: bool) -> dict[str, float]:
        """Count a finished step; when ``report`` (a logged step, the same on every rank), the
        figures over the steps since the last report, from collectives on every rank; else {}."""
        self._steps += 1
        if not report:
            return {}
        torch.distributed.all_reduce(self.tokens)
        # A TP rank without sequence parallelism sees its group's tokens again: every count of a
        # layer is multiplied alike, which leaves max / mean unchanged.
        per_layer = self.tokens.max(dim=1).values / self.tokens.mean(dim=1).clamp(min=1e-9)
        stats = {"moe_load_imbalance": per_layer.max().item()}
        self.tokens.zero_()
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        if _AUX_LOSS in tracker:
            moe_utils.reduce_aux_losses_tracker_across_ranks([_AUX_LOSS])
            total = tracker[_AUX_LOSS]["values"].sum().item()
            stats["moe_aux_loss"] = total / (self.num_layers * self.num_microbatches * self._steps)
            moe_utils.clear_aux_losses_tracker()
        self._steps = 0
        return stats
