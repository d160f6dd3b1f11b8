"""Overlapped gradient reduce-scatter and parameter all-gather: the same losses as without, and
checkpoints that hold the step's weights (megatron leaves the parameters of other ranks' shards
un-gathered until the next forward, so a save must gather them first)."""

from __future__ import annotations

import signal

import pytest
from safetensors.torch import load_file

from megatron_train.checkpoint import files
from tests.conftest import records, run_tool, torchrun, torchrun_command, write_config
from tests.test_checkpoint import start, wait_for

pytestmark = pytest.mark.slow

# Small buckets, so several reduce-scatters and all-gathers overlap; runs compared share them, as
# the bucket layout sets the optimizer's shard boundaries (and so Adam's rounding).
BUCKETS = "ddp.bucket_size=20000"
OVERLAP = ["ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true", BUCKETS]


def _steps(run_dir) -> dict[int, tuple[float, float]]:
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records(run_dir) if "loss" in r}


def _train(tmp_path, corpus, name: str, nproc: int, *overrides: str):
    config = write_config(tmp_path / f"{name}.yaml", corpus, tmp_path / name, train={"eval_interval": 0})
    result = torchrun(nproc, config, *overrides)
    assert result.returncode == 0, result.stderr[-4000:]
    return tmp_path / name


def test_overlap_at_dp2_matches_and_resumes_bitwise_from_its_saves(tmp_path, corpus):
    off = _steps(_train(tmp_path, corpus, "off", 2, BUCKETS))
    saves = ["checkpoint.interval=2", "checkpoint.interval_minutes=0.0001", "checkpoint.keep_last=0"]
    on_dir = _train(tmp_path, corpus, "on", 2, *OVERLAP, *saves)
    on = _steps(on_dir)
    assert sorted(on) == list(range(1, 7))
    for step in on:
        assert on[step][0] == pytest.approx(off[step][0], rel=1e-6), f"step {step}"
        assert on[step][1] == pytest.approx(off[step][1], rel=1e-6), f"step {step}"
    # Steps 2 and 4 were saved by the step interval, 1, 3 and 5 by the minute interval, 6 at the
    # end; resuming from one of each of the first two continues bitwise.
    for first in (2, 3):
        load = f"checkpoint.load={on_dir}/checkpoints/iter_{first:07d}"
        resumed = _steps(_train(tmp_path, corpus, f"resumed-{first}", 2, *OVERLAP, load))
        assert sorted(resumed) == list(range(first + 1, 7))
        assert all(resumed[step] == on[step] for step in resumed), (first, resumed, on)
    # The end-of-run checkpoint holds step 6's weights: exported, they equal the run without overlap
    # (a stale shard would differ in half of every tensor by an Adam step; rounding noise, which
    # Adam magnifies where a gradient is near zero, moves single elements).
    exported = {}
    for name in ("off", "on"):
        out = tmp_path / f"hf-{name}"
        run_tool("tools/convert_checkpoint.py", "export-hf", "--ckpt", str(tmp_path / name / "checkpoints"),
                 "--out", str(out))  # fmt: skip
        exported[name] = {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
    assert exported["on"].keys() == exported["off"].keys()
    for key, weight in exported["off"].items():
        differ = ((exported["on"][key] - weight).abs() > 1e-5).sum().item()
        assert differ <= max(1, weight.numel() // 1000), (
            f"{key}: {differ} of {weight.numel()} elements differ"
        )


def test_overlap_save_on_a_signal_then_resume_is_bitwise(tmp_path, corpus):
    """SIGTERM mid-run at DP2 with overlap: the stop save, resumed, continues the uninterrupted run."""
    train = {"steps": 30, "eval_interval": 0}
    straight = write_config(tmp_path / "a.yaml", corpus, tmp_path / "a", train=train)
    result = torchrun(2, straight, *OVERLAP)
    assert result.returncode == 0, result.stderr[-4000:]
    config = write_config(tmp_path / "b.yaml", corpus, tmp_path / "b", train=train)
    log = tmp_path / "b.log"
    proc = start(torchrun_command(2, config, *OVERLAP), log)
    wait_for(lambda: "step 3/" in log.read_text(), proc, log, poll=0.05)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    assert "on signal SIGTERM" in log.read_text(), log.read_text()[-3000:]
    stopped_at = files.iteration_of(files.find_latest_complete(tmp_path / "b" / "checkpoints").path)
    assert stopped_at < 30
    resumed = torchrun(2, config, *OVERLAP)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert _steps(tmp_path / "b") == _steps(tmp_path / "a")


def test_overlap_under_the_interleaved_schedule_matches_one_rank(tmp_path, corpus):
    """PP3 x VPP2 x DP2 with both overlaps (the all-gathers aligned across stages, as in
    Megatron-LM) against one rank: 6 layers, 6 microbatches of one sequence per DP rank."""
    shape = ["model.num_layers=6", "train.micro_batch_size=1", "train.global_batch_size=12"]
    single = _steps(_train(tmp_path, corpus, "single", 1, *shape))
    vpp = _steps(
        _train(
            tmp_path, corpus, "vpp", 6, *shape, *OVERLAP, "parallel.pipeline=3", "parallel.virtual_pipeline=2"
        )
    )
    assert sorted(vpp) == sorted(single) == list(range(1, 7))
    for step, (loss, norm) in vpp.items():
        assert loss == pytest.approx(single[step][0], rel=1e-5), f"step {step}"
        assert norm == pytest.approx(single[step][1], rel=1e-4), f"step {step}"
