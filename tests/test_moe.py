"""Mixture of experts through megatron-core's MoELayer over gloo: every expert-parallel layout
trains like one rank, checkpoints move between layouts, and the router's numbers are logged."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_train.checkpoint import files
from tests.conftest import records, run_tool, torchrun, train_losses, write_config

# One xdist worker runs this module, so its module-scoped reference runs are built once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("moe")]

# Dropless routing in fp32; a load-balancing loss and a shared expert so both take part.
MOE = {"preset": "qwen3-moe-tiny", "max_position_embeddings": 128, "moe_aux_loss_coeff": 0.01,
       "moe_shared_expert_ffn_hidden_size": 64}  # fmt: skip
SMALL_LR = {"lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 2}
STEPS = {"steps": 10, "eval_interval": 0}


def moe_config(tmp_path: Path, corpus, name: str, **model) -> Path:
    return write_config(
        tmp_path / f"{name}.yaml", corpus, tmp_path / name,
        model={**MOE, **model}, optimizer=SMALL_LR, train=STEPS,
    )  # fmt: skip


def logged(run_dir: Path, key: str) -> list[float]:
    return [r[key] for r in records(run_dir) if key in r]


def assert_same_run(expected: Path, got: Path) -> None:
    """Losses, gradient norms and the router's figures (load-balancing loss when it is on, the
    worst layer's max / mean tokens per expert) step by step."""
    keys = ["grad_norm", "moe_load_imbalance"] + ["moe_aux_loss"] * bool(logged(expected, "moe_aux_loss"))
    for what, a, b in [("loss", train_losses(expected), train_losses(got))] + [
        (key, logged(expected, key), logged(got, key)) for key in keys
    ]:
        assert len(a) == len(b) == STEPS["steps"], what
        for step, (e, g) in enumerate(zip(a, b), start=1):
            assert abs(g - e) <= 1e-5 * abs(e), f"step {step}: {what} {g} vs single-rank {e}"


@pytest.fixture(scope="module")
def moe_baseline(tmp_path_factory, corpus) -> Path:
    d = tmp_path_factory.mktemp("moe_baseline")
    result = torchrun(1, moe_config(d, corpus, "run"))
    assert result.returncode == 0, result.stderr[-4000:]
    return d / "run"


LAYOUTS = [
    # (ranks, overrides): EP ranks come from data-parallel ranks, times TP.
    (2, ["parallel.expert=2"]),
    (4, ["parallel.expert=2", "parallel.tensor=2", "parallel.sequence_parallel=true"]),
    # recomputing the whole expert layer (router, dispatch, experts, shared expert) in backward
    (
        4,
        [
            "parallel.expert=2",
            "parallel.pipeline=2",
            "model.recompute=selective",
            "model.recompute_modules=[moe]",
        ],
    ),
    (4, ["parallel.expert=4", "model.moe_token_dispatcher=allgather"]),
    # EP ranks from context-parallel ones: each holds half of every sequence's tokens
    (4, ["parallel.expert=2", "parallel.context=2"]),
]


@pytest.mark.parametrize(
    ("nproc", "overrides"), LAYOUTS, ids=lambda v: "-".join(v) if isinstance(v, list) else None
)
def test_expert_parallel_layout_matches_single_rank(tmp_path, corpus, moe_baseline, nproc, overrides):
    result = torchrun(nproc, moe_config(tmp_path, corpus, "run"), *overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_same_run(moe_baseline, tmp_path / "run")


def test_aux_loss_free_balancing_matches_single_rank_and_is_logged(tmp_path, corpus):
    """Sigmoid routing with DeepSeek-V3's expert bias: the bias moves every step from the expert
    loads of the whole step, so EP2 x DP2 must equal one rank there too."""
    bias = {"moe_router_score_function": "sigmoid", "moe_router_expert_bias": True, "moe_aux_loss_coeff": 0.0}
    runs = {}
    for name, nproc, overrides in [("single", 1, []), ("ep2", 2, ["parallel.expert=2"])]:
        result = torchrun(nproc, moe_config(tmp_path, corpus, name, **bias), *overrides)
        assert result.returncode == 0, result.stderr[-4000:]
        runs[name] = tmp_path / name
    assert_same_run(runs["single"], runs["ep2"])


def test_checkpoints_move_between_expert_layouts(tmp_path, corpus):
    """A fully reshardable save at EP2 x PP2 resumes at one rank and at EP2 x TP2; the interval
    save (dp_reshardable, per expert-parallel shard) refuses another expert split in one line."""
    train = {"steps": 6, "micro_batch_size": 1, "eval_interval": 0}
    checkpoint = {"interval": 3, "optimizer_format": "fully_reshardable"}
    base = write_config(tmp_path / "base.yaml", corpus, tmp_path / "base", model=MOE, optimizer=SMALL_LR,
                        train=train, checkpoint=checkpoint)  # fmt: skip
    result = torchrun(4, base, "parallel.expert=2", "parallel.pipeline=2")
    assert result.returncode == 0, result.stderr[-4000:]
    expected = {r["step"]: r["loss"] for r in records(tmp_path / "base") if "loss" in r}
    saved = files.iteration_dir(tmp_path / "base" / "checkpoints", 3)
    inspected = run_tool("tools/inspect_checkpoint.py", str(saved), "--no-tensors").stdout
    assert "8 experts of ffn 96 (top 2, shared expert ffn 64)" in inspected, inspected

    for name, nproc, layout in [
        ("single", 1, []),
        ("ep2tp2", 4, ["parallel.expert=2", "parallel.tensor=2", "parallel.sequence_parallel=true"]),
    ]:
        run_dir = tmp_path / name
        shutil.copytree(saved, files.iteration_dir(run_dir / "checkpoints", 3))
        config = write_config(
            tmp_path / f"{name}.yaml", corpus, run_dir, model=MOE, optimizer=SMALL_LR, train=train
        )
        resumed = torchrun(nproc, config, *layout)
        assert resumed.returncode == 0, resumed.stderr[-4000:]
        assert "resharded from TP1 x PP2 x VPP1 x DP2 x EP2 x ETP1" in resumed.stdout
        got = {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}
        assert sorted(got) == [4, 5, 6]
        for step, loss in got.items():
            assert abs(loss - expected[step]) <= 1e-5 * abs(expected[step]), f"{name} step {step}"

    checkpoint = {"interval": 3, "save_at_end": False}
    interval = write_config(tmp_path / "auto.yaml", corpus, tmp_path / "auto", model=MOE, optimizer=SMALL_LR,
                            train={**train, "steps": 3}, checkpoint=checkpoint)  # fmt: skip
    assert torchrun(2, interval, "parallel.expert=2").returncode == 0
    resumed = torchrun(2, interval, "train.steps=6")
    errors = [line for line in resumed.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "resumes only at TP1 x PP1 x VPP1 x EP2 x ETP1 (any DP)" in errors[0], (
        resumed.stderr[-3000:]
    )
    assert "[rank" not in resumed.stderr, "a rank printed a traceback"
