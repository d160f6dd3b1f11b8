"""The memory model against measured peak memory, and preflight refusing layouts that do not fit."""

from __future__ import annotations

import dataclasses
import json

import pytest

from megatron_train.config_checks import validate_for_training, validate_options
from megatron_train.memory import estimate, fitting_layouts
from megatron_train.preflight import main as preflight
from megatron_train.resolve import load_config
from tests.conftest import ROOT, run_tool, write_config

LAYOUTS = [
    # (ranks, overrides): micro-batches of 2 x 512 tokens of the `small` preset, fp32 on CPU
    (2, ["parallel.tensor=2", "parallel.sequence_parallel=true", "train.global_batch_size=2"]),
    # two micro-batches, as many as the first stage holds at once under 1F1B at PP2: more would
    # not raise the peak, only the time
    (2, ["parallel.pipeline=2", "train.global_batch_size=4"]),
    (2, ["train.global_batch_size=4"]),
    # 16 experts of which each rank holds 8 (EP2), 4 per token; then recomputing the expert layers
    (2, ["model.preset=qwen3-moe-small", "parallel.expert=2", "train.global_batch_size=4"]),
    (
        2,
        [
            "model.preset=qwen3-moe-small",
            "parallel.expert=2",
            "train.global_batch_size=4",
            "model.recompute=selective",
            "model.recompute_modules=[moe,layernorm]",
        ],
    ),  # fmt: skip
    # our context-parallel attention, keys and values gathered
    (2, ["parallel.context=2", "train.global_batch_size=2"]),
    (1, ["model.recompute=full", "train.global_batch_size=2"]),
    (
        1,
        ["model.recompute=selective", "model.recompute_modules=[mlp,layernorm]", "train.global_batch_size=2"],
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("nproc", "overrides"), LAYOUTS, ids=lambda v: "-".join(v) if isinstance(v, list) else str(v)
)
def test_estimate_is_within_15_percent_of_the_measured_peak(nproc, overrides):
    result = run_tool(
        "benchmarks/memory_model.py",
        "--nproc",
        str(nproc),
        "train.micro_batch_size=2",
        *overrides,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    [line] = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    figures = json.loads(line.removeprefix("RESULT "))
    assert 0.85 <= figures["ratio"] <= 1.15, result.stdout


def test_preflight_refuses_a_layout_above_gpu_memory_and_names_ones_that_fit(tmp_path, corpus, capsys):
    config = write_config(
        tmp_path / "cfg.yaml",
        corpus,
        tmp_path / "run",
        model={"preset": "llama3-8b", "max_position_embeddings": 8192},
    )
    args = ["--config", str(config), "--nodes", "1", "--gpus-per-node", "8", "data.seq_length=8192",
            "train.micro_batch_size=1"]  # fmt: skip
    assert preflight(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "above --gpu-memory-gib=80" in err, err
    assert "use one of: parallel.tensor=" in err and "--allow-over-memory" in err
    assert preflight([*args, "--allow-over-memory"]) == 0
    assert preflight([*args, "parallel.tensor=2", "parallel.sequence_parallel=true"]) == 0
    report = capsys.readouterr().out
    assert "memory per GPU (estimate, only stage)" in report and "GiB of 80" in report
    # Overrides may come before, between and after the options, as users write them.
    mixed = ["--config", str(config), "data.seq_length=8192", "--gpus-per-node", "8"]
    mixed += ["train.micro_batch_size=1", "--nodes", "1"]
    mixed += ["parallel.tensor=2", "parallel.sequence_parallel=true"]
    assert preflight(mixed) == 0, capsys.readouterr().err


def test_the_long_context_config_fits_thanks_to_context_parallelism():
    """128k tokens per sequence on 64 GPUs: TP4 x CP8 fits an 80 GiB H100, TP4 alone does not."""
    cfg = load_config(ROOT / "configs" / "llama3_8b_128k.yaml")
    assert cfg.data.seq_length == 131072 and cfg.parallel.context == 8
    assert estimate(cfg, 64).total < 60 * 2**30
    without = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, context=1))
    assert estimate(without, 64).total > 80 * 2**30


@pytest.mark.parametrize("gib", [0.5, 50, 60])
def test_the_layouts_named_when_a_job_does_not_fit_are_ones_training_accepts(gib):
    """The search over TP x PP x CP x recompute kept the config's expert parallelism: at EP8 on 32
    GPUs a trial at PP8 left no expert-data-parallel rank, and preflight ended in a
    ZeroDivisionError where it should have named layouts or said none fits."""
    path = ROOT / "configs" / "qwen3_30b_a3b.yaml"
    cfg = load_config(path)
    assert cfg.parallel.expert == 8
    fits = fitting_layouts(cfg, 32, gib * 2**30)
    assert bool(fits) == (gib > 1)
    for layout in fits:
        trial = load_config(path, layout.split())
        validate_options(trial, 32)
        validate_for_training(trial)
        assert estimate(trial, 32).total <= gib * 2**30, layout
