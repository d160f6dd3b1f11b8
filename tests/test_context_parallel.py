"""Context parallelism on the local attention path over gloo, and document masking: every CP
layout trains like one rank, checkpoints move between CP sizes, and a packed sample gives each
document the losses it has alone."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_train.checkpoint import files
from tests.conftest import ROOT, records, torchrun, torchrun_env, write_config

# One xdist worker runs this module, so its module-scoped reference runs are built once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("context_parallel")]

SMALL_LR = {"lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 2}
STEPS = 10
SAVED_AT = 5


def cp_config(tmp_path: Path, corpus, name: str, **checkpoint) -> Path:
    return write_config(
        tmp_path / f"{name}.yaml", corpus, tmp_path / name, optimizer=SMALL_LR,
        train={"steps": STEPS, "global_batch_size": 4, "eval_interval": 0},
        checkpoint={"save_at_end": False, **checkpoint},
    )  # fmt: skip


def assert_same_steps(expected: Path, got: Path, steps: list[int]) -> None:
    """Losses and gradient norms of ``steps`` within 1e-5 relative."""
    by_step = {
        name: {r["step"]: r for r in records(d) if "loss" in r} for name, d in (("e", expected), ("g", got))
    }
    assert sorted(by_step["g"]) == steps
    for step in steps:
        for key in ("loss", "grad_norm"):
            e, g = by_step["e"][step][key], by_step["g"][step][key]
            assert abs(g - e) <= 1e-5 * abs(e), f"step {step}: {key} {g} vs single-rank {e}"


@pytest.fixture(scope="module")
def single_rank_run(tmp_path_factory, corpus) -> Path:
    d = tmp_path_factory.mktemp("cp_baseline")
    result = torchrun(1, cp_config(d, corpus, "run"))
    assert result.returncode == 0, result.stderr[-4000:]
    return d / "run"


@pytest.fixture(scope="module")
def cp2_pp2_run(tmp_path_factory, corpus) -> Path:
    """CP2 x PP2 with a fully reshardable save halfway, for the resharding test."""
    d = tmp_path_factory.mktemp("cp2pp2")
    config = cp_config(d, corpus, "run", interval=SAVED_AT, optimizer_format="fully_reshardable")
    result = torchrun(4, config, "parallel.context=2", "parallel.pipeline=2")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "CP=2 DP=1 on 4 cpu ranks" in result.stdout
    return d / "run"


LAYOUTS = [
    (2, ["parallel.context=2"]),
    (4, ["parallel.context=4"]),
    (4, ["parallel.context=2", "parallel.tensor=2", "parallel.sequence_parallel=true"]),
    (4, ["parallel.context=2"]),  # x DP2
]


@pytest.mark.parametrize(
    ("nproc", "overrides"), LAYOUTS, ids=["cp2", "cp4", "cp2-tp2-sp", "cp2-dp2"]
)  # fmt: skip
def test_context_parallel_layout_matches_single_rank(tmp_path, corpus, single_rank_run, nproc, overrides):
    result = torchrun(nproc, cp_config(tmp_path, corpus, "run"), *overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_same_steps(single_rank_run, tmp_path / "run", list(range(1, STEPS + 1)))


def test_context_and_pipeline_parallel_match_single_rank(single_rank_run, cp2_pp2_run):
    assert_same_steps(single_rank_run, cp2_pp2_run, list(range(1, STEPS + 1)))


@pytest.mark.parametrize(("nproc", "context"), [(1, 1), (4, 4)], ids=["cp1", "cp4"])
def test_checkpoints_reshard_across_context_parallel_sizes(tmp_path, corpus, cp2_pp2_run, nproc, context):
    run_dir = tmp_path / "run"
    saved = files.iteration_dir(cp2_pp2_run / "checkpoints", SAVED_AT)
    shutil.copytree(saved, files.iteration_dir(run_dir / "checkpoints", SAVED_AT))
    result = torchrun(nproc, cp_config(tmp_path, corpus, "run"), f"parallel.context={context}")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "resharded from TP1 x PP2 x VPP1 x DP2" in result.stdout
    assert_same_steps(cp2_pp2_run, run_dir, list(range(SAVED_AT + 1, STEPS + 1)))


def document_losses(tmp_path: Path, corpus, nproc: int, *overrides: str) -> dict:
    out = tmp_path / f"losses-{nproc}.pt"
    config = write_config(tmp_path / "documents.yaml", corpus, tmp_path / "run")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "tests/helpers/documents_worker.py", "--config", str(config), "--out", str(out),
               *overrides]  # fmt: skip
    result = subprocess.run(
        command, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out)


def worst_against_alone(results: dict, alone: list[torch.Tensor]) -> float:
    """The largest relative difference between a document's losses in the packed sample and alone
    (its EOD's loss, which predicts the next document, has no counterpart)."""
    worst, start = 0.0, 0
    for length, expected in zip(results["lengths"], alone):
        packed = results["packed"][start : start + length - 1]
        worst = max(worst, ((packed - expected).abs() / expected.abs()).max().item())
        start += length
    return worst


def test_document_mask_gives_each_document_its_own_losses_with_context_parallel(tmp_path, corpus):
    masked = ("data.document_mask=true", "data.reset_position_ids=true")
    single = document_losses(tmp_path, corpus, 1, *masked)
    assert worst_against_alone(single, single["alone"]) <= 1e-5
    cp2 = document_losses(tmp_path, corpus, 2, *masked)
    assert worst_against_alone(cp2, single["alone"]) <= 1e-5
    unmasked = {"lengths": single["lengths"], "packed": single["unmasked"]}
    assert worst_against_alone(unmasked, single["alone"]) > 1e-3, "the test cannot fail"
