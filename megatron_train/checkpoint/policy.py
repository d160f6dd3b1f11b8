"""When to save: every N steps, every N minutes, after the last step, and when asked to stop.

Pure bookkeeping on numbers every rank agrees on (the step, and the elapsed time and stop flag
of one all-reduce in ``stopping``), so all ranks reach the same answer without talking.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_train.config import ExperimentConfig


@dataclass
class SavePolicy:
    """The save cadence of ``checkpoint.*`` for a run of ``last_step`` steps."""

    every_steps: int
    every_minutes: float
    at_end: bool
    last_step: int
    last_save_s: float = 0.0
    """Agreed elapsed seconds at the last save (the run's start before the first)."""

    @classmethod
    def from_config(cls, cfg: ExperimentConfig) -> SavePolicy:
        """The policy ``checkpoint.interval``, ``interval_minutes`` and ``save_at_end`` set."""
        c = cfg.checkpoint
        return cls(c.interval, c.interval_minutes, c.save_at_end, cfg.train.steps)

    def reason(self, step: int, elapsed_s: float, stopping: bool) -> str | None:
        """Why ``step`` must be saved, or None when it need not be."""
        if stopping:
            return "stop"
        if step == self.last_step and self.at_end:
            return "end of run"
        if self.every_steps and step % self.every_steps == 0:
            return "step interval"
        if self.every_minutes and elapsed_s - self.last_save_s >= self.every_minutes * 60:
            return "minute interval"
        return None

    def saved(self, elapsed_s: float) -> None:
        """A save happened at ``elapsed_s``: the minute interval counts from here."""
        self.last_save_s = elapsed_s
