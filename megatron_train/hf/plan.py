"""Which transformers tensors a model has and in what order they are written, for any family."""

from __future__ import annotations

import math

import torch

from megatron_train.config import ModelConfig
from megatron_train.errors import ConversionError
from megatron_train.models.family import Family, Index


def export_plan(family: Family, m: ModelConfig) -> list[tuple[str, Index, list[str]]]:
    """(our key, slice, the transformers names it becomes), grouped by layer as transformers saves."""
    tensors = family.tensors(m)
    first = [(t.key, ()) for t in tensors if t.place == "first"]
    last = [(t.key, ()) for t in tensors if t.place == "last"]
    # By layer, tensors in checkpoint order within one (the sort is stable).
    layered = sorted(
        ((t.key, index) for t in tensors if t.per_layer for index in t.indices(m.num_layers)),
        key=lambda slot: slot[1][0],
    )
    return [(key, index, family.hf_names(key, index)) for key, index in first + layered + last]


def hf_shapes(family: Family, m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every transformers tensor's shape, from ``to_hf`` on meta tensors (no memory, no I/O)."""
    shapes = {t.key: t.shape for t in family.tensors(m)}
    for shape in shapes.values():
        # torch refuses a tensor whose bytes count passes int64: only a damaged config.json's sizes.
        if math.prod(shape) * torch.float32.itemsize > torch.iinfo(torch.int64).max:
            raise ConversionError(
                f"config.json describes a tensor of shape {shape}, beyond what torch can hold: it describes "
                "no model that exists; correct config.json, or download the model again"
            )
    meta = {key: torch.empty(shape, device="meta") for key, shape in shapes.items()}
    return {
        name: tuple(tensor.shape)
        for key, index, _ in export_plan(family, m)
        for name, tensor in family.to_hf(m, key, index, meta[key]).items()
    }
