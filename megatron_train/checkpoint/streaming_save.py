"""Write a weights-only checkpoint in megatron's torch_dist format, one layer of one tensor at a time.

``dist_checkpointing.save`` needs every tensor in memory at once, which for an imported 70B model
is the whole model. The files it writes are PyTorch Distributed Checkpoint (DCP) files plus
megatron's ``metadata.json`` and ``common.pt``, so we write the same: a DCP save whose planner
declares each per-layer (or per-expert) slice as a chunk of the stacked global tensor (as a pipeline-parallel
save would) and produces its data only when the writer asks (``SavePlanner.resolve_data``, the
hook DCP provides for lazy data). One file per chunk keeps the writer from holding a file's
tensors together. megatron's loader then reads it at any TP / PP like any other checkpoint.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from megatron_train.errors import BAD_INPUT
from megatron_train.megatron_compat import write_checkpoint_extras
from megatron_train.models.family import Index, Tensor

Produce = Callable[[str, Index], torch.Tensor]


class _LazyPlanner(DefaultSavePlanner):
    def __init__(self, items: list[WriteItem], stacked: dict[str, int], produce: Produce) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items, self._stacked, self._produce = items, stacked, produce

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        key = write_item.index.fqn
        axes = self._stacked[key]
        index = tuple(write_item.tensor_data.chunk.offsets[:axes])
        return self._produce(key, index)[(None,) * axes]


def _write_items(tensors: list[Tensor], num_layers: int, dtype: torch.dtype) -> list[WriteItem]:
    properties = TensorProperties(dtype=dtype)
    items = []
    for t in tensors:
        size = torch.Size(t.global_shape(num_layers))
        for index in t.indices(num_layers):
            offsets = torch.Size((*index, *[0] * len(t.shape)))
            sizes = torch.Size((*[1] * len(index), *t.shape))
            items.append(
                WriteItem(
                    index=MetadataIndex(t.key, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(ChunkStorageMetadata(offsets, sizes), properties, size),
                )
            )
    return items


def save_weights(
    ckpt_dir: Path, tensors: list[Tensor], num_layers: int, dtype: torch.dtype, produce: Produce, common: dict
) -> None:
    """Write ``tensors`` (each slice from ``produce(key, index)``) and ``common`` to ``ckpt_dir``.

    Tensors are keyed by their sharded keys, as in a training checkpoint; ``common`` is the
    non-tensor state (config, progress, layout...). Needs a (one-rank) process group.
    """
    ckpt_dir.mkdir(parents=True)

    def produce_cast(key: str, index: Index) -> torch.Tensor:
        return produce(key, index).to(dtype).contiguous()

    stacked = {t.key: len(t.index_shape(num_layers)) for t in tensors}
    planner = _LazyPlanner(_write_items(tensors, num_layers, dtype), stacked, produce_cast)
    writer = dcp.FileSystemWriter(str(ckpt_dir), single_file_per_rank=False, thread_count=1)
    with warnings.catch_warnings():
        # torch warns that it "assumes" a single process even when no_dist=True says so.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        try:
            dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as err:
            # ``produce`` runs inside DCP's write, which wraps what it raises: a bad input found
            # only there (a damaged tensor) is reported as itself.
            bad = [exc for exc, _ in err.failures.values() if isinstance(exc, BAD_INPUT)]
            if bad:
                raise bad[0] from None
            raise
    write_checkpoint_extras(common, ckpt_dir)
