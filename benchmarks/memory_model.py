"""Peak memory per rank of real training steps, next to preflight's estimate (``megatron_train.memory``).

    python benchmarks/memory_model.py [--nproc 2] [--steps 2] [k=v ...]

Relaunches itself under torchrun; every rank builds the model, optimizer and schedule from the
config (``--preset small``, seq 512 by default; synthetic tokens, no dataset), trains ``--steps``
steps and reports its peak memory above what it held before the model was built: on GPU
``max_memory_allocated``, on CPU the peak resident set (glibc's mmap threshold is fixed low, so
freed tensors leave the resident set and the peak is what was live). Prints one line per rank and
a ``RESULT`` json line: the largest measurement, the estimate for the busiest stage and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from torchrun_self import relaunch

from megatron_train import cli


def experiment(args):
    """The measured run's config: the preset at --seq, with the overrides."""
    from megatron_train.resolve import build_config

    raw = {"model": {"preset": args.preset, "vocab_size": 32000}, "data": {"seq_length": args.seq}}
    return build_config(raw, args.overrides)


def worker(args) -> None:
    import psutil
    import torch

    from megatron_train import runtime
    from megatron_train.memory import estimate
    from megatron_train.metrics import peak_memory_gib
    from megatron_train.model import build_model
    from megatron_train.optim import build_optimizer
    from megatron_train.step import Stepper

    cfg = experiment(args)
    env = runtime.launch_env()
    rt = runtime.initialize(cfg, env)
    on_gpu = rt.device.type == "cuda"
    base = (torch.cuda.memory_allocated() if on_gpu else psutil.Process().memory_info().rss) / 2**20
    model = build_model(cfg, rt)
    optimizer, scheduler = build_optimizer(cfg, model, rt.dtype)
    stepper = Stepper(cfg, model, optimizer, scheduler, rt.device)
    mbs, seq = cfg.train.micro_batch_size, cfg.data.seq_length

    def batches():
        while True:
            tokens = torch.randint(0, 32000, (mbs, seq))
            yield {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(mbs, seq),
                   "position_ids": torch.arange(seq).expand(mbs, -1)}  # fmt: skip

    for _ in range(args.steps):
        stepper.train_step([batches() for _ in model])
    peak = peak_memory_gib() * 1024
    measured = torch.tensor([peak - base], dtype=torch.float64, device=rt.device)
    everyone = [torch.zeros_like(measured) for _ in range(rt.world_size)]
    torch.distributed.all_gather(everyone, measured)
    if rt.is_main:
        est = estimate(cfg, rt.world_size, on_gpu=on_gpu)
        for rank, value in enumerate(everyone):
            print(f"rank {rank}: peak {value.item():,.0f} MiB above its start")
        parts = ", ".join(
            f"{k} {getattr(est, k) / 2**20:,.0f}" for k in ("weights", "grads", "optimizer", "activations")
        )
        print(f"estimate ({est.stage} stage): {parts} MiB")
        worst = max(v.item() for v in everyone)
        print("RESULT " + json.dumps({"measured_mib": worst, "estimate_mib": est.total / 2**20,
                                      "ratio": est.total / 2**20 / worst}), flush=True)  # fmt: skip
    runtime.shutdown()


def main() -> int:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--nproc", type=cli.positive_int, default=1)
    parser.add_argument("--steps", type=cli.positive_int, default=2)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq", type=cli.positive_int, default=512)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    if code := cli.run(lambda: experiment(args)):
        return code
    # Large frees go back to the OS at once, so the peak resident set is the peak of live tensors.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    worker_args = [
        "--steps",
        str(args.steps),
        "--preset",
        args.preset,
        "--seq",
        str(args.seq),
        *args.overrides,
    ]
    return relaunch(__file__, args.nproc, worker_args)


if __name__ == "__main__":
    sys.exit(main())
