"""The router's numbers per training step: the load-balancing loss and how unevenly tokens
reach experts (the worst layer's max / mean tokens per expert), known on every rank."""

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

    def collect(self) -> dict[str, float]:
        """This step's figures (collectives on every rank), then start counting the next step."""
        torch.distributed.all_reduce(self.tokens)
        # A TP rank without sequence parallelism sees its group's tokens again: every count of a
        # layer is multiplied alike, which leaves max / mean unchanged.
        per_layer = self.tokens.max(dim=1).values / self.tokens.mean(dim=1).clamp(min=1e-9)
        stats = {"moe_load_imbalance": per_layer.max().item()}
        self.tokens.zero_()
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        if _AUX_LOSS in tracker:
            moe_utils.reduce_aux_losses_tracker_across_ranks([_AUX_LOSS])
            values = tracker[_AUX_LOSS]["values"]
            stats["moe_aux_loss"] = values.sum().item() / self.num_layers / self.num_microbatches
            moe_utils.clear_aux_losses_tracker()
        return stats
