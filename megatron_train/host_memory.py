"""How much memory this machine has, in the two senses the checks need.

A run's estimate is sized against the machine's total (:func:`physical_memory`): a training job is
meant to have its node to itself, and what other processes hold now is theirs to give back. The
launcher's check on a rank count uses :func:`available_memory`: starting ranks that cannot all fit
in what is free now would push the machine's other work into the out-of-memory killer before any
rank got as far as refusing its config.
"""

from __future__ import annotations

import os


def physical_memory() -> int:
    """Bytes of memory this machine has."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def available_memory() -> int | None:
    """Bytes this machine can still give without swapping (Linux's MemAvailable); None where the
    kernel does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
