"""Which transformers tensors a model has and in what order they are written, for any family."""

from __future__ import annotations

import torch

from megatron_train.config import ModelConfig
from megatron_train.models.family import Family


def export_plan(family: Family, m: ModelConfig) -> list[tuple[str, int | None, list[str]]]:
    """(our key, layer, the transformers names it becomes), grouped by layer as transformers saves."""
    tensors = family.tensors(m)
    first = [(t.key, None) for t in tensors if t.place == "first"]
    layered = [t.key for t in tensors if t.per_layer]
    last = [(t.key, None) for t in tensors if t.place == "last"]
    slots = first + [(key, layer) for layer in range(m.num_layers) for key in layered] + last
    return [(key, layer, family.hf_names(key, layer)) for key, layer in slots]


def hf_shapes(family: Family, m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every transformers tensor's shape, from ``to_hf`` on meta tensors (no memory, no I/O)."""
    shapes = {t.key: t.shape for t in family.tensors(m)}
    return {
        name: tuple(tensor.shape)
        for key, layer, _ in export_plan(family, m)
        for name, tensor in family.to_hf(m, key, layer, torch.empty(shapes[key], device="meta")).items()
    }
