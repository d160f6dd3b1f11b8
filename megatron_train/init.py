"""Weight initialisation that does not depend on the parallel layout.

Each global tensor (as megatron's sharded state dict names it) is drawn from a generator seeded
by its name, layer and the run seed; every rank then keeps its own slice. A model therefore
starts from the same weights at any TP / PP / VPP / DP, which makes runs comparable across
layouts and lets a job change layout without changing its initial point.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)

_SCALED_OUTPUTS = ("linear_proj.weight", "linear_fc2.weight")


def _init_global(key: str, shape: tuple[int, ...], std: float, num_layers: int, gen) -> torch.Tensor:
    name = key.rsplit(".", 1)[-1]
    if "norm" in key and name.endswith("weight"):
        return torch.ones(shape)
    if name.endswith("bias"):
        return torch.zeros(shape)
    if key.endswith(_SCALED_OUTPUTS):
        std = std / math.sqrt(2.0 * num_layers)
    return torch.empty(shape, device=gen.device).normal_(0.0, std, generator=gen)


def _shards(sharded_state_dict: dict) -> list[ShardedTensor]:
    shards = []
    for item in nested_values(sharded_state_dict):
        if isinstance(item, ShardedTensorFactory):
            shards.extend(s for s in nested_values(item.build()) if isinstance(s, ShardedTensor))
        elif isinstance(item, ShardedTensor):
            shards.append(item)
    return shards


GlobalValue = Callable[[str, tuple[int, ...], tuple[int, ...]], torch.Tensor]


@torch.no_grad()
def fill_weights(model_chunks: list[torch.nn.Module], value: GlobalValue) -> None:
    """Set every weight of the model chunks (DDP-wrapped or not) from its global value.

    ``value(key, layer_index, global_shape)`` gives a whole tensor as megatron's sharded state
    dict names it (``layer_index`` is ``(layer,)`` for per-layer tensors, ``()`` otherwise);
    every rank keeps its own TP slice of it.
    """
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    for chunk in model_chunks:
        for shard in _shards(getattr(chunk, "module", chunk).sharded_state_dict(metadata=metadata)):
            if shard.data is None or not shard.data.is_floating_point():
                continue
            pre = shard.prepend_axis_num
            full = value(shard.key, shard.global_offset[:pre], shard.global_shape[pre:])
            index = tuple(
                slice(offset, offset + size)
                for offset, size in zip(shard.global_offset[pre:], shard.local_shape)
            )
            shard.data.copy_(full[index].to(device=shard.data.device, dtype=shard.data.dtype))


def initialize_weights(model_chunks: list[torch.nn.Module], seed: int, std: float, num_layers: int) -> None:
    """Give every parameter its layout-independent random initial value."""

    def value(key: str, layer_index: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        # Drawn on the CPU everywhere, so a GPU run starts from the CPU run's weights.
        gen = torch.Generator()
        gen.manual_seed(seed ^ zlib.crc32(f"{key}|{layer_index}".encode()))
        return _init_global(key, shape, std, num_layers, gen)

    fill_weights(model_chunks, value)


def mark_tensor_parallel_weights(model_chunks: list[torch.nn.Module]) -> None:
    """Tag the weights megatron's parallel layers split over TP ranks.

    megatron-core sets ``tensor_model_parallel`` on these weights only inside its own weight
    init, which we turn off; untagged, the gradient norm (and so clipping) counts every split
    weight on TP rank 0 alone and comes out too small at TP > 1.
    """
    split_dims = ((ColumnParallelLinear, 0), (VocabParallelEmbedding, 0), (RowParallelLinear, 1))
    for chunk in model_chunks:
        for module in chunk.modules():
            weight = getattr(module, "weight", None)
            if weight is None or getattr(weight, "tensor_model_parallel", False):
                continue
            for layer_type, dim in split_dims:
                if isinstance(module, layer_type):
                    set_tensor_model_parallel_attributes(weight, True, dim, 1)
                    break
