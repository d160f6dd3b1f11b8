"""Process groups, device and seeds: everything set up once per process before the model."""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import random
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_train import cpu_compat, placement, rendezvous
from megatron_train.config import MINUTES_A_YEAR, MINUTES_SHORTEST, ExperimentConfig, dotted_leaves, to_dict
from megatron_train.errors import ConfigError


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, read from torchrun or Slurm variables."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int = 1
    """The ranks on this node."""


def launch_env() -> LaunchEnv:
    """This process's rank from torchrun (RANK...) or srun (SLURM_PROCID...); else one process."""
    env = os.environ
    names = placement.launcher_variables()
    if names is None:
        return LaunchEnv(0, 1, 0)
    defaults = (None, None, "0", "1")
    values = []
    # Sizes count at least one rank; str.isdigit alone would pass a "²" int() cannot read.
    for name, default, least in zip(names, defaults, (0, 1, 0, 1), strict=True):
        text = env.get(name, default)
        if not (text.isascii() and text.isdigit() and int(text) >= least):
            raise ConfigError(
                name,
                f"the launcher set {name}={text!r}, not a count" + (" of ranks" if least else ""),
                "start the ranks with torchrun or srun",
            )
        values.append(int(text))
    rank, world, local_rank, local_world = values
    if not rank < world:
        raise ConfigError(
            names[0],
            f"rank {rank} is outside a world of {world} ranks ({names[1]}), so it would wait forever for "
            "the others",
            "start the ranks with torchrun or srun, which set both",
        )
    check_rendezvous(env)
    return LaunchEnv(rank, world, local_rank, local_world)


def check_rendezvous(env: dict[str, str]) -> None:
    """The rendezvous variables torch reads, and the collective timeout, are usable: a bad port is
    a traceback deep in torch, and an address that does not resolve retries until torch's
    rendezvous gives up minutes later."""
    port = env.get("MASTER_PORT")
    if port is not None and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(
            "MASTER_PORT",
            f"the launcher set MASTER_PORT={port!r}, not a port",
            "use a free port from 1 to 65535",
        )
    addr = env.get("MASTER_ADDR")
    if addr is not None:
        try:
            socket.getaddrinfo(addr, None)
        except (socket.gaierror, UnicodeError) as err:
            raise ConfigError(
                "MASTER_ADDR",
                f"the launcher set MASTER_ADDR={addr!r}, which does not resolve ({err})",
                "set it to the first node's host name or address",
            ) from None
    collective_timeout()


@dataclass(frozen=True)
class Runtime:
    """The initialised process: its rank, device, compute dtype and parallel coordinates."""

    rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype

    @property
    def is_main(self) -> bool:
        """Rank 0 prints and writes shared files."""
        return self.rank == 0


def compute_dtype(cfg: ExperimentConfig) -> torch.dtype:
    """bf16 on GPU and fp32 on CPU unless the config says otherwise."""
    if cfg.train.precision == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32


def initialize(cfg: ExperimentConfig, env: LaunchEnv) -> Runtime:
    """Join the process group, build megatron's parallel groups and seed every RNG."""
    if torch.cuda.is_available():
        # Slurm may give each task one visible GPU (--gpus-per-task), torchrun all of the node's.
        index = env.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        device, backend = torch.device("cuda", index), "nccl"
    else:
        cpu_compat.enable()
        device, backend = torch.device("cpu"), "gloo"
    timeout = collective_timeout()
    rendezvous.join(env.rank, env.world_size, backend, timeout)
    check_same_config(cfg, env.rank, env.world_size)
    p = cfg.parallel
    parallel_state.initialize_model_parallel(
        # The groups training's collectives run in: megatron's own default waits 30 minutes.
        distributed_timeout_minutes=timeout.total_seconds() / 60,
        tensor_model_parallel_size=p.tensor,
        pipeline_model_parallel_size=p.pipeline,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline if (p.virtual_pipeline or 1) > 1 else None,
        context_parallel_size=p.context,
        expert_model_parallel_size=p.expert,
        expert_tensor_parallel_size=p.expert_tensor,
    )
    seed_everything(cfg.train.seed)
    return Runtime(env.rank, env.world_size, device, compute_dtype(cfg))


def check_same_config(cfg: ExperimentConfig, rank: int, world_size: int) -> None:
    """Every rank resolved rank 0's config, before any group is built from it: ranks started from
    other files or overrides (a node's own copy of the config, a command line typed differently
    on one node) build other layouts or models, and the first collective between them aborted
    the process in gloo (or waits out the timeout in NCCL)."""
    if world_size == 1:
        return
    mine = dotted_leaves(to_dict(cfg))
    theirs = [mine if rank == 0 else None]
    dist.broadcast_object_list(theirs, src=0)
    reference = theirs[0]
    differ = sorted(key for key in reference.keys() | mine.keys() if reference.get(key) != mine.get(key))
    found = [None] * world_size
    dist.all_gather_object(found, (differ, mine.get(differ[0]) if differ else None, placement.node_name()))
    others = [r for r, (keys, _, _) in enumerate(found) if keys]
    if not others:
        return
    keys, value, node = found[others[0]]
    more = f" (and {len(keys) - 1} other key{'s' * (len(keys) > 2)})" if len(keys) > 1 else ""
    # Where every other rank differs, rank 0 is the odd one: the count says so.
    also = len(others) - 1
    ranks = f"rank {others[0]} ({node})" + (f" and {also} other rank{'s' * (also > 1)}" if also else "")
    raise ConfigError(
        keys[0],
        f"is {value!r} on {ranks} but {reference.get(keys[0])!r} on rank 0 of {world_size}{more}: "
        "the ranks were started with different configs",
        "start every rank with the same config file and overrides",
    )


def collective_timeout() -> datetime.timedelta:
    """How long a collective may wait before the job fails: ``$MEGATRON_TRAIN_DIST_TIMEOUT_MIN``
    minutes (10, as torch's NCCL default), so a hung rank ends the job instead of its allocation."""
    text = os.environ.get("MEGATRON_TRAIN_DIST_TIMEOUT_MIN", "10")
    try:
        minutes = float(text)
    except ValueError:
        minutes = math.nan
    if not (math.isfinite(minutes) and MINUTES_SHORTEST <= minutes <= MINUTES_A_YEAR):
        raise ConfigError(
            "MEGATRON_TRAIN_DIST_TIMEOUT_MIN",
            f"{text!r} is not a number of minutes from {MINUTES_SHORTEST} ({MINUTES_SHORTEST * 60:g} s) "
            f"to a year ({MINUTES_A_YEAR:,})",
            "set it to how long a collective may wait, e.g. 10",
        )
    return datetime.timedelta(minutes=minutes)


@contextlib.contextmanager
def patient_collectives(minutes: float) -> Iterator[None]:
    """The default group's collectives may wait up to ``minutes`` inside the block.

    megatron's dataset builder builds the index on rank 0 while the other ranks wait in a
    barrier; for a large blend that takes longer than a training collective may wait.
    """
    set_timeout = dist.distributed_c10d._set_pg_timeout  # torch's only per-group timeout setter
    set_timeout(datetime.timedelta(minutes=minutes))
    try:
        yield
    finally:
        set_timeout(collective_timeout())


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch, and megatron's model-parallel RNG tracker.

    Pipeline stages get distinct streams (as in Megatron-LM) so their dropout masks differ.
    """
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    # NumPy's legacy seed stops at 2**32 - 1, which train.seed may be before a stage's offset.
    np.random.seed(stage_seed % 2**32)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)


def shutdown() -> None:
    """Tear down megatron's groups and the process group."""
    if dist.is_initialized():
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
