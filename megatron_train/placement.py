"""Where this process runs, read from the launcher's environment before any process group exists
(and without torch, for the tools that never import it): its rank and its node."""

from __future__ import annotations

import os
import socket


def launcher_variables() -> tuple[str, str, str, str] | None:
    """The names of this process's rank, world size, local rank and local world size, from the
    launcher that set them: torchrun's, else srun's (pretrain.sbatch sets ``--ntasks-per-node``,
    so SLURM_NTASKS_PER_NODE is there); None without a launcher (one process)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"
    if "SLURM_PROCID" in os.environ and "SLURM_NTASKS" in os.environ:
        return "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"
    return None


def launcher_rank() -> str:
    """The rank the launcher gave this process (:func:`launcher_variables`; "0" without one)."""
    names = launcher_variables()
    text = os.environ[names[0]] if names else "0"
    # No launcher sets a rank that is not a number: it was set by hand, for one process, which
    # reports its error at once as rank 0 does rather than wait for a rank 0 that is not there.
    return str(int(text)) if text.isascii() and text.isdigit() else "0"


def node_name() -> str:
    """The node this process runs on: Slurm's name for it, else the host name (Slurm may run
    several named nodes on one host)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()
