"""A torch profiler trace of the training steps ``profile.*`` names, on the ranks it names."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from megatron_train.config import RUN_FOLDERS, ExperimentConfig
from megatron_train.metrics import MetricsLogger

_MEMORY_EVENTS = 100_000
"""Allocation events a CUDA memory snapshot keeps (torch's own example's figure)."""


class StepProfiler:
    """Starts torch's profiler before the first profiled step and writes the trace after the
    last one. Every rank takes part, the unprofiled ones in the barrier after the writing, and
    the writing is left out of the logged step time."""

    def __init__(
        self, cfg: ExperimentConfig, rank: int, device: torch.device, first_step: int, log: MetricsLogger
    ) -> None:
        self.options, self.rank, self.device, self.log = cfg.profile, rank, device, log
        self.folder = Path(cfg.logging.run_dir) / RUN_FOLDERS["profile.start_step"].name
        self.window: tuple[int, int] | None = None
        self._profiler: torch.profiler.profile | None = None
        self._recorded: int | None = None
        start = self.options.start_step
        if start is None:
            return
        last = start + self.options.num_steps - 1
        if first_step > last:
            log.info(
                f"profile: steps {start}-{last} were trained before this start (it resumes at step "
                f"{first_step}); nothing is profiled (a later profile.start_step would be)"
            )
            return
        self.window = (max(start, first_step), last)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one training step: recorded when the window holds it, written after the last."""
        if self.window is None or not self.window[0] <= step <= self.window[1]:
            yield
            return
        records = self.rank in self.options.ranks
        if step == self.window[0] and records:
            self._start()
        with torch.profiler.record_function(f"train step {step}") if records else contextlib.nullcontext():
            yield
        self._recorded = step
        if step == self.window[1]:
            self._finish()

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_) -> None:
        """Drop the trace of a window that a stop or a failed step cut short: writing it would
        delay a stop, which a preempted job must finish (its save recorded) before it is killed."""
        if kind is None and self.window is not None and self._recorded is not None:
            self.log.info(
                f"profile: the run stopped after step {self._recorded}, inside the profiled steps "
                f"{self.window[0]}-{self.window[1]}; their trace is not written"
            )
        self._stop()

    def _finish(self) -> None:
        """Write the trace; every rank calls it after the window's last step."""
        first, last = self.window
        self.window = None
        with self.log.left_out():
            if self._profiler is not None:
                self._write(first, last)
            torch.distributed.barrier()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        if self.options.memory and self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=_MEMORY_EVENTS)
        self._profiler = torch.profiler.profile(
            activities=activities,
            record_shapes=self.options.record_shapes,
            profile_memory=self.options.memory,
        )
        self._profiler.start()

    def _stop(self) -> torch.profiler.profile | None:
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.stop()
            if self.options.memory and self.device.type == "cuda":
                torch.cuda.memory._record_memory_history(enabled=None)
        return profiler

    def _write(self, first: int, last: int) -> None:
        began = time.perf_counter()
        steps = f"{first}" if first == last else f"{first}-{last}"
        folder, named = self.folder / f"step{steps}", f"step{'s' * (first < last)} {steps}"
        trace = folder / f"rank{self.rank}.json.gz"
        snapshot = folder / f"rank{self.rank}.memory.pickle"
        with_snapshot = self.options.memory and self.device.type == "cuda"
        # Each file is written under a hidden name first; torch gzips a trace whose name ends in .gz.
        partial, partial_snapshot = folder / f".{trace.name}", folder / f".{snapshot.name}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            if with_snapshot:
                torch.cuda.memory._dump_snapshot(str(partial_snapshot))
                os.replace(partial_snapshot, snapshot)
            profiler = self._stop()
            profiler.export_chrome_trace(str(partial))
            os.replace(partial, trace)
            sort = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            table = profiler.key_averages().table(sort_by=sort, row_limit=40)
            (folder / f"rank{self.rank}.txt").write_text(table + "\n")
        except OSError as err:
            for path in (partial, partial_snapshot):
                with contextlib.suppress(OSError):
                    path.unlink()
            print(
                f"warning: rank {self.rank}: the profile of {named} could not be written to "
                f"{folder} ({err.strerror or err}); training goes on without it",
                flush=True,
            )
            return
        finally:
            self._stop()
        also = f", CUDA memory snapshot {snapshot.name}" if with_snapshot else ""
        print(
            f"profile of {named} on rank {self.rank}: {trace} "
            f"({trace.stat().st_size / 2**20:.1f} MiB, written in {time.perf_counter() - began:.1f} s); "
            f"operators by their own time in rank{self.rank}.txt{also}",
            flush=True,
        )
