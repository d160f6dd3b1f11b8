"""Activation recomputation changes memory, not results: every mode gives the per-step losses and
gradient norms of the run without it (fp32 over gloo, at TP2 x PP2 and at DP2)."""

from __future__ import annotations

import pytest

from tests.conftest import records, torchrun, write_config

pytestmark = pytest.mark.slow

MODES = {
    "none": [],
    "selective": ["model.recompute=selective", "model.recompute_modules=[core_attn,mlp,layernorm]"],
    "full-uniform": [
        "model.recompute=full",
        "model.recompute_method=uniform",
        "model.recompute_num_layers=2",
    ],
    "full-block": ["model.recompute=full", "model.recompute_method=block", "model.recompute_num_layers=1"],
}
LAYOUTS = {
    "tp2-pp2": (4, ["parallel.tensor=2", "parallel.pipeline=2"], ["selective", "full-block"]),
    "dp2": (2, [], ["full-uniform"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_recompute_modes_match_the_run_without(tmp_path, corpus, layout):
    nproc, parallel, modes = LAYOUTS[layout]
    steps = {}
    for mode in ["none", *modes]:
        config = write_config(tmp_path / f"{mode}.yaml", corpus, tmp_path / mode, train={"eval_interval": 0})
        result = torchrun(nproc, config, *parallel, *MODES[mode])
        assert result.returncode == 0, result.stderr[-4000:]
        steps[mode] = [(r["loss"], r["grad_norm"]) for r in records(tmp_path / mode) if "loss" in r]
    assert len(steps["none"]) == 6
    for mode in modes:
        for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(steps[mode], steps["none"]), 1):
            assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), (
                f"{mode} step {step}: loss {loss} vs {ref_loss}"
            )
            assert abs(norm - ref_norm) <= 1e-6 * ref_norm, (
                f"{mode} step {step}: grad norm {norm} vs {ref_norm}"
            )
