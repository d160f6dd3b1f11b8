"""Where this process runs, read from the launcher's environment before any process group exists
(and without torch, for the tools that never import it): its rank and its node."""

from __future__ import annotations

import os
import socket


def launcher_rank() -> str:
    """The rank torchrun or srun gave this process ("0" without a launcher)."""
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))


def node_name() -> str:
    """The node this process runs on: Slurm's name for it, else the host name (Slurm may run
    several named nodes on one host)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()
