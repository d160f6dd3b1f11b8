"""Checkpoint cost: how long a save blocks training (async against sync), how long the whole save and
a resume take, and what a background save costs the steps it overlaps, per optimizer format.

    python benchmarks/checkpoint_save.py [--nproc 4] [--repeats 3] [--config configs/demo.yaml] [k=v ...]

Relaunches itself under torchrun, builds the model and distributed optimizer from the config, takes
one training step (so Adam's state exists), then for each of megatron's optimizer formats
(``checkpoint.optimizer_format``) saves the same state ``repeats + 1`` times synchronously and as
many times asynchronously into a scratch dir. The first save of each kind also validates the
sharding and builds megatron's plans, which later saves reuse, so medians are over the later ones.
Then it times a resume from the last checkpoint with ``checkpoint.fully_parallel_load`` off and
on, and the training step alone against a step while an async save is written. Needs the
config's data (``make demo`` prepares the default's).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from torchrun_self import check_config, relaunch

from megatron_train import cli

FORMATS = ("dp_reshardable", "fully_reshardable")


def worker(args) -> None:
    import torch

    from megatron_train import runtime
    from megatron_train.checkpoint.manager import Checkpointer
    from megatron_train.checkpoint.state import Layout, Progress
    from megatron_train.data import batch_iterator, build_datasets
    from megatron_train.model import build_model
    from megatron_train.optim import build_optimizer
    from megatron_train.resolve import resolve
    from megatron_train.step import Stepper

    env = runtime.launch_env()
    cfg = resolve(args.config, args.overrides, env.world_size)
    rt = runtime.initialize(cfg, env)
    model = build_model(cfg, rt)
    optimizer, scheduler = build_optimizer(cfg, model, rt.dtype)
    stepper = Stepper(cfg, model, optimizer, scheduler, rt.device)
    train_ds, _ = build_datasets(cfg, str(Path(args.scratch) / "data_cache"))
    batches = [batch_iterator(train_ds, 0, cfg) for _ in model]
    stepper.train_step(batches)
    progress = Progress(iteration=1, consumed_samples=cfg.train.global_batch_size)
    save_dir = Path(args.scratch) / "ckpt"

    def checkpointer(**options) -> Checkpointer:
        c = dataclasses.replace(cfg.checkpoint, keep_last=1, save_dir=str(save_dir), **options)
        made = Checkpointer(dataclasses.replace(cfg, checkpoint=c), rt.is_main, lambda _: None)
        made.start_writer()
        return made

    def timed_step() -> float:
        torch.distributed.barrier()
        start = time.perf_counter()
        stepper.train_step(batches)
        return time.perf_counter() - start

    iteration = 0
    rows = {}
    for fmt in FORMATS:
        row = {}
        for async_save in (False, True):
            saver = checkpointer(async_save=async_save, optimizer_format=fmt)
            blocking, total = [], []
            for repeat in range(args.repeats + 1):
                iteration += 1
                torch.distributed.barrier()
                start = time.perf_counter()
                saver.save(iteration, model, optimizer, scheduler, progress)
                saved = time.perf_counter()
                saver.wait()
                done = time.perf_counter()
                if repeat:
                    blocking.append(saved - start)
                    total.append(done - start)
            if async_save:  # steps while the next save is written in the background
                alone = statistics.median(timed_step() for _ in range(args.repeats))
                iteration += 1
                saver.save(iteration, model, optimizer, scheduler, progress)
                overlapped = [timed_step() for _ in range(args.repeats)]
                saver.wait()
                row["step"] = (alone, statistics.median(overlapped))
            saver.close()
            saver.release()
            row["async" if async_save else "sync"] = (statistics.median(blocking), statistics.median(total))
            row["async blocks" if async_save else "sync saves"] = blocking
        latest = max(save_dir.glob("iter_*"))
        row["size"] = sum(p.stat().st_size for p in latest.rglob("*") if p.is_file())
        for parallel in (False, True):
            loader = checkpointer(fully_parallel_load=parallel, async_save=False)
            torch.distributed.barrier()
            start = time.perf_counter()
            loader.load(latest, model, optimizer, scheduler)
            torch.distributed.barrier()
            row["load_parallel" if parallel else "load"] = time.perf_counter() - start
        rows[fmt] = row

    if rt.is_main:
        params = sum(p.numel() for chunk in model for p in chunk.parameters())
        print(f"layout {Layout.current().describe()} on {rt.world_size} {rt.device.type} ranks | "
              f"rank 0 holds {params:,} params | median of saves 2..{args.repeats + 1}")  # fmt: skip
        print(f"{'optimizer format':18} {'size MiB':>8} {'sync s':>7} {'async blocks s':>14} "
              f"{'blocked %':>9} {'async total s':>13} {'save MiB/s':>10} {'load s':>6} "
              f"{'load ||  s':>10} {'step s':>6} {'step+save s':>11}")  # fmt: skip
        for fmt, row in rows.items():
            (sync, _), (blocked, total), (alone, overlapped) = row["sync"], row["async"], row["step"]
            mib = row["size"] / 2**20
            print(f"{fmt:18} {mib:8.1f} {sync:7.2f} {blocked:14.2f} {100 * blocked / sync:8.1f}% "
                  f"{total:13.2f} {mib / sync:10.0f} {row['load']:6.2f} {row['load_parallel']:10.2f} "
                  f"{alone:6.2f} {overlapped:11.2f}")  # fmt: skip
        for fmt, row in rows.items():  # a median over few saves on a busy machine hides its spread
            for what in ("sync saves", "async blocks"):
                print(f"{fmt} {what} (s): {' '.join(f'{t:.2f}' for t in row[what])}")
    runtime.shutdown()


def main() -> int:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--nproc", type=cli.positive_int, default=4)
    parser.add_argument("--repeats", type=cli.positive_int, default=3)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if code := check_config(args.config, args.overrides, args.nproc):
        return code
    scratch = tempfile.mkdtemp(prefix="ckpt-bench-")
    worker_args = [
        f"--repeats={args.repeats}",
        f"--config={args.config}",
        f"--scratch={scratch}",
        *args.overrides,
    ]
    try:
        return relaunch(__file__, args.nproc, worker_args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
