"""When to stop early: signals, a wall-clock budget and the run's folders gone, agreed by all
ranks once a step.

Every rank catches SIGTERM, SIGUSR1, SIGINT and SIGHUP (schedulers' preemption, Slurm's
pre-timeout signal, Ctrl-C, a closed terminal or ssh session) and only sets a flag; the train
loop finishes its step, then all ranks agree through one small all-reduce, so they save the same
step and stop together. The same all-reduce agrees on the elapsed time, which the checkpoint
policy's minute interval reads. A second SIGINT falls back to Python's default and interrupts
at once. A run directory or save dir removed or moved away while the run trains (rank 0 holds
their locks, so it sees that) stops the run the same way: the stop's save makes the save dir
anew, and the run resumes from it, where its next save would have failed or written alone into
a new folder.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_train import run_lock

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)


def leave_the_stop_signals_to_the_rank(worker_id: int) -> None:
    """A data loader worker's start (``worker_init_fn``): a SIGTERM ends it only when its rank
    sent it.

    torchrun signals each rank's whole process group, Slurm's cgroup process tracking (scancel)
    and ``pkill -f`` every process: torch's worker handler dies of a SIGTERM from anyone but its
    rank, and the rank's stop save failed on its loader's error. The SIGTERM with which the loader
    ends a worker that does not stop must still end it (ignored, the rank hung at exit); the
    stop signals other than SIGTERM meet the rank's handler, which the worker inherited and which
    only notes them.
    """
    rank = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    threading.Thread(target=_end_at_sigterm_from, args=(rank,), daemon=True).start()


def _end_at_sigterm_from(sender: int) -> None:
    while signal.sigwaitinfo({signal.SIGTERM}).si_pid != sender:
        pass
    os._exit(0)  # as torch's own handler ends a worker at its loader's SIGTERM


@dataclass(frozen=True)
class Decision:
    """What all ranks agreed on after a step."""

    stop_signal: int | None
    """The signal that asks us to stop (the largest number any rank received), or None."""
    out_of_time: bool
    """train.exit_after_minutes has passed."""
    elapsed_s: float
    """Seconds since the start (the longest any rank measured)."""
    folders_gone: bool = False
    """The run directory or save dir was removed or moved away (:func:`run_lock.moved_away`)."""

    @property
    def stop(self) -> bool:
        """Save and exit now."""
        return self.stop_signal is not None or self.out_of_time or self.folders_gone


class StopWatch:
    """Signal flags, a clock and the run's folders, turned into one agreed :class:`Decision` per step."""

    def __init__(self, exit_after_minutes: float, device: torch.device) -> None:
        self.exit_after_minutes = exit_after_minutes
        self.device = device
        self.started = time.monotonic()
        self.received: int | None = None
        self.gone: list[Path] = []
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}

    def _on_signal(self, signum: int, frame) -> None:
        if self.received == signal.SIGINT and signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.received = signum

    def decide(self) -> Decision:
        """Agree across all ranks (one all-reduce of four integers)."""
        elapsed = time.monotonic() - self.started
        budget_s = self.exit_after_minutes * 60
        self.gone = run_lock.moved_away()
        flags = torch.tensor(
            [
                self.received or 0,
                int(budget_s > 0 and elapsed >= budget_s),
                int(elapsed * 1000),
                len(self.gone),
            ],
            dtype=torch.int64,
            device=self.device,
        )
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        signum, out_of_time, elapsed_ms, gone = flags.tolist()
        return Decision(
            stop_signal=signum or None,
            out_of_time=bool(out_of_time),
            elapsed_s=elapsed_ms / 1000,
            folders_gone=bool(gone),
        )

    def why(self, decision: Decision) -> str:
        """What asked ``decision`` to stop, for the log."""
        if decision.stop_signal:
            return f"signal {signal.Signals(decision.stop_signal).name}"
        if decision.folders_gone:
            # Rank 0, which writes the log, holds the folders' locks and so knows which.
            names = " and ".join(map(str, self.gone)) or "the run's folder"
            return f"{names} removed or moved away while the run trained (the save makes it anew)"
        return f"train.exit_after_minutes={self.exit_after_minutes}"

    def close(self) -> None:
        """Give the signals back to their previous handlers."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
