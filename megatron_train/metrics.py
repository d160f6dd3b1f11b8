"""What the run reports: one console line, one metrics.jsonl record, wandb and TensorBoard per
interval."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import resource
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import yaml

from megatron_train import json_text
from megatron_train.checkpoint.files import write_atomic
from megatron_train.config import RUN_FOLDERS, ConfigError, ExperimentConfig, to_dict
from megatron_train.errors import reason, shown
from megatron_train.models.registry import family_of

DATA_WAIT_SHOWN = 0.05
"""The share of the step time spent waiting for data from which the console line shows it: below
that the loader keeps up, and the figure is in metrics.jsonl."""

# Dense bf16 peak per GPU (TFLOP/s), for MFU; the first key found in torch.cuda.get_device_name()
# wins, so the PCIe and NVL cards come before the SXM ones ("NVIDIA H100 80GB HBM3", "NVIDIA H200").
_PEAK_TFLOPS = {"H100 PCIe": 756.0, "H100 NVL": 835.0, "H100": 989.0, "H200 NVL": 835.0, "H200": 989.0,
                "A100": 312.0, "L40S": 362.0}  # fmt: skip


def flops_per_token(cfg: ExperimentConfig) -> float:
    """Training FLOPs per token of the configured model at the configured sequence length."""
    return family_of(cfg.model).flops_per_token(cfg.model, cfg.data.seq_length)


def peak_tflops() -> float | None:
    """The GPU's dense bf16 peak, or None when unknown or on CPU."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in _PEAK_TFLOPS.items() if k in name), None)


def peak_memory_gib() -> float:
    """Peak allocated GPU memory, or this process's peak RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def check_wandb(cfg: ExperimentConfig) -> None:
    """A wandb run can start: wandb takes its project name, and an online run has credentials.
    Otherwise ``wandb.init`` raises on rank 0 once the model is built and the run directory
    written. The name is judged by wandb's own settings; the credentials are read as ``wandb
    login`` would (the environment, wandb's settings, ~/.netrc), without asking or contacting
    the server."""
    if not cfg.logging.wandb:
        return
    import wandb

    try:
        wandb.Settings(project=cfg.logging.wandb_project)
    except (wandb.errors.UsageError, ValueError) as err:
        raise ConfigError(
            "logging.wandb_project",
            f"wandb refuses {shown(cfg.logging.wandb_project)}: {reason(err)}",
            "choose a name wandb takes",
        ) from None
    if cfg.logging.wandb_mode != "online":
        return

    fix = (
        "run `wandb login` (or export WANDB_API_KEY) where the job runs, or set "
        "logging.wandb_mode=offline and sync later with `wandb sync`"
    )
    try:
        # Its notes on where it found the key would stand above the run's own lines (or error).
        with contextlib.redirect_stderr(io.StringIO()):
            logged_in = wandb.login(prompt=False, verify=False)
    except wandb.errors.Error as err:
        raise ConfigError("logging.wandb_mode", f"is online but {str(err).rstrip('.')}", fix) from None
    if not logged_in:
        raise ConfigError(
            "logging.wandb_mode", "is online but wandb finds no API key here (WANDB_API_KEY, ~/.netrc)", fix
        )


def _start_wandb(cfg: ExperimentConfig, run_dir: Path):
    """The wandb run, or a ConfigError saying why wandb could not start one (a server it cannot
    reach, a key the server refuses): wandb's own error is a traceback, after its timeout, and
    its folder is left as it was."""
    import wandb

    folder = run_dir / RUN_FOLDERS["logging.wandb"].name
    before = _entries(folder)
    # Silent: wandb's service would print where a failed start's logs are below the one-line error
    # (the run's own line is ours, in open). Its login note is shown once the run has started.
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            run = wandb.init(
                project=cfg.logging.wandb_project,
                dir=str(run_dir),
                mode=cfg.logging.wandb_mode,
                config=to_dict(cfg),
                settings=wandb.Settings(silent=True),
            )
        sys.stderr.write(said.getvalue())
        return run
    except wandb.errors.Error as err:
        wandb.teardown()  # its service closes the attempt's files before they are removed
        _restore(folder, before)
        why = str(err).strip().splitlines()[0].rstrip(".") if str(err).strip() else type(err).__name__
        raise ConfigError(
            "logging.wandb",
            f"wandb could not start its {cfg.logging.wandb_mode} run: {why}",
            "check that the nodes reach the wandb server (WANDB_BASE_URL) with a valid key, or set "
            "logging.wandb_mode=offline and sync later with `wandb sync`",
        ) from None


def _entries(folder: Path) -> dict[str, str | None] | None:
    """``folder``'s entries, each with its link target (wandb points debug.log and latest-run at
    its newest run), or None when there is no such folder."""
    if not folder.is_dir():
        return None
    return {p.name: os.readlink(p) if p.is_symlink() else None for p in folder.iterdir()}


def _restore(folder: Path, before: dict[str, str | None] | None) -> None:
    """Remove what a failed wandb start added to ``folder`` and point its links back."""
    if before is None:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for name, target in _entries(folder).items():
        if name in before and before[name] == target:
            continue
        entry = folder / name
        if target is None and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink()
        if before.get(name) is not None:
            entry.symlink_to(before[name])


def _record(line: str) -> dict | None:
    """A metrics.jsonl line's record; None for a line that holds none of ours (torn by a kill, or
    edited by hand), which a restart drops."""
    try:
        record = json_text.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step", 0), int):
        return None
    return record


class MetricsLogger:
    """Writes metrics on the main rank; other ranks hold a no-op instance."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path, enabled: bool, world_size: int) -> None:
        self.enabled, self.world_size, self.total_steps = enabled, world_size, cfg.train.steps
        self.log_interval = cfg.logging.log_interval
        self.start_interval()
        self.tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_length
        self.flops_per_step = flops_per_token(cfg) * self.tokens_per_step
        self.peak = peak_tflops()
        self.cfg, self.run_dir = cfg, run_dir
        self._file = None
        self._wandb = None
        self._tensorboard = None

    def open(self, step: int) -> None:
        """Start writing into the run directory (the resolved config, metrics.jsonl, wandb), once
        every check of the start has passed; records after ``step`` are dropped (a resumed run
        redoes those steps, and a fresh start, after a crash before the first save, all of them)."""
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.cfg.logging.wandb:
            # First, so that a wandb that cannot start leaves a resumed run's files as they were.
            self._wandb = _start_wandb(self.cfg, self.run_dir)
            run = self._wandb
            if self.cfg.logging.wandb_mode == "online":
                self.info(f"wandb run {run.name}: {run.url}")
            else:
                self.info(f"wandb offline run {run.id}: `wandb sync {Path(run.dir).parent}` uploads it")
        if self.cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides the earlier events of the steps this start redoes, as metrics.jsonl
            # drops their records.
            self._tensorboard = SummaryWriter(
                self.run_dir / RUN_FOLDERS["logging.tensorboard"].name, purge_step=step + 1
            )
        # Whole or not at all: a start on a full disk left the run's config.yaml torn, and beside
        # its metrics an empty temporary file.
        write_atomic(self.run_dir / "config.yaml", yaml.safe_dump(to_dict(self.cfg), sort_keys=False))
        path = self.run_dir / "metrics.jsonl"
        if path.exists():
            kept = []
            # Ours are ASCII: bytes that are not UTF-8 come from a damaged or hand-edited line.
            for line in path.read_bytes().decode(errors="replace").splitlines():
                record = _record(line)
                if record is not None and record.get("step", 0) <= step:
                    kept.append(line + "\n")
            write_atomic(path, "".join(kept))
        self._file = open(path, "a")

    def _write(self, record: dict, group: str) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])
        if self._tensorboard is not None:
            for key, value in record.items():
                if key != "step":
                    self._tensorboard.add_scalar(f"{group}/{key}", value, record["step"])
            self._tensorboard.flush()

    def start_interval(self) -> None:
        """Start timing steps (just before the first one)."""
        self._interval_start, self._interval_steps = time.perf_counter(), 0

    @contextlib.contextmanager
    def left_out(self) -> Iterator[None]:
        """Leave the time spent inside (validation, say) out of the interval's step time, which
        is the interval's time divided by the steps it counted."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self._interval_start += time.perf_counter() - began

    def after_step(self, step: int, tokens: int, loss: float, lr: float, grad_norm: float, skipped: int,
                   moe: dict[str, float] | None = None, data_wait: float = 0.0) -> None:  # fmt: skip
        """Count a step (``tokens`` trained on so far); at each ``logging.log_interval`` and the
        last step, log the interval, over which the slowest rank waited ``data_wait`` seconds for
        its batches."""
        self._interval_steps += 1
        if not self.logs_at(step):
            return
        steps = self._interval_steps
        step_time = (time.perf_counter() - self._interval_start) / steps
        self.log_train(step, tokens, loss, lr, grad_norm, step_time, skipped, moe, data_wait / steps)
        self.start_interval()

    def logs_at(self, step: int) -> bool:
        """Whether ``step`` is logged (every ``logging.log_interval`` steps and the last); the same
        answer on every rank."""
        return step % self.log_interval == 0 or step == self.total_steps

    def log_train(self, step: int, tokens: int, loss: float, lr: float, grad_norm: float,
                  step_time: float, skipped: int, moe: dict[str, float] | None = None,
                  data_wait: float = 0.0) -> None:  # fmt: skip
        """One interval's line; ``step_time`` is the mean seconds per step over the interval, of
        which the slowest rank spent ``data_wait`` waiting for its data; ``moe`` holds a mixture of
        experts' router figures over the interval (``RouterStats``)."""
        if not self.enabled:
            return
        tokens_per_s = self.tokens_per_step / step_time
        tflops = self.flops_per_step / step_time / self.world_size / 1e12
        record = {
            "step": step,
            "consumed_tokens": tokens,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "step_time_s": step_time,
            "data_wait_s": data_wait,
            "tokens_per_s": tokens_per_s,
            "tflops_per_device": tflops,
            "peak_mem_gib": peak_memory_gib(),
            "skipped_steps": skipped,
            **(moe or {}),
        }
        mfu = f" | MFU {100 * tflops / self.peak:.1f}%" if self.peak else ""
        if self.peak:
            record["mfu"] = tflops / self.peak
        eta = _duration((self.total_steps - step) * step_time)
        router = "".join(
            f" | {label} {record[key]:{fmt}}"
            for key, label, fmt in [
                ("moe_aux_loss", "aux loss", ".4f"),
                ("moe_load_imbalance", "load max/mean", ".2f"),
            ]
            if key in record
        )
        waiting = (
            f" | data wait {100 * data_wait / step_time:.0f}%"
            if data_wait >= DATA_WAIT_SHOWN * step_time
            else ""
        )
        print(
            f"step {step}/{self.total_steps} | tokens {record['consumed_tokens']:,} | loss {loss:.4f}"
            f" | lr {lr:.3e} | grad norm {grad_norm:.3f}{router} | {step_time * 1000:.0f} ms/step{waiting}"
            f" | {tokens_per_s:,.0f} tok/s | {tflops:.3f} TFLOP/s/dev{mfu}"
            f" | mem {record['peak_mem_gib']:.2f} GiB | ETA {eta}",
            flush=True,
        )
        self._write(record, "train")

    def log_validation(self, step: int, val_loss: float) -> None:
        """A validation result."""
        if not self.enabled:
            return
        ppl = math.exp(min(val_loss, 50.0))
        print(f"validation at step {step} | val loss {val_loss:.4f} | val ppl {ppl:.2f}", flush=True)
        self._write({"step": step, "val_loss": val_loss}, "validation")

    def info(self, message: str) -> None:
        """A plain message from the main rank."""
        if self.enabled:
            print(message, flush=True)

    def close(self) -> None:
        """Flush and close outputs."""
        if self._file:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if sys.stdout is not None:  # None: started with it closed (``>&-``)
            sys.stdout.flush()
