"""Ending a process with the one that started it: torchrun starts its ranks in sessions of their
own, so a launcher killed outright (kill -9, the out-of-memory killer) left them running unseen,
holding the run directory and the devices; a checkpoint writer forked by a rank, likewise."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

# Looked up at import, not in a forked child: loading a library there can deadlock on a lock
# another thread of the parent held at the fork.
_PRCTL = ctypes.CDLL(None).prctl if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1
# This process's parent as it started: under torchrun, its launcher. The package imports this
# module first thing, for a parent that dies in the seconds a rank takes to import torch.
_PARENT = os.getppid()


def signal_at_parent_death(signum: int) -> None:
    """Have the kernel send ``signum`` to this process when its parent exits (Linux only)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signum)


def end_with_the_launcher() -> None:
    """Under torchrun, end this rank when its launcher exits: by SIGTERM, which a rank's stop
    watch turns into a save and a stop once training began, a tool's handler into its clean-up,
    and which ends it before (ranks still meeting at the launcher's store waited there for the
    collective timeout)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    signal_at_parent_death(signal.SIGTERM)
    if os.getppid() != _PARENT:  # it died before the kernel was told
        os.kill(os.getpid(), signal.SIGTERM)
