"""Pretrain a model: ``torchrun --nproc-per-node N -m megatron_train.train --config X.yaml [k=v ...]``.

Exit codes: 0 done; 1 training failed (e.g. a NaN loss); 2 bad config, input or checkpoint;
3 stopped early by a signal (SIGTERM, SIGUSR1, SIGINT) or train.exit_after_minutes after saving a
checkpoint: run the same command again to resume.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import yaml

from megatron_train import runtime
from megatron_train.config import ConfigError, ExperimentConfig, load_config, to_dict, validate

EXIT_OK = 0
EXIT_TRAINING_FAILED = 1
EXIT_BAD_CONFIG = 2
EXIT_STOPPED_EARLY = 3


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm stopped being finite."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML experiment config")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides, applied in order")
    return parser.parse_args(argv)


def resolve_config(args: argparse.Namespace, world_size: int) -> ExperimentConfig:
    """Load, complete (vocab size from the tokenizer) and validate the config."""
    cfg = load_config(args.config, args.overrides)
    validate(cfg, world_size)
    from megatron_train.tokenizer import load_tokenizer

    vocab = load_tokenizer(cfg.data.tokenizer.type, cfg.data.tokenizer.path).vocab_size
    if cfg.model.vocab_size is None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))
    elif cfg.model.vocab_size < vocab:
        raise ConfigError(
            "model.vocab_size",
            f"{cfg.model.vocab_size} is smaller than the tokenizer's {vocab} tokens",
            "remove model.vocab_size to take it from the tokenizer",
        )
    return cfg


def train(cfg: ExperimentConfig, rt: runtime.Runtime) -> tuple[Path, int]:
    """Build everything and run the loop; returns the run directory and the exit code."""
    from megatron_train.checkpoint.manager import Checkpointer
    from megatron_train.metrics import MetricsLogger
    from megatron_train.stopping import StopWatch

    run_dir = Path(cfg.logging.run_dir)
    if rt.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    log = MetricsLogger(cfg, run_dir, rt.is_main, rt.world_size)
    log.info("resolved config:\n" + yaml.safe_dump(to_dict(cfg), sort_keys=False))
    watch = StopWatch(cfg.train.exit_after_minutes, cfg.checkpoint.interval_minutes, rt.device)
    checkpointer = Checkpointer(cfg, rt.is_main, log.info)
    try:
        return run_dir, _train(cfg, rt, run_dir, log, watch, checkpointer)
    finally:
        checkpointer.release()
        watch.close()
        log.close()


def _train(cfg: ExperimentConfig, rt: runtime.Runtime, run_dir: Path, log, watch, checkpointer) -> int:
    """The body of :func:`train`: model, data, resume, then the step loop; returns the exit code."""
    import torch
    from megatron.core import parallel_state

    from megatron_train.checkpoint.state import Progress
    from megatron_train.data import batch_iterator, build_datasets
    from megatron_train.model import build_model, use_transformer_engine
    from megatron_train.optim import build_optimizer
    from megatron_train.step import Stepper

    resume_from = checkpointer.resolve()
    model = build_model(cfg, rt)
    optimizer, scheduler = build_optimizer(cfg, model, rt.dtype)
    progress = Progress(iteration=0, consumed_samples=0)
    if resume_from is not None:
        progress = checkpointer.load(resume_from, model, optimizer, scheduler)
        log.rewind(progress.iteration)
    stepper = Stepper(cfg, model, optimizer, scheduler, rt.device)
    dp = parallel_state.get_data_parallel_world_size()
    params = sum(p.numel() for chunk in model for p in chunk.parameters())
    log.info(
        f"layout TP={cfg.parallel.tensor} PP={cfg.parallel.pipeline} "
        f"VPP={cfg.parallel.virtual_pipeline or 1} DP={dp} on {rt.world_size} {rt.device.type} "
        f"ranks | {stepper.num_microbatches} microbatches/step | rank 0 holds {params:,} parameters | "
        f"{'Transformer Engine' if use_transformer_engine(cfg) else 'local'} "
        f"layers, {str(rt.dtype).removeprefix('torch.')}"
    )

    cache_dir = cfg.data.cache_dir or str(run_dir / "data_cache")
    train_ds, valid_ds = build_datasets(cfg, cache_dir)
    chunks = len(model)
    train_iters = [batch_iterator(train_ds, progress.consumed_samples, cfg) for _ in range(chunks)]

    def validate_now(step: int) -> None:
        if valid_ds is None:
            return
        n = cfg.train.eval_steps * cfg.train.global_batch_size
        iters = [batch_iterator(valid_ds, 0, cfg, num_samples=n) for _ in range(chunks)]
        log.log_validation(step, stepper.evaluate(iters, cfg.train.eval_steps))

    def save(step: int) -> None:
        checkpointer.save(step, model, optimizer, scheduler, progress)
        watch.saved()

    ckpt = cfg.checkpoint
    exit_code = EXIT_OK
    interval_start, interval_steps = time.perf_counter(), 0
    try:
        for step in range(progress.iteration + 1, cfg.train.steps + 1):
            result = stepper.train_step(train_iters)
            if not (math.isfinite(result.loss) and math.isfinite(result.grad_norm)):
                raise TrainingDiverged(
                    f"step {step}: loss {result.loss} / grad norm {result.grad_norm} is not finite. "
                    "Lower optimizer.lr, raise optimizer.warmup_steps or check the data."
                )
            progress = Progress(
                iteration=step,
                consumed_samples=progress.consumed_samples + cfg.train.global_batch_size,
                skipped_steps=progress.skipped_steps + result.skipped,
            )
            interval_steps += 1
            if step % cfg.logging.log_interval == 0 or step == cfg.train.steps:
                elapsed = time.perf_counter() - interval_start
                step_time, skipped = elapsed / interval_steps, progress.skipped_steps
                log.log_train(step, result.loss, result.lr, result.grad_norm, step_time, skipped)
                interval_start, interval_steps = time.perf_counter(), 0
            if cfg.train.eval_interval and (step % cfg.train.eval_interval == 0 or step == cfg.train.steps):
                validate_now(step)
                interval_start = time.perf_counter()
            checkpointer.poll()
            decision = watch.decide()
            last = step == cfg.train.steps
            if (
                decision.stop
                or decision.save_by_time
                or (ckpt.interval and step % ckpt.interval == 0)
                or (last and ckpt.save_at_end)
            ):
                save(step)
            if decision.stop and not last:
                why = (
                    f"signal {signal.Signals(decision.stop_signal).name}"
                    if decision.stop_signal
                    else f"train.exit_after_minutes={cfg.train.exit_after_minutes}"
                )
                log.info(f"stopping after step {step} on {why}; run the same command again to resume")
                exit_code = EXIT_STOPPED_EARLY
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
    if path and runtime.launch_env().rank == 0:
        from megatron_train.checkpoint.files import write_atomic

        write_atomic(Path(path), f"{code}\n")


def main(argv: list[str] | None = None) -> int:
    code = _main(argv)
    if code not in (EXIT_OK, EXIT_STOPPED_EARLY):  # those were reported before the final barrier
        report_exit_status(code)
    return code


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    env = runtime.launch_env()
    try:
        cfg = resolve_config(args, env.world_size)
    except ConfigError as err:
        if env.rank == 0:
            print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    warnings.filterwarnings("ignore", module="megatron")
    rt = runtime.initialize(cfg, env)
    from megatron_train.cli import BAD_INPUT

    try:
        run_dir, exit_code = train(cfg, rt)
    except BAD_INPUT as err:  # a bad checkpoint or Hugging Face directory to start from
        if rt.is_main:
            print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except TrainingDiverged as err:
        print(f"error on rank {rt.rank}: {err}", file=sys.stderr)
        return EXIT_TRAINING_FAILED
    finally:
        runtime.shutdown()
    if rt.is_main:
        state = "done" if exit_code == EXIT_OK else "stopped early (checkpoint saved)"
        print(f"{state}. run directory: {run_dir.resolve()}", flush=True)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
