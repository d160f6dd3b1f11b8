"""When to checkpoint and stop early: signals, a wall-clock budget, a save interval in minutes.

Every rank catches SIGTERM, SIGUSR1 and SIGINT (Slurm's pre-timeout signal, schedulers'
preemption, Ctrl-C) and only sets a flag; the train loop finishes its step, then all ranks
agree through one small all-reduce, so they save the same step and stop together. A second
SIGINT falls back to Python's default and interrupts at once.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass

import torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


@dataclass(frozen=True)
class Decision:
    """What all ranks agreed on after a step."""

    stop_signal: int | None
    """The signal that asks us to stop (the largest number any rank received), or None."""
    out_of_time: bool
    """train.exit_after_minutes has passed."""
    save_by_time: bool
    """checkpoint.interval_minutes has passed since the last save."""

    @property
    def stop(self) -> bool:
        """Save and exit now."""
        return self.stop_signal is not None or self.out_of_time


class StopWatch:
    """Signal flags and clocks, turned into one agreed :class:`Decision` per step."""

    def __init__(self, exit_after_minutes: float, save_interval_minutes: float, device: torch.device) -> None:
        self.exit_after_s, self.save_interval_s = exit_after_minutes * 60, save_interval_minutes * 60
        self.device = device
        self.started = self.last_save = time.monotonic()
        self.received: int | None = None
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}

    def _on_signal(self, signum: int, frame) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.received = signum

    def saved(self) -> None:
        """Restart the save-interval clock."""
        self.last_save = time.monotonic()

    def decide(self) -> Decision:
        """Agree across all ranks (one all-reduce of three integers)."""
        now = time.monotonic()
        flags = torch.tensor(
            [
                self.received or 0,
                int(self.exit_after_s > 0 and now - self.started >= self.exit_after_s),
                int(self.save_interval_s > 0 and now - self.last_save >= self.save_interval_s),
            ],
            dtype=torch.int64,
            device=self.device,
        )
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        signum, out_of_time, by_time = flags.tolist()
        return Decision(stop_signal=signum or None, out_of_time=bool(out_of_time), save_by_time=bool(by_time))

    def close(self) -> None:
        """Give the signals back to their previous handlers."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
