"""Shared fixtures: a small real corpus (stdlib source), its tokenizer and indexed dataset."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import types
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    """Refuse a ``--dist loadgroup`` run that would ignore the ``xdist_group`` marks: the
    module-scoped reference runs would be built on both workers and two Slurm test clusters would
    collide, failing tests at random rather than at once."""
    if getattr(config.option, "dist", "no") != "loadgroup":
        return
    pytest_version = Version(metadata.version("pytest"))
    xdist_version = Version(metadata.version("pytest-xdist"))
    if pytest_version >= Version("9.2") and xdist_version <= Version("3.8.0"):
        raise pytest.UsageError(
            f"pytest {pytest_version} with pytest-xdist {xdist_version} ignores xdist_group marks under "
            "--dist loadgroup (pytest-dev/pytest-xdist#1386). Fix: make install (pyproject pins pytest<9.2)."
        )


def torchrun(nproc: int, config: Path, *overrides: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Train with ``torchrun --standalone`` on ``nproc`` CPU ranks and wait for it."""
    return subprocess.run(
        torchrun_command(nproc, config, *overrides), cwd=ROOT, env=torchrun_env(),
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def torchrun_command(nproc: int, config: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "megatron_train.train", "--config", str(config), *overrides]  # fmt: skip


def torchrun_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def free_port() -> int:
    """A loopback port free a moment ago, for a rendezvous of a test's own."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def records(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl records."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> list[float]:
    """Per-step training losses, in order."""
    return [r["loss"] for r in records(run_dir) if "loss" in r]


def single_rank(config: Path, *overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """One training process without torchrun (how srun starts each rank)."""
    cmd = [sys.executable, "-m", "megatron_train.train", "--config", str(config), *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=timeout)


def load_tool(path: str) -> types.ModuleType:
    """A repo script (``tools/x.py``) imported as module ``x``, registered in ``sys.modules`` as an
    import would be: dataclasses and pickling by reference look their module up there. Its folder
    goes on the path, as when Python runs it, for the modules it imports from beside it."""
    name, folder = Path(path).stem, str((ROOT / path).parent)
    if folder not in sys.path:
        sys.path.append(folder)
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_tool(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a repo script or module with this interpreter, from the repo root."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, check=check
    )


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> dict[str, Path]:
    """200 stdlib files -> jsonl -> SentencePiece (1024) -> indexed dataset."""
    d = tmp_path_factory.mktemp("corpus")
    run_tool("tools/stdlib_corpus.py", "--output", str(d / "stdlib.jsonl"), "--max-files", "200")
    run_tool(
        "tools/train_tokenizer.py", "--input", str(d / "stdlib.jsonl"), "--output-prefix", str(d / "spm"),
        "--vocab-size", "1024", "--max-sentences", "4000",
    )  # fmt: skip
    run_tool(
        "tools/preprocess_data.py", "--input", str(d / "stdlib.jsonl"), "--output-prefix", str(d / "stdlib"),
        "--tokenizer", str(d / "spm.model"), "--workers", "2",
    )  # fmt: skip
    return {"jsonl": d / "stdlib.jsonl", "tokenizer": d / "spm.model", "prefix": d / "stdlib"}


def write_config(path: Path, corpus: dict[str, Path], run_dir: Path, **sections) -> Path:
    """A small training config over the test corpus; ``sections`` update its sections."""
    cfg = {
        "model": {"preset": "tiny", "max_position_embeddings": 128},
        "data": {
            "blend": [str(corpus["prefix"])],
            "split": "90,10,0",
            "seq_length": 64,
            "num_workers": 0,
            "tokenizer": {"type": "sentencepiece", "path": str(corpus["tokenizer"])},
        },
        "optimizer": {"lr": 1e-3, "warmup_steps": 2},
        "train": {
            "steps": 6,
            "micro_batch_size": 2,
            "global_batch_size": 8,
            "eval_interval": 3,
            "eval_steps": 1,
        },
        "logging": {"run_dir": str(run_dir), "log_interval": 1},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="session")
def trained(tmp_path_factory, corpus) -> dict:
    """A finished single-rank run with checkpoints at steps 2 and 4 (tests copy it before damaging it)."""
    d = tmp_path_factory.mktemp("trained")
    config = write_config(d / "cfg.yaml", corpus, d / "run", checkpoint={"interval": 2}, train={"steps": 4})
    result = single_rank(config)
    assert result.returncode == 0, result.stderr[-4000:]
    return {"config": config, "run": d / "run", "save_dir": d / "run" / "checkpoints"}
