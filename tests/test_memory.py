"""The memory model against measured peak memory, and preflight refusing layouts that do not fit."""

from __future__ import annotations

import json

import pytest

from megatron_train.preflight import main as preflight
from tests.conftest import run_tool, write_config

LAYOUTS = [
    # (ranks, overrides): one micro-batch of 2 x 512 tokens of the `small` preset, fp32 on CPU
    (2, ["parallel.tensor=2", "parallel.sequence_parallel=true", "train.global_batch_size=2"]),
    (2, ["parallel.pipeline=2", "train.global_batch_size=8"]),
    (2, ["train.global_batch_size=4"]),
    # 16 experts of which each rank holds 8 (EP2), 4 per token
    (2, ["model.preset=qwen3-moe-small", "parallel.expert=2", "train.global_batch_size=4"]),
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
