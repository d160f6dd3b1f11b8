"""Python's garbage collection at the same steps on every rank (``train.gc_interval``).

CPython collects whenever allocations pass its thresholds, so each rank pauses at its own moments
while the others wait for it in the next collective; a collection of the oldest generation scans
every object torch and megatron-core built (about 0.2 s on the 2-core dev machine for a tiny model,
``benchmarks/gc_pauses.py``). Paced, the step loop runs with automatic collection off: what was
built before it is collected once and then moved out of the collector's view (``gc.freeze``), and
every rank collects the young generations after the same steps, as torchtitan's
``training.gc_freq`` and Megatron-LM's ``--manual-gc`` do.
"""

from __future__ import annotations

import gc
import os
from types import TracebackType

_paced = False


def _collect_automatically_in_child() -> None:
    # A process forked inside the loop (a data loader worker, a checkpoint writer) has no
    # schedule of its own: with collection off, its garbage would never be collected.
    if _paced:
        gc.enable()


os.register_at_fork(after_in_child=_collect_automatically_in_child)


class GcPacing:
    """A context around the step loop; :meth:`after_step` collects every ``interval`` steps (0
    leaves Python's automatic collection as it is)."""

    def __init__(self, interval: int) -> None:
        self.interval = interval

    def __enter__(self) -> GcPacing:
        global _paced
        if self.interval:
            gc.collect()
            gc.freeze()
            gc.disable()
            _paced = True
        return self

    def after_step(self, step: int) -> None:
        """Collect the young generations after every ``interval``-th step (on every rank alike)."""
        if self.interval and step % self.interval == 0:
            gc.collect(1)

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, trace: TracebackType | None
    ) -> None:
        global _paced
        if _paced:
            _paced = False
            gc.unfreeze()
            gc.enable()
