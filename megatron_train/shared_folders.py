"""The folders every rank of a multi-node run reads what another rank wrote in are one folder on
every node. A node-local path there (``/tmp``, a node's own NVMe) gives each node a copy of its
own: the ranks of other nodes find none of the data indices rank 0 built, and each checkpoint
would hold only the shards of the node that records it, recorded complete all the same (and
older, whole checkpoints rotated away). Checked once at start, before anything is built there.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import torch.distributed as dist

from megatron_train import placement
from megatron_train.errors import ConfigError

# A network file system may show a new file to the other nodes only once their cached view of
# the folder expires (NFS caches a folder's attributes for up to acdirmax, 60 s by default).
_PATIENCE_S = 60.0


def _sees(folder: Path, name: str) -> bool:
    deadline = time.monotonic() + _PATIENCE_S
    while True:
        try:
            # Listing opens the folder, which revalidates a network file system's cached view.
            if name in os.listdir(folder):
                return True
        except OSError:  # not there (yet) on this node
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(1.0)


def _existing(folder: Path) -> Path | None:
    """``folder`` or the nearest folder above it that exists, when rank 0 may write there (a
    folder it may not is refused where the run would write it)."""
    folder = folder.absolute()
    while not folder.is_dir():
        folder = folder.parent
    return folder if os.access(folder, os.W_OK) else None


def check_shared(folders: list[tuple[str, Path]], rank: int) -> None:
    """Raise the same ConfigError on every rank when a rank on another node than rank 0 does not
    see a file rank 0 wrote where one of ``folders`` is (each with the config key that placed it).
    A run on one node is not checked (one node sees its own files)."""
    nodes: list = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, placement.node_name())
    if len(set(nodes)) == 1:
        return
    # Rank 0 writes into each folder, or the nearest folder above it that exists yet (on the same
    # file system, and a failed start leaves no new folder behind).
    probe = [(secrets.token_hex(8), [_existing(folder) for _, folder in folders]) if rank == 0 else None]
    dist.broadcast_object_list(probe, src=0)
    token, where = probe[0]
    name = f".shared-check-{token}"
    if rank == 0:
        for folder in where:
            if folder is not None:
                (folder / name).touch()
    try:
        dist.barrier()
        elsewhere = nodes[rank] != nodes[0]
        unseen = [i for i, folder in enumerate(where) if folder and elsewhere and not _sees(folder, name)]
        found: list = [None] * len(nodes)
        dist.all_gather_object(found, unseen)
    finally:
        if rank == 0:
            for folder in where:
                if folder is not None:
                    (folder / name).unlink(missing_ok=True)
    for other, unseen in enumerate(found):
        if unseen:
            key, folder = folders[unseen[0]]
            raise ConfigError(
                key,
                f"{folder} is not on one file system for every node: rank {other} on {nodes[other]} does "
                f"not see the file rank 0 on {nodes[0]} wrote in {where[unseen[0]]} (is it local to each "
                "node?)",
                "point it at a file system every node mounts",
            )
