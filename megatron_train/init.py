"""Weight initialisation that does not depend on the parallel layout.

Each global tensor (as megatron's sharded state dict names it) is drawn from a generator seeded
by its name, layer and the run seed; every rank then keeps its own slice. A model therefore
starts from the same weights at any TP / PP / VPP / DP, which makes runs comparable across
layouts and lets a job change layout without changing its initial point.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from megatron_train.config import ModelConfig
from megatron_train.models.family import Family


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


def initialize_weights(
    model_chunks: list[torch.nn.Module], family: Family, m: ModelConfig, seed: int
) -> None:
    """Give every parameter its layout-independent random initial value (the family's init rule)."""

    def value(key: str, layer_index: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        # Drawn on the CPU everywhere, so a GPU run starts from the CPU run's weights.
        gen = torch.Generator()
        gen.manual_seed(seed ^ zlib.crc32(f"{key}|{layer_index}".encode()))
        return family.initial_value(m, key, shape, gen)

    fill_weights(model_chunks, value)
