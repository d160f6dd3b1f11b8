"""Checkpoint save cost: how long training is blocked by an async save versus a synchronous one.

    python benchmarks/checkpoint_save.py [--nproc 4] [--repeats 3] [--config configs/demo.yaml] [k=v ...]

Relaunches itself under torchrun, builds the model and distributed optimizer from the config, takes
one training step (so Adam's state exists), then saves the same state with checkpoint.async_save
off and on, into a scratch save dir. Prints the median blocking time of each and, for async, the
time until the background write and completion record were done. Needs the config's data
(``make demo`` prepares the default's).
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

from torchrun_self import relaunch


def worker(args) -> None:
    import torch

    from megatron_train import runtime
    from megatron_train.checkpoint.manager import Checkpointer
    from megatron_train.checkpoint.state import Progress
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
    stepper.train_step([batch_iterator(train_ds, 0, cfg) for _ in model])
    progress = Progress(iteration=1, consumed_samples=cfg.train.global_batch_size)

    results = {}
    for async_save in (False, True):
        options = dataclasses.replace(
            cfg.checkpoint, async_save=async_save, keep_last=1, save_dir=str(Path(args.scratch) / "ckpt")
        )
        checkpointer = Checkpointer(dataclasses.replace(cfg, checkpoint=options), rt.is_main, lambda _: None)
        checkpointer.start_writer()
        blocking, total = [], []
        for repeat in range(args.repeats + 1):
            torch.distributed.barrier()
            start = time.perf_counter()
            checkpointer.save(repeat + 1, model, optimizer, scheduler, progress)
            saved = time.perf_counter()
            checkpointer.wait()
            done = time.perf_counter()
            if repeat:  # the first save also builds megatron's cached save plan
                blocking.append(saved - start)
                total.append(done - start)
        checkpointer.close()
        checkpointer.release()
        results[async_save] = (statistics.median(blocking), statistics.median(total))
    if rt.is_main:
        size = sum(p.stat().st_size for p in (Path(args.scratch) / "ckpt").rglob("*") if p.is_file())
        params = sum(p.numel() for chunk in model for p in chunk.parameters())
        print(f"layout TP={cfg.parallel.tensor} PP={cfg.parallel.pipeline} world={rt.world_size} "
              f"device={rt.device.type} | rank 0 holds {params:,} params | "
              f"checkpoint {size / 2**20:.1f} MiB | median of {args.repeats}")  # fmt: skip
        sync_block, _ = results[False]
        async_block, async_total = results[True]
        print(f"sync save : training blocked {sync_block:7.2f} s")
        print(f"async save: training blocked {async_block:7.2f} s "
              f"(written and recorded after {async_total:.2f} s)")  # fmt: skip
        print(f"async blocks training {100 * async_block / sync_block:.0f}% as long as sync")
    runtime.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
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
