"""Pretrain a model: ``launch/local.sh N --config X.yaml [k=v ...]`` on one node, which runs
``torchrun --nproc-per-node N -m megatron_train.train --config X.yaml [k=v ...]``.

Exit codes: 0 done; 1 training failed (e.g. a NaN loss); 2 bad config, input or checkpoint, or a
run directory another run still holds; 3 stopped early by a signal (SIGTERM, SIGUSR1, SIGINT) or
train.exit_after_minutes after saving a checkpoint: run the same command again to resume; 130
interrupted without a save (a second Ctrl-C, or one before training began).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import yaml

from megatron_train import cli, data_cache, run_lock, runtime, shared_folders
from megatron_train.checkpoint.manager import SaveFailed
from megatron_train.config import (
    ConfigError,
    ExperimentConfig,
    checkpoint_dir,
    data_cache_dir,
    data_prefixes,
    to_dict,
)
from megatron_train.config_loading import override_for_option
from megatron_train.errors import (
    BAD_INPUT,
    collective_timed_out,
    loader_worker_lost,
    out_of_shared_memory,
    peer_gone,
)
from megatron_train.memory import check_fits_this_node
from megatron_train.resolve import resolve
from megatron_train.step import TrainingDiverged

_PEER_GONE_GRACE_S = 2.0
"""How long a rank that lost another one waits before it exits."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.ArgumentParser(override_for=override_for_option, description=__doc__)
    parser.add_argument("--config", type=cli.non_empty, required=True, help="YAML experiment config")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, applied in order")
    return parser.parse_intermixed_args(argv)


def train(cfg: ExperimentConfig, rt: runtime.Runtime) -> tuple[Path, int]:
    """Build everything and run the loop; returns the run directory and the exit code."""
    from megatron_train.checkpoint.manager import Checkpointer
    from megatron_train.metrics import MetricsLogger
    from megatron_train.stopping import StopWatch

    run_dir = Path(cfg.logging.run_dir)
    log = MetricsLogger(cfg, run_dir, rt.is_main, rt.world_size)
    log.info("resolved config:\n" + yaml.safe_dump(to_dict(cfg), sort_keys=False))
    watch = StopWatch(cfg.train.exit_after_minutes, rt.device)
    checkpointer = Checkpointer(cfg, rt.is_main, log.info)
    try:
        return run_dir, _train(cfg, rt, log, watch, checkpointer)
    finally:
        checkpointer.release()
        watch.close()
        log.close()


T = TypeVar("T")


def _main_rank_decides(rt: runtime.Runtime, work: Callable[[], T]) -> T:
    """``work``'s result on rank 0, given to every rank; a ConfigError it raises is raised on every
    rank, which would otherwise wait for rank 0 in their next collective."""
    outcome: list = [None]
    if rt.is_main:
        try:
            outcome = [work()]
        except ConfigError as err:
            outcome = [err]
    torch.distributed.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], ConfigError):
        raise outcome[0]
    return outcome[0]


def _first_missing(folder: Path) -> Path | None:
    """The outermost folder that making ``folder`` would create; None when it exists."""
    if folder.exists():
        return None
    folder = folder.absolute()
    while not folder.parent.exists():
        folder = folder.parent
    return folder


def _hold_run_folders(cfg: ExperimentConfig, rt: runtime.Runtime, log, create: bool) -> list[Path]:
    """Lock the run directory and save dir against a second run (``run_lock``): those that exist,
    or, with ``create``, both after making them. Rank 0 decides and every rank agrees. Returns the
    outermost folders that making them created."""

    def hold() -> tuple[list[str], list[Path]]:
        notes, made = [], []
        for key, folder in (
            ("logging.run_dir", Path(cfg.logging.run_dir)),
            ("checkpoint.save_dir", checkpoint_dir(cfg)),
        ):
            if create:
                if (top := _first_missing(folder)) is not None:
                    made.append(top)
                folder.mkdir(parents=True, exist_ok=True)
            if folder.is_dir() and (note := run_lock.hold(key, folder)):
                notes.append(note)
        return notes, made

    notes, made = _main_rank_decides(rt, hold)
    for note in notes:
        log.info(note)
    return made


def _train(cfg: ExperimentConfig, rt: runtime.Runtime, log, watch, checkpointer) -> int:
    """The body of :func:`train`: model, resume, data, then the step loop; returns the exit code."""
    from megatron.core import parallel_state

    from megatron_train import data, warm_start
    from megatron_train.checkpoint.state import Progress, check_within_steps
    from megatron_train.evaluation import Evaluator
    from megatron_train.gc_pacing import GcPacing
    from megatron_train.inputs import check_resumed_index_memory
    from megatron_train.model import build_model, compiles_rope, layer_implementation
    from megatron_train.models.common import asks_grad_accumulation_fusion, one_pass_loss
    from megatron_train.optim import build_optimizer
    from megatron_train.profiling import StepProfiler
    from megatron_train.step import Stepper

    _main_rank_decides(rt, lambda: data.check_loader_workers(cfg))
    _hold_run_folders(cfg, rt, log, create=False)
    resume_from = checkpointer.resolve()
    start_from = None if resume_from else warm_start.locate(cfg, rt.is_main, log.info)
    model = build_model(cfg, rt)
    optimizer, scheduler = build_optimizer(cfg, model, rt.dtype)
    progress = Progress(iteration=0, consumed_samples=0)
    if resume_from is not None:
        progress = checkpointer.load(resume_from, model, optimizer, scheduler)
        check_within_steps(resume_from, progress.iteration, cfg.train.steps)
        _main_rank_decides(
            rt, lambda: check_resumed_index_memory(cfg, progress.consumed_samples, progress.iteration)
        )
        if progress.iteration == cfg.train.steps:
            log.info(
                f"the run has trained all {cfg.train.steps} steps: nothing to do (raise train.steps to go on)"
            )
    elif start_from is not None:
        warm_start.load(start_from, cfg, model, optimizer, log.info)
    cache_dir = data_cache_dir(cfg)
    # Each folder named by the option that placed it: both are in the run directory by default.
    save_key = "checkpoint.save_dir" if cfg.checkpoint.save_dir else "logging.run_dir"
    cache_key = "data.cache_dir" if cfg.data.cache_dir else "logging.run_dir"
    shared_folders.check_shared([(save_key, checkpoint_dir(cfg)), (cache_key, cache_dir)], rt.rank)
    # Only now, with every input checked, does the run directory change.
    made = _hold_run_folders(cfg, rt, log, create=True)
    # Rank 0 writes the logs; a wandb that cannot start there stops every rank.
    try:
        _main_rank_decides(rt, lambda: log.open(progress.iteration))
    except ConfigError:
        # Rank 0, which made the folders, takes them away again while nothing is in them.
        for top in made if rt.is_main else []:
            if all(p.is_dir() for p in top.rglob("*")):
                shutil.rmtree(top, ignore_errors=True)
        raise
    checkpointer.start_writer()
    stepper = Stepper(cfg, model, optimizer, scheduler, rt.device)
    dp = parallel_state.get_data_parallel_world_size()
    params = sum(p.numel() for chunk in model for p in chunk.parameters())
    p = cfg.parallel
    experts = f" EP={p.expert} ETP={p.expert_tensor or p.tensor}" if cfg.model.num_experts else ""
    context = f" CP={p.context}" if p.context > 1 else ""
    te, layers = layer_implementation(cfg)
    fused_wgrad = model[0].config.gradient_accumulation_fusion
    if cfg.model.compile:
        layers += ", layers compiled" + (" (linears outside the graphs)" if fused_wgrad else "")
    elif compiles_rope(cfg, te):
        layers += ", RoPE compiled"
    if one_pass_loss(cfg.model, te):
        layers += ", fused cross-entropy (compiled passes)"
    elif cfg.model.cross_entropy_fusion:
        layers += ", fused cross-entropy (Transformer Engine's)"
    # Asked for (the default) but unavailable: a GPU without apex whose torch lacks addmm's
    # bf16 -> fp32 form.
    if asks_grad_accumulation_fusion(cfg.model) and not fused_wgrad:
        layers += ", no gradient accumulation fusion (needs apex, or a torch whose addmm adds bf16 to fp32)"
    log.info(
        f"layout TP={p.tensor} PP={p.pipeline} VPP={p.virtual_pipeline or 1}{context} DP={dp}{experts} "
        f"on {rt.world_size} {rt.device.type} "
        f"ranks | {stepper.num_microbatches} microbatches/step | rank 0 holds {params:,} parameters | "
        f"{layers}, {str(rt.dtype).removeprefix('torch.')}"
    )

    started = time.perf_counter()
    indices = data.IndexProgress(data.index_count(cfg), log.info)
    with (
        data_cache.building(cache_dir, log.info) if rt.is_main else contextlib.nullcontext(),
        runtime.patient_collectives(cfg.data.build_timeout_minutes),
    ):
        if rt.is_main:
            if torn := data_cache.drop_torn_indices(str(cache_dir)):
                names = ", ".join(p.name for p in torn)
                log.info(f"data cache: rebuilding what an earlier build cut short (removed {names})")
            data_cache.record(cache_dir, list(data_prefixes(cfg.data)))
        torch.distributed.barrier()
        train_ds, valid_ds = data.build_datasets(
            cfg, str(cache_dir), indices, progress.consumed_samples, progress.iteration
        )
    log.info(
        f"datasets ready in {time.perf_counter() - started:.1f} s (indices: {indices.summary()}): "
        f"{len(train_ds):,} training samples, {len(valid_ds) if valid_ds else 0:,} validation samples"
    )
    train_iters = [
        data.TimedBatches(data.batch_iterator(train_ds, progress.consumed_samples, cfg)) for _ in model
    ]
    evaluator = Evaluator(cfg, stepper, valid_ds, log, watch)
    profiler = StepProfiler(cfg, rt.rank, rt.device, progress.iteration + 1, log)
    log.start_interval()
    exit_code, batch = cli.EXIT_OK, cfg.train.global_batch_size
    try:
        with profiler, GcPacing(cfg.train.gc_interval) as collector:
            for step in range(progress.iteration + 1, cfg.train.steps + 1):
                logged = log.logs_at(step)
                with profiler.step(step):
                    result = stepper.train_step(train_iters, logged=logged)
                result.check_finite(step)
                progress = progress.advanced(batch, batch * cfg.data.seq_length, result.skipped)
                waited = data.slowest_wait(train_iters, rt.device) if logged else 0.0
                log.after_step(step, progress.consumed_tokens, result.loss, result.lr, result.grad_norm,
                               progress.skipped_steps, result.moe, data_wait=waited)  # fmt: skip
                evaluator.after_step(step)
                decision = watch.decide()
                checkpointer.after_step(progress, decision, model, optimizer, scheduler)
                collector.after_step(step)
                if decision.stop and step < cfg.train.steps:
                    why = watch.why(decision)
                    log.info(f"stopping after step {step} on {why}; run the same command again to resume")
                    exit_code = cli.EXIT_STOPPED_EARLY
                    break
    except TrainingDiverged:
        # Every rank sees the same loss, so all get here and can finish the save in flight together.
        checkpointer.close()
        raise
    checkpointer.close()
    report_exit_status(exit_code)
    # Rank 0 records the last save after the others finished writing it; no rank may exit before
    # that, or a launcher that kills the job when its first rank exits could tear it.
    torch.distributed.barrier()
    return exit_code


def report_exit_status(code: int) -> None:
    """Write the exit code to ``$MEGATRON_TRAIN_EXIT_STATUS_FILE`` (rank 0) when a launcher asks.

    srun --kill-on-bad-exit terminates the remaining ranks as soon as the first one exits non-zero,
    so the launcher sees their 143 rather than our 3 (stopped early, checkpoint saved). This file
    is written before any rank exits (every rank passes a barrier after the last save).
    """
    path = os.environ.get("MEGATRON_TRAIN_EXIT_STATUS_FILE")
    # A path that could not be written at the start has been reported (check_exit_status_file).
    if path and cli.first_rank() and _exit_status_problem(path) is None:
        from megatron_train.checkpoint.files import write_atomic

        with contextlib.suppress(OSError):
            write_atomic(Path(path), f"{code}\n")


def check_exit_status_file() -> None:
    """``$MEGATRON_TRAIN_EXIT_STATUS_FILE`` can be written at the end: a file name in a writable
    directory. Otherwise the launcher would learn nothing of how the run ended."""
    path = os.environ.get("MEGATRON_TRAIN_EXIT_STATUS_FILE")
    if path and (problem := _exit_status_problem(path)):
        raise problem


def _exit_status_problem(path: str) -> ConfigError | None:
    if Path(path).is_dir():
        return ConfigError(
            "MEGATRON_TRAIN_EXIT_STATUS_FILE",
            f"{path!r} is a directory, which the exit code cannot be written over, so the launcher "
            "would not learn how the run ended",
            "point it at a file name in that folder, or unset it",
        )
    folder = Path(path).parent
    if not (folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)):
        return ConfigError(
            "MEGATRON_TRAIN_EXIT_STATUS_FILE",
            f"{path!r} is in {str(folder)!r}, which is not a writable directory, so the launcher would "
            "not learn how the run ended",
            "unset it (launch/slurm/pretrain.sbatch sets it in its log folder) or point it into a "
            "writable folder",
        )
    return None


def main(argv: list[str] | None = None) -> int:
    goes_on = "training goes on without it, and metrics.jsonl in the run directory keeps the logged figures"
    with cli.log_stream(goes_on):
        code = _main(argv)
    if code not in (cli.EXIT_OK, cli.EXIT_STOPPED_EARLY):  # those were reported before the final barrier
        report_exit_status(code)
    return code


@cli.entry_point
def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    try:
        env = runtime.launch_env()
    except ConfigError as err:  # each process's own launcher variables, so each one says so
        cli.report(err)
        return cli.EXIT_BAD_INPUT
    try:
        check_exit_status_file()
        cfg = resolve(args.config, args.overrides, env.world_size)
        check_fits_this_node(cfg, env.world_size, env.local_rank, env.local_world_size)
        from megatron_train.metrics import check_wandb

        check_wandb(cfg)
    except BAD_INPUT as err:
        cli.report_once(err)
        return cli.EXIT_BAD_INPUT
    try:
        rt = runtime.initialize(cfg, env)
    except ConfigError as err:  # the rendezvous, or ranks that resolved different configs
        # A process group left up at exit (the ranks met) aborted the process in its destructor.
        runtime.shutdown()
        cli.report_once(err)
        return cli.EXIT_BAD_INPUT
    # A rank that a native crash kills (a communication library's segfault, say) prints where each
    # of its threads was, where it would otherwise leave only its exit signal and the peers' errors.
    # A SIGBUS is a read through a memory map past its file's end (a dataset cut or rewritten while
    # the run read it): the launcher names that in a line, which the dump of the data loader's
    # frames only buried.
    faulthandler.enable()
    signal.signal(signal.SIGBUS, signal.SIG_DFL)
    try:
        run_dir, exit_code = train(cfg, rt)
    except BAD_INPUT as err:  # a bad checkpoint or Hugging Face directory to start from
        cli.report_once(err)
        return cli.EXIT_BAD_INPUT
    except TrainingDiverged as err:  # every rank meets it at the same step
        cli.report_once(err)
        return cli.EXIT_FAILED
    except KeyboardInterrupt:  # a second Ctrl-C (stopping.py) does not wait for the save
        if rt.is_main:
            cli.report(
                "interrupted before the run saved; a save it had begun is left torn, and the next start "
                "skips it. Fix: run the same command again to resume from the last complete checkpoint"
            )
        return cli.EXIT_INTERRUPTED
    except SaveFailed as err:
        if err.alone:
            print(f"error on rank {rt.rank}: {err}", file=sys.stderr)
        elif rt.is_main:
            print(f"error: {err}", file=sys.stderr)
        return cli.EXIT_FAILED
    except BaseException as err:  # torch's CheckpointException is a BaseException
        if (line := failure_line(err)) is None:
            raise
        print(f"error on rank {rt.rank}: {line}", file=sys.stderr, flush=True)
        if peer_gone(err) is not None:
            # A launcher names the rank that exited first, to the second: let it be the one that
            # went away, whose line says why (its launcher ends this rank while it waits).
            time.sleep(_PEER_GONE_GRACE_S)
        return cli.EXIT_FAILED
    finally:
        runtime.shutdown()
    if rt.is_main:
        state = "done" if exit_code == cli.EXIT_OK else "stopped early (checkpoint saved)"
        print(f"{state}. run directory: {run_dir.resolve()}", flush=True)
    return exit_code


def failure_line(err: BaseException) -> str | None:
    """The line (without ``error on rank N:``) for a failure of the machine rather than of the
    code, which a traceback would only bury; None for any other error."""
    if (shm := out_of_shared_memory(err)) is not None:
        return (
            f"the data loader's worker processes found shared memory (/dev/shm) full ({shm}). Fix: give the "
            "job more shared memory (a container's --shm-size) or set data.num_workers=0"
        )
    if (lost := loader_worker_lost(err)) is not None:
        why, fix = "the out-of-memory killer sends SIGKILL: see dmesg", "leave the loader more memory"
        if "Bus error" in lost:
            why = "a file it mapped shrank (a dataset rewritten while the run reads it), or /dev/shm is full"
            fix = "keep datasets unchanged while a run reads them, give the job more shared memory"
        return (
            f"a data loader worker process went away ({lost}; {why}). Fix: {fix} or set fewer "
            "data.num_workers, then run the same command to resume from the last checkpoint"
        )
    where = "free space where logging.run_dir, data.cache_dir and checkpoint.save_dir point and run it again"
    if (line := cli.no_room(err, "a file of the run", where)) is not None:
        return line
    if (waited := collective_timed_out(err)) is not None:
        minutes = runtime.collective_timeout().total_seconds() / 60
        return (
            f"a collective waited its {minutes:g} minutes (MEGATRON_TRAIN_DIST_TIMEOUT_MIN) for another rank "
            f"({waited}): a rank hung or fell far behind. Fix: see which rank's log stops first (py-spy dump "
            "shows where it waits), or raise MEGATRON_TRAIN_DIST_TIMEOUT_MIN where steps are slow by design"
        )
    if (gone := peer_gone(err)) is not None:
        # The rank that went first says why; a traceback per rank here would bury its line.
        return (
            f"stopped: another rank's process went away during a collective ({gone}). "
            "Fix: see that rank's error above (or in its log)"
        )
    return None


if __name__ == "__main__":
    cli.exit_process(main())
