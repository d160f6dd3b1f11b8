"""Benchmarks relaunch themselves under torchrun with ``--worker``; this is that relaunch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def check_config(config: str, overrides: list[str], nproc: int) -> int:
    """0 when ``config`` with ``overrides`` is a valid run on ``nproc`` ranks; otherwise its one
    ``error:`` line is printed and the exit code returned, before any rank starts (each would
    print the same traceback)."""
    from megatron_train import cli
    from megatron_train.resolve import resolve

    return cli.run(lambda: resolve(config, overrides, nproc))


def relaunch(script: str, nproc: int, worker_args: list[str]) -> int:
    """Run ``script --worker *worker_args`` on ``nproc`` local ranks; returns torchrun's exit code."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           script, "--worker", *worker_args]  # fmt: skip
    return subprocess.call(cmd, cwd=ROOT, env=env)
