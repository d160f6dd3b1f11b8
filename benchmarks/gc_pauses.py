"""Python's garbage-collection pauses inside the step loop, automatic against paced (train.gc_interval).

    python benchmarks/gc_pauses.py [--nproc 1] [--steps 300] [--interval 50] \
        [--config configs/demo.yaml] [k=v ...]

Trains the config twice under torchrun, first with ``train.gc_interval=0`` (CPython's automatic
collection), then with ``--interval``, no checkpoint or validation, in a fresh run directory each.
Every rank times each collection CPython makes from the start of the step loop (the paced mode's
one full collection there included) to its end (``gc.callbacks``), and the rows print, per mode,
the collections of each generation, their total and longest pause (the slowest rank's), the
objects they freed, and the median step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from torchrun_self import check_config, relaunch

from megatron_train import cli

# A fresh run with nothing but training steps in the loop, unless the command's overrides say otherwise.
RUN_OVERRIDES = ["checkpoint.interval=0", "checkpoint.save_at_end=false", "train.eval_interval=0",
                 "checkpoint.load=none", "logging.log_interval=1"]  # fmt: skip


def _worker(out: Path, train_args: list[str]) -> int:
    """One rank: train, recording each collection made inside the step loop."""
    import gc
    import os

    from megatron_train import gc_pacing, train

    pauses: list[tuple[int, float, int]] = []
    state = {"on": False, "began": 0.0}

    def on_collection(phase: str, info: dict) -> None:
        if not state["on"]:
            return
        if phase == "start":
            state["began"] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - state["began"], info["collected"]))

    enter, report_exit_status = gc_pacing.GcPacing.__enter__, train.report_exit_status

    def loop_starts(self):
        state["on"] = True
        return enter(self)

    def loop_ended(code: int) -> None:
        state["on"] = False
        report_exit_status(code)

    gc_pacing.GcPacing.__enter__ = loop_starts
    train.report_exit_status = loop_ended
    gc.callbacks.append(on_collection)
    code = train.main(train_args)
    rank = os.environ.get("RANK", "0")
    (out / f"rank{rank}.json").write_text(json.dumps({"pauses": pauses}))
    return code


def _step_times(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["step_time_s"] for r in map(json.loads, lines) if "step_time_s" in r]


def _row(name: str, out: Path, run_dir: Path) -> str:
    ranks = [json.loads(p.read_text())["pauses"] for p in sorted(out.glob("rank*.json"))]
    counts = [sum(1 for g, _, _ in ranks[0] if g == gen) for gen in range(3)]
    total = max(sum(d for _, d, _ in r) for r in ranks)
    longest = max((d for r in ranks for _, d, _ in r), default=0.0)
    freed = sum(c for _, _, c in ranks[0])
    step = statistics.median(_step_times(run_dir)[1:])
    return (f"{name:<22} {counts[0]:>6} {counts[1]:>6} {counts[2]:>6} {total * 1e3:>10.1f} "
            f"{longest * 1e3:>10.2f} {freed:>8} {step * 1e3:>10.1f}")  # fmt: skip


def main() -> int:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--nproc", type=cli.positive_int, default=1)
    parser.add_argument("--steps", type=cli.positive_int, default=300)
    parser.add_argument("--interval", type=cli.positive_int, default=50)
    parser.add_argument("--config", default="configs/demo.yaml")
    parser.add_argument("--worker", nargs=1, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.worker:
        return _worker(Path(args.worker[0]), ["--config", args.config, *args.overrides])
    with tempfile.TemporaryDirectory(prefix="gc_pauses-") as tmp:
        modes = [("automatic", 0), (f"paced every {args.interval}", args.interval)]
        rows = []
        for name, interval in modes:
            run_dir, out = Path(tmp, f"run{interval}"), Path(tmp, f"out{interval}")
            out.mkdir()
            overrides = [*RUN_OVERRIDES, *args.overrides, f"train.steps={args.steps}",
                         f"train.gc_interval={interval}", f"logging.run_dir={run_dir}"]  # fmt: skip
            if code := check_config(args.config, overrides, args.nproc):
                return code
            worker = [str(out), "--config", args.config, *overrides]
            if code := relaunch(__file__, args.nproc, worker):
                print(f"error: the {name} run failed with exit code {code}", file=sys.stderr)
                return 1
            rows.append(_row(name, out, run_dir))
    print(f"\n{args.steps} steps, {args.nproc} rank(s), {args.config} {' '.join(args.overrides)}")
    print(f"{'collection':<22} {'gen0':>6} {'gen1':>6} {'gen2':>6} {'pause ms':>10} {'longest':>10} "
          f"{'freed':>8} {'ms/step':>10}")  # fmt: skip
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
