"""Where this process runs, read from the launcher's environment before any process group exists
(and without torch, for the tools that never import it): its rank and its node."""

from __future__ import annotations

import os
import socket


def launcher_rank() -> str:
    """The rank torchrun or srun gave this process ("0" without a launcher), read from the pair of
    variables :func:`megatron_train.runtime.launch_env` starts from."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        text = env["RANK"]
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        text = env["SLURM_PROCID"]
    else:
        return "0"
    # No launcher sets a rank that is not a number: it was set by hand, for one process, which
    # reports its error at once as rank 0 does rather than wait for a rank 0 that is not there.
    return str(int(text)) if text.isascii() and text.isdigit() else "0"


def node_name() -> str:
    """The node this process runs on: Slurm's name for it, else the host name (Slurm may run
    several named nodes on one host)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()
