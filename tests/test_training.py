"""End-to-end training through torchrun over gloo: layouts agree, metrics are written, NaN stops."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_train import placement
from megatron_train.errors import out_of_shared_memory
from tests.conftest import ROOT, records, single_rank, torchrun, torchrun_env, train_losses, write_config

# One xdist worker runs this module, so its module-scoped reference runs are built once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("training")]


def grad_norms(run_dir: Path) -> list[float]:
    return [r["grad_norm"] for r in records(run_dir) if "grad_norm" in r]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, corpus) -> Path:
    d = tmp_path_factory.mktemp("baseline")
    result = torchrun(1, write_config(d / "cfg.yaml", corpus, d / "run"))
    assert result.returncode == 0, result.stderr[-4000:]
    return d / "run"


def test_single_rank_run_writes_metrics_and_config(baseline):
    recs = records(baseline)
    train = [r for r in recs if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "consumed_tokens", "peak_mem_gib"):
        assert key in train[0]
    assert [r["step"] for r in recs if "val_loss" in r] == [3, 6]
    assert train[-1]["loss"] < train[0]["loss"]
    assert (baseline / "config.yaml").is_file()


def test_a_long_validation_reports_its_progress_each_log_interval(tmp_path, corpus):
    """At PP2 a schedule call runs 3 batches of 4 micro-batches (its fill and drain under a tenth),
    so the line comes after the first call past each log interval, and the loss is PP1's."""
    config = write_config(
        tmp_path / "cfg.yaml", corpus, tmp_path / "run",
        train={"steps": 1, "eval_interval": 1, "eval_steps": 5}, logging={"log_interval": 2},
        optimizer={"warmup_steps": 0},
        checkpoint={"save_at_end": False},
    )  # fmt: skip
    progress = {}
    for pipeline, result in (
        (1, single_rank(config)),
        (2, torchrun(2, config, "parallel.pipeline=2", f"logging.run_dir={tmp_path / 'pp2'}")),
    ):
        assert result.returncode == 0, result.stderr[-4000:]
        lines = [line for line in result.stdout.splitlines() if line.startswith("validation at step 1 |")]
        progress[pipeline] = [line.split(" | ")[1] for line in lines[:-1]]
        assert lines[-1].split(" | ")[1].startswith("val loss ")
    val_loss = [r["val_loss"] for run in ("run", "pp2") for r in records(tmp_path / run) if "val_loss" in r]
    assert progress == {1: ["batch 2/5", "batch 4/5"], 2: ["batch 3/5"]}
    assert len(val_loss) == 2 and abs(val_loss[1] - val_loss[0]) <= 1e-5 * val_loss[0]


# Through sitecustomize, every process a test's Python forks appends its parent's pid to a file.
RECORD_FORKS = """
import os


def _record_fork():
    fd = os.open({record!r}, os.O_CREAT | os.O_APPEND | os.O_WRONLY)
    os.write(fd, f"{{os.getppid()}}\\n".encode())
    os.close(fd)


os.register_at_fork(after_in_child=_record_fork)
"""


def test_data_workers_read_the_batches_the_training_process_reads(tmp_path, corpus, baseline):
    """With worker processes, the training batches and each validation pass are those read
    without them; validation's loader and its worker are made once and serve every pass."""
    hook, forks = tmp_path / "hook", tmp_path / "forks"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(RECORD_FORKS.format(record=str(forks)))
    # No checkpoint: the async writer is a forked process too.
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run", checkpoint={"save_at_end": False})
    cmd = [sys.executable, "-m", "megatron_train.train", "--config", str(config), "data.num_workers=1"]
    env = {**torchrun_env(), "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-4000:]

    def numbers(run_dir: Path) -> list[tuple]:
        return [(r["step"], r.get("loss"), r.get("grad_norm"), r.get("val_loss")) for r in records(run_dir)]

    assert numbers(tmp_path / "run") == numbers(baseline)
    assert sum(r.get("val_loss") is not None for r in records(baseline)) == 2
    # One worker for training, one for validation (not one per validation pass).
    assert forks.read_text().split().count(str(proc.pid)) == 2


# Adam turns fp32 reduction-order noise (TP splits matmul sums) into update differences that grow
# each step; a pretraining-scale learning rate keeps 6 steps well inside 1e-5.
SMALL_LR = {"lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 2}


@pytest.fixture(scope="module")
def small_lr_baseline(tmp_path_factory, corpus) -> Path:
    d = tmp_path_factory.mktemp("baseline_small_lr")
    result = torchrun(1, write_config(d / "cfg.yaml", corpus, d / "run", optimizer=SMALL_LR))
    assert result.returncode == 0, result.stderr[-4000:]
    return d / "run"


LAYOUTS = [
    # (tensor, pipeline, data, extra overrides)
    (2, 1, 1, []),
    (1, 2, 1, []),
    (1, 1, 2, ["optimizer.distributed=false"]),
    # TP x PP x DP at eight ranks once, with the overlaps on: tests/test_overlap.py matches them
    # against the run without at DP2.
    (2, 2, 2, ["ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true", "ddp.bucket_size=20000"]),
    (2, 1, 1, ["parallel.sequence_parallel=true"]),
    (2, 2, 1, ["parallel.sequence_parallel=true"]),
]


def assert_losses_match(baseline: Path, run: Path, what: str) -> None:
    """Every step's training loss of ``run`` within 1e-5 (relative) of ``baseline``'s."""
    expected, got = train_losses(baseline), train_losses(run)
    assert len(got) == len(expected) >= 5
    for step, (e, g) in enumerate(zip(expected, got), start=1):
        assert abs(g - e) <= 1e-5 * abs(e), f"step {step}: {g} vs {what} {e}"


@pytest.mark.parametrize(
    ("tp", "pp", "dp", "extra"),
    LAYOUTS,
    ids=lambda v: str(v).replace("parallel.", "").replace("train.", "") if isinstance(v, list) else None,
)
def test_layout_matches_single_rank(tmp_path, corpus, small_lr_baseline, tp, pp, dp, extra):
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run", optimizer=SMALL_LR)
    result = torchrun(tp * pp * dp, config, f"parallel.tensor={tp}", f"parallel.pipeline={pp}", *extra)
    assert result.returncode == 0, result.stderr[-4000:]
    assert_losses_match(small_lr_baseline, tmp_path / "run", "single-rank")
    # The gradient norm drives clipping, so it must not depend on the layout either.
    expected_norms, norms = grad_norms(small_lr_baseline), grad_norms(tmp_path / "run")
    for step, (e, g) in enumerate(zip(expected_norms, norms), start=1):
        assert abs(g - e) <= 1e-4 * e, f"step {step}: grad norm {g} vs single-rank {e}"


def test_compiled_rotary_embedding_matches_single_rank(tmp_path, corpus, small_lr_baseline, monkeypatch):
    """model.rope_fusion at TP2 (each rank rotates half the heads) against the eager single-rank run."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run", optimizer=SMALL_LR)
    result = torchrun(2, config, "model.rope_fusion=true", "parallel.tensor=2")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "RoPE compiled" in result.stdout
    assert list((tmp_path / "inductor").rglob("*.py")), "nothing was compiled"
    assert_losses_match(small_lr_baseline, tmp_path / "run", "eager single-rank")


def test_compiled_layers_match_single_rank_and_resume_bitwise(
    tmp_path, corpus, small_lr_baseline, monkeypatch
):
    """model.compile (the layers and the loss) at TP2 x SP (tensor-parallel communication splits
    the compiled layer; the loss runs over each rank's half of the vocabulary) with full recompute,
    against the eager single-rank run; then a compiled resume from step 3."""
    # Inductor's generated code lands here, which shows the layers were compiled.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run", optimizer=SMALL_LR,
                          checkpoint={"interval": 3})  # fmt: skip
    layout = [
        "model.compile=true",
        "parallel.tensor=2",
        "parallel.sequence_parallel=true",
        "model.recompute=full",
    ]
    result = torchrun(2, config, *layout)
    assert result.returncode == 0, result.stderr[-4000:]
    assert not result.stderr.strip(), result.stderr[-4000:]
    assert "layers compiled, fused cross-entropy (compiled passes)" in result.stdout
    assert list((tmp_path / "inductor").rglob("*.py")), "nothing was compiled"
    assert_losses_match(small_lr_baseline, tmp_path / "run", "eager single-rank")

    resumed = tmp_path / "resumed"
    shutil.copytree(
        tmp_path / "run" / "checkpoints" / "iter_0000003", resumed / "checkpoints" / "iter_0000003"
    )
    config = write_config(tmp_path / "resumed.yaml", corpus, resumed, optimizer=SMALL_LR)
    result = torchrun(2, config, *layout)
    assert result.returncode == 0, result.stderr[-4000:]
    again = {r["step"]: r["loss"] for r in records(resumed) if "loss" in r}
    assert again == {r["step"]: r["loss"] for r in records(tmp_path / "run") if "loss" in r and r["step"] > 3}


def _trace_events(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def test_a_profile_on_rank_one_records_its_steps_and_leaves_the_training_as_it_was(
    tmp_path, corpus, small_lr_baseline
):
    """profile.* at DP2: rank 1 alone writes a trace of steps 2-4 (gzipped Chrome JSON, each
    step named, allocations and input shapes recorded) and its operator table; rank 0 writes
    nothing, and the losses are those of the unprofiled single-rank run."""
    profile = {"start_step": 2, "num_steps": 3, "ranks": [1], "memory": True, "record_shapes": True}
    run = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", corpus, run, optimizer=SMALL_LR, profile=profile)
    result = torchrun(2, config, "optimizer.distributed=false")
    assert result.returncode == 0, result.stderr[-4000:]
    folder = run / "profile" / "step2-4"
    assert [p.name for p in (run / "profile").iterdir()] == ["step2-4"]
    assert sorted(p.name for p in folder.iterdir()) == ["rank1.json.gz", "rank1.txt"]
    assert f"profile of steps 2-4 on rank 1: {folder / 'rank1.json.gz'} (" in result.stdout
    events = _trace_events(folder / "rank1.json.gz")
    steps = {e["name"] for e in events if e["name"].startswith("train step")}
    assert steps == {"train step 2", "train step 3", "train step 4"}
    assert any(e["name"] == "[memory]" for e in events)
    assert any("Input Dims" in e.get("args", {}) for e in events if e["name"] == "aten::mm")
    assert "aten::mm" in (folder / "rank1.txt").read_text()
    assert_losses_match(small_lr_baseline, run, "unprofiled single-rank")


def test_a_resumed_run_profiles_the_rest_of_its_window_and_a_stop_inside_one_drops_it(
    tmp_path, corpus, trained
):
    """Resumed at step 5 with a window of steps 4-5, the trace covers step 5; a stop inside a
    window (train.exit_after_minutes) does not wait for its trace; a window before the resume
    point is named."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    config = write_config(tmp_path / "cfg.yaml", corpus, run, train={"steps": 8})
    result = single_rank(config, "profile.start_step=4", "profile.num_steps=2")
    assert result.returncode == 0, result.stderr[-4000:]
    folder = run / "profile" / "step5"
    assert f"profile of step 5 on rank 0: {folder / 'rank0.json.gz'} (" in result.stdout
    steps = {e["name"] for e in _trace_events(folder / "rank0.json.gz") if e["name"].startswith("train step")}
    assert steps == {"train step 5"}

    result = single_rank(
        config,
        "train.steps=12",
        "profile.start_step=9",
        "profile.num_steps=3",
        "train.exit_after_minutes=0.001",
    )
    assert result.returncode == 3, result.stderr[-4000:]
    assert "stopping after step 9" in result.stdout
    assert (
        "profile: the run stopped after step 9, inside the profiled steps 9-11; their trace is not written"
        in (result.stdout)
    )
    result = single_rank(config, "train.steps=12", "profile.start_step=2", "profile.num_steps=2")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "profile: steps 2-3 were trained before this start (it resumes at step 10)" in result.stdout
    assert [p.name for p in (run / "profile").iterdir()] == ["step5"]


def test_a_trace_that_cannot_be_written_is_one_warning_and_training_goes_on(tmp_path, corpus, trained):
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    # A file where the step's trace folder would go: the start checks only the profile folder.
    (run / "profile").mkdir()
    (run / "profile" / "step5").write_text("a file where the traces' folder would go\n")
    config = write_config(tmp_path / "cfg.yaml", corpus, run, profile={"start_step": 5, "num_steps": 1})
    result = single_rank(config)
    assert result.returncode == 0, result.stderr[-4000:]
    warnings = [line for line in result.stdout.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "the profile of step 5 could not be written to" in warnings[0], warnings
    assert "training goes on without it" in warnings[0]
    assert [r["step"] for r in records(run) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert (run / "profile" / "step5").read_text() == "a file where the traces' folder would go\n"


def test_interleaved_pipeline_matches_single_rank(tmp_path, corpus):
    """PP4 x VPP2 (8 layers, 8 microbatches: more than the 4 stages) against one rank, at the
    largest seed, which each later stage's seed offset takes past NumPy's limit."""
    runs = {}
    for name, nproc, overrides in [
        ("single", 1, []),
        ("vpp", 4, ["parallel.pipeline=4", "parallel.virtual_pipeline=2"]),
    ]:
        config = write_config(tmp_path / f"{name}.yaml", corpus, tmp_path / name, optimizer=SMALL_LR)
        result = torchrun(
            nproc,
            config,
            "model.num_layers=8",
            "train.micro_batch_size=1",
            f"train.seed={2**32 - 1}",
            *overrides,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        runs[name] = tmp_path / name
    assert_losses_match(runs["single"], runs["vpp"], "single-rank")
    for step, (e, g) in enumerate(zip(grad_norms(runs["single"]), grad_norms(runs["vpp"])), start=1):
        assert abs(g - e) <= 1e-4 * e, f"step {step}: grad norm {g} vs single-rank {e}"


def test_nan_loss_stops_with_the_step_in_one_line(tmp_path, corpus):
    """Every rank meets it at the same step (the loss and the norm are the job's), and each one
    printed it: a line per rank, 512 on 512 GPUs; torch's agent added a log line of its own
    ("failed (exitcode: 1) local_rank: 0 (pid: ...) of binary: ...") above the launcher's."""
    config = write_config(
        tmp_path / "cfg.yaml", corpus, tmp_path / "run", optimizer={"lr": 1e30, "warmup_steps": 0}
    )
    cmd = [sys.executable, "-m", "megatron_train.torchrun", "--standalone", "--nproc-per-node=2", "-m",
           "megatron_train.train", "--config", str(config), "optimizer.clip_grad=0",
           "parallel.pipeline=2"]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    [line, launcher] = result.stderr.splitlines()
    assert line.startswith("error: step ") and "is not finite" in line
    assert launcher == "error: rank 0 failed first, with exit code 1; its output is above"


# In a mount namespace of its own: the run directory on a small tmpfs that fills up once the run
# has logged its first step, as a shared disk does when another job writes to it.
FILLS_UP = """
mount -t tmpfs -o size=32m tmpfs "$1" || exit 99
dir=$1; shift
"$@" &
until [ -s "$dir/run/metrics.jsonl" ]; do sleep 0.1; done
head -c 32m /dev/zero > "$dir/filler" 2>/dev/null
wait $!
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a tmpfs of its own needs root")
def test_a_disk_that_fills_under_rank_zero_ends_the_run_in_a_line_per_rank(tmp_path, corpus):
    """Rank 0's log file found no room, and rank 0 said so in one line; rank 1, waiting on rank 0
    in its next collective, ended in a 40-line traceback of gloo's "Connection closed by peer"
    that buried it."""
    disk = tmp_path / "disk"
    disk.mkdir()
    config = write_config(
        tmp_path / "cfg.yaml", corpus, disk / "run", train={"steps": 1000}, logging={"log_interval": 1}
    )
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", FILLS_UP, "sh", str(disk),
           sys.executable, "-m", "megatron_train.torchrun", "--standalone", "--nproc-per-node=2", "-m",
           "megatron_train.train", "--config", str(config), "checkpoint.interval=0"]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 3 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines[0].startswith("error on rank 0: a file of the run could not be written ([Errno 28] "), lines
    gone = "error on rank 1: stopped: another rank's process went away during a collective"
    assert lines[1].startswith(f"{gone} (Connection closed by peer ["), lines
    assert lines[1].endswith("). Fix: see that rank's error above (or in its log)"), lines
    assert lines[2] == "error: rank 0 failed first, with exit code 1; its output is above"


def test_a_hung_rank_ends_the_job_at_the_collective_timeout_in_one_line(tmp_path, corpus):
    """MEGATRON_TRAIN_DIST_TIMEOUT_MIN applied to the default group only: the collectives of
    training run in megatron's groups, which waited megatron's own 30 minutes for a hung rank,
    and the rank that waited ended in gloo's traceback."""
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run", train={"steps": 1000})
    cmd = [sys.executable, "-m", "megatron_train.torchrun", "--standalone", "--nproc-per-node=2", "-m",
           "megatron_train.train", "--config", str(config), "logging.log_interval=1"]  # fmt: skip
    env = {**torchrun_env(), "MEGATRON_TRAIN_DIST_TIMEOUT_MIN": "0.1"}
    run = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = {int(p.environ()["RANK"]): p for p in psutil.Process(run.pid).children()}
        ranks[1].suspend()  # SIGSTOP: hung, as in a stuck read or a deadlock
        _, waiting = psutil.wait_procs([ranks[0]], timeout=120)
        ranks[1].resume()
        assert not waiting, "rank 0 still waits for the hung rank"
        _, err = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[0].startswith(
        "error on rank 0: a collective waited its 0.1 minutes (MEGATRON_TRAIN_DIST_TIMEOUT_MIN) for another "
        "rank (Timed out waiting 6000ms for "
    ), lines
    assert lines[-1] == "error: rank 0 failed first, with exit code 1; its output is above"


# In a mount namespace of its own: a run saved on a small tmpfs, which then fills up before the
# run is resumed.
RESUMED_ON_A_FULL_DISK = """
mount -t tmpfs -o size=64m tmpfs "$1" || exit 99
disk=$1; out=$2; shift 2
"$@" train.steps=2 > "$out/first.log" 2>&1 || exit 98
(cd "$disk/run" && find . -type f -exec sha256sum {} + | sort) > "$out/before"
head -c 64m /dev/zero > "$disk/filler" 2>/dev/null
"$@" train.steps=4 > "$out/resume.out" 2> "$out/resume.err"
echo $? > "$out/resume.rc"
(cd "$disk/run" && find . -type f -exec sha256sum {} + | sort) > "$out/after"
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a tmpfs of its own needs root")
def test_a_resume_on_a_full_disk_fails_in_one_line_and_leaves_the_run_as_it_was(tmp_path, corpus):
    """A start rewrote the run's config.yaml in place (a full disk tore it) and left an empty
    metrics.jsonl.tmp beside the metrics it meant to trim."""
    disk, out = tmp_path / "disk", tmp_path / "out"
    disk.mkdir()
    out.mkdir()
    config = write_config(tmp_path / "cfg.yaml", corpus, disk / "run", checkpoint={"interval": 2})
    train = [sys.executable, "-m", "megatron_train.train", "--config", str(config)]
    train.append("optimizer.warmup_steps=1")
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", RESUMED_ON_A_FULL_DISK, "sh",
           str(disk), str(out), *train]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.stderr, (out / "first.log").read_text()[-3000:])
    assert (out / "resume.rc").read_text().strip() == "1"
    err = (out / "resume.err").read_text()
    [line] = [line for line in err.splitlines() if line.strip()]
    assert line.startswith("error on rank 0: a file of the run could not be written ([Errno 28] "), err
    before = (out / "before").read_text()
    assert "config.yaml" in before and "iter_0000002" in before
    assert (out / "after").read_text() == before


@pytest.mark.skipif(os.geteuid() != 0, reason="a /dev/shm of its own needs root")
@pytest.mark.parametrize(
    ("shm", "says"),
    [
        (
            "mount -t tmpfs -o size=512k tmpfs /dev/shm",
            "(RuntimeError: unable to allocate shared memory(shm) for file ",
        ),
        (
            "mount -t tmpfs -o size=4k tmpfs /dev/shm && head -c 4k /dev/zero > /dev/shm/full",
            "(a semaphore could not be created: [Errno 28] No space left on device). ",
        ),
    ],
    ids=["no-room-for-a-batch", "no-room-for-a-semaphore"],
)
def test_loader_workers_that_find_shared_memory_full_end_the_run_in_one_line(tmp_path, corpus, shm, says):
    """A container's small /dev/shm (Docker's default is 64 MB), in which the loader's workers
    cannot hand over a batch: the run ended in torch's 40-line traceback of a worker's error. A
    full one, in which the loader cannot make its queues, added a traceback of its __del__."""
    config = write_config(
        tmp_path / "cfg.yaml", corpus, tmp_path / "run", model={"max_position_embeddings": 512}
    )
    # 512 KiB: room for the loader's queues, not for one batch of 64 x 513 tokens (four tensors of
    # 128 KiB to 256 KiB each).
    train = [sys.executable, "-m", "megatron_train.train", "--config", str(config), "data.num_workers=2",
             "train.micro_batch_size=64", "train.global_batch_size=64", "data.seq_length=512"]  # fmt: skip
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", f'{shm} && exec "$@"', "sh", *train]
    result = subprocess.run(cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    full = "error on rank 0: the data loader's worker processes found shared memory (/dev/shm) full"
    assert line.startswith(f"{full} {says}"), line
    assert line.endswith(
        "Fix: give the job more shared memory (a container's --shm-size) or set data.num_workers=0"
    )


def _started_training(cmd: list[str], run_dir: Path) -> subprocess.Popen:
    """``cmd`` started, and (for at most two minutes) waited on until its first step is logged."""
    run = subprocess.Popen(
        cmd, cwd=ROOT, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return run


def test_a_loader_worker_that_is_killed_ends_the_run_in_one_line(tmp_path, corpus):
    """The out-of-memory killer's usual victim on a busy node: the run ended in a traceback of
    torch's "DataLoader worker (pid N) is killed by signal: Killed"."""
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run", train={"steps": 1000})
    cmd = [sys.executable, "-m", "megatron_train.train", "--config", str(config), "data.num_workers=2",
           "train.eval_interval=0", "checkpoint.interval=0", "checkpoint.async_save=false",
           "logging.log_interval=1"]  # fmt: skip
    run = _started_training(cmd, tmp_path / "run")
    try:
        trainer = psutil.Process(run.pid)
        # The loader's workers are forks of the training process; the results server is not.
        [worker, _] = [child for child in trainer.children() if child.cmdline() == trainer.cmdline()]
        worker.kill()
        _, err = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 1, err[-3000:]
    [line] = [line for line in err.splitlines() if line.strip()]
    # torch's words depend on where the rank learns of it: its SIGCHLD handler, or a wait for a
    # batch that finds the worker gone.
    assert line in [
        f"error on rank 0: a data loader worker process went away (DataLoader worker ({lost}; the "
        "out-of-memory killer sends SIGKILL: see dmesg). Fix: leave the loader more memory or set fewer "
        "data.num_workers, then run the same command to resume from the last checkpoint"
        for lost in (
            f"pid {worker.pid}) is killed by signal: Killed",
            f"pid(s) {worker.pid}) exited unexpectedly",
        )
    ], line


def test_a_dataset_cut_while_the_run_reads_it_ends_the_run_in_the_launchers_line(tmp_path, corpus):
    """The read past the end of the shrunk file's memory map is a SIGBUS: faulthandler's dump of
    the loader's frames came before the launcher's line, which names the cause."""
    data = tmp_path / "data"
    data.mkdir()
    for suffix in (".bin", ".idx"):
        shutil.copy(corpus["prefix"].with_suffix(suffix), data / f"d{suffix}")
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run", train={"steps": 1000})
    cmd = [sys.executable, "-m", "megatron_train.torchrun", "--standalone", "--nproc-per-node=1",
           "-m", "megatron_train.train", "--config", str(config), f"data.blend=[{data / 'd'}]",
           "train.eval_interval=0", "checkpoint.interval=0", "logging.log_interval=1"]  # fmt: skip
    run = _started_training(cmd, tmp_path / "run")
    try:
        os.truncate(data / "d.bin", 4096)
        _, err = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 1, err[-3000:]
    assert [line for line in err.splitlines() if line.strip()] == [
        "error: rank 0 was killed by SIGBUS (a file it had mapped shrank: a dataset rewritten or cut while "
        "the run read it) before any other rank failed"
    ]


FULL_SHM_QUEUE = """
import multiprocessing
from megatron_train import placement
from megatron_train.errors import out_of_shared_memory
try:
    multiprocessing.Queue()
except OSError as err:
    print(out_of_shared_memory(err))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="a /dev/shm of its own needs root")
def test_a_semaphore_that_shared_memory_has_no_room_for_is_told_from_a_full_disk():
    """The loader's queues need semaphores in /dev/shm; multiprocessing's ENOSPC for one names no
    file, as a write to a full disk does not, and the run blamed its run directory."""
    script = 'mount -t tmpfs -o size=4k tmpfs /dev/shm && head -c 4k /dev/zero > /dev/shm/full; exec "$@"'
    cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", sys.executable, "-c",
           FULL_SHM_QUEUE]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "a semaphore could not be created: [Errno 28] No space left on device"
    assert out_of_shared_memory(OSError(28, "No space left on device")) is None


@pytest.mark.parametrize("stdout", ["full", "closed"])
def test_a_log_without_room_leaves_the_run_training(tmp_path, corpus, stdout):
    """Standard output on a full disk (a log in a home folder past its quota, say): the run ended
    at its first line with exit code 1 and a line blaming its run directory, and a log that
    filled up later ended a run, unsaved, at its next line. One closed (``>&-``) ended the run
    in a traceback as it closed its log."""
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run", checkpoint={"interval": 2})
    closed = (lambda: os.close(1)) if stdout == "closed" else None
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "megatron_train.train", "--config", str(config)],
            cwd=ROOT, env=torchrun_env(), stderr=subprocess.PIPE, text=True, timeout=300,
            stdout=full if stdout == "full" else None, preexec_fn=closed,
        )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("note: standard output had no room for the log") == (stdout == "full")
    assert [r["step"] for r in records(tmp_path / "run") if "loss" in r] == list(range(1, 7))
    assert (tmp_path / "run" / "checkpoints" / "iter_0000006").is_dir()


def test_a_rank_killed_by_a_native_crash_prints_where_its_threads_were(tmp_path, corpus):
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run", train={"steps": 400})
    cmd = [sys.executable, "-m", "megatron_train.train", "--config", str(config)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=torchrun_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    for line in proc.stdout:
        if line.startswith("step 2/"):
            break
    proc.send_signal(signal.SIGSEGV)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGSEGV
    assert "Fatal Python error: Segmentation fault" in err and "megatron_train/train.py" in err, err[-3000:]


# Through sitecustomize in each rank: rank 0 starts late (as on a slow node), or rank 1 alone is
# given a dataset that does not exist (as a path its node lacks).
LATE_RANK_ZERO = "import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(5)\n"
RANK_ONE_ALONE = (
    "import os, sys\nif os.environ.get('RANK') == '1':\n    sys.argv.append('data.blend=[/rank1/data]')\n"
)


@pytest.mark.parametrize("hook_code", [LATE_RANK_ZERO, RANK_ONE_ALONE], ids=["rank-0-late", "rank-1-alone"])
def test_a_bad_config_on_two_ranks_is_reported_once_whichever_rank_ends_first(tmp_path, corpus, hook_code):
    """A launcher ends every rank once one exits: rank 1 exiting first used to end rank 0 before
    it printed, and the job ended with exit 2 and no line; a problem of rank 1 alone had no line
    either."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(hook_code)
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run")
    bad = ["parallel.tensor=3"] if hook_code is LATE_RANK_ZERO else []
    cmd = [sys.executable, "-m", "megatron_train.torchrun", "--standalone", "--nproc-per-node=2",
           "-m", "megatron_train.train", "--config", str(config), *bad]  # fmt: skip
    env = {**torchrun_env(), "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr[-3000:]
    if hook_code is LATE_RANK_ZERO:
        assert lines[0].startswith("error: config error at 'parallel.tensor'"), lines
    else:
        assert lines[0].startswith("error: rank 1 on "), lines
        assert "'data.blend': /rank1/data.bin does not exist" in lines[0], lines


def test_ranks_started_with_different_configs_stop_before_any_group_in_one_line(tmp_path, corpus):
    """Rank 1 alone given another override, as a node's launcher given another command line:
    the ranks built different models, and gloo aborted rank 0 with a C++ error and a stack dump
    at the first gradient reduction."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, sys\nif os.environ.get('RANK') == '1':\n    sys.argv.append('model.num_layers=2')\n"
    )
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run")
    cmd = [sys.executable, "-m", "megatron_train.torchrun", "--standalone", "--nproc-per-node=2",
           "-m", "megatron_train.train", "--config", str(config)]  # fmt: skip
    env = {**torchrun_env(), "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.splitlines() == [
        f"error: config error at 'model.num_layers': is 2 on rank 1 ({placement.node_name()}) but 4 on "
        "rank 0 of 2: the ranks were started with different configs. Fix: start every rank with the same "
        "config file and overrides"
    ], result.stderr[-3000:]
    assert not (tmp_path / "run").exists()


# Through sitecustomize, before any thread starts: the two ranks say they run on two nodes, and
# with {private} rank 1 sees a tmpfs of its own where {folder} is, as a node-local disk would be.
TWO_NODES = """
import ctypes, os
rank = os.environ.get("RANK")
os.environ["SLURMD_NODENAME"] = "node-b" if rank == "1" else "node-a"
if rank == "1" and {private}:
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.unshare(0x20000) == 0, os.strerror(ctypes.get_errno())  # a mount namespace
    assert libc.mount(b"none", b"/", None, 0x44000, None) == 0  # MS_REC | MS_PRIVATE
    assert libc.mount(b"tmpfs", {folder!r}.encode(), b"tmpfs", 0, None) == 0
    import megatron_train.shared_folders as shared
    shared._PATIENCE_S = 1.0
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a node-local folder for one rank needs root")
@pytest.mark.parametrize("private", [False, True], ids=["shared", "node-local"])
def test_a_run_folder_that_is_not_shared_between_nodes_is_refused_at_start(tmp_path, corpus, private):
    """A run directory on a disk of each node's own: the other node's ranks would find none of
    the data indices rank 0 builds there, and each checkpoint would hold one node's shards."""
    hook, scratch = tmp_path / "hook", tmp_path / "scratch"
    hook.mkdir()
    scratch.mkdir()
    (hook / "sitecustomize.py").write_text(TWO_NODES.format(private=private, folder=str(scratch)))
    config = write_config(tmp_path / "cfg.yaml", corpus, scratch / "run", train={"steps": 3})
    cmd = [sys.executable, "-m", "megatron_train.torchrun", "--standalone", "--nproc-per-node=2",
           "-m", "megatron_train.train", "--config", str(config)]  # fmt: skip
    env = {**torchrun_env(), "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if not private:
        assert result.returncode == 0, result.stderr[-3000:]
        assert not list(scratch.glob("**/.shared-check-*"))
        return
    assert result.returncode == 2, result.stderr[-3000:]
    assert [line for line in result.stderr.splitlines() if line.strip()] == [
        f"error: config error at 'logging.run_dir': {scratch}/run/checkpoints is not on one file system "
        f"for every node: rank 1 on node-b does not see the file rank 0 on node-a wrote in {scratch} (is it "
        "local to each node?). Fix: point it at a file system every node mounts"
    ]
    assert list(scratch.iterdir()) == []  # no run folder made, no probe left


def test_the_local_launcher_ends_with_the_ranks_own_exit_code(tmp_path, corpus):
    """launch/local.sh: a bad config on two ranks is their one error line and exit 2, not
    torchrun's traceback and exit 1; a run stopped after its save exits 3."""
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run", train={"steps": 400})
    env = {**torchrun_env(), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

    def local(*overrides: str) -> subprocess.CompletedProcess:
        command = ["bash", "launch/local.sh", "2", "--config", str(config), *overrides]
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)

    bad = local("data.blend=[/nowhere/data]")
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert "Traceback" not in bad.stderr
    assert [line for line in bad.stderr.splitlines() if line.strip()] == [
        "error: config error at 'data.blend': /nowhere/data.bin does not exist. Fix: preprocess the data "
        "again with tools/preprocess_data.py or fix the prefix"
    ]
    stopped = local("train.exit_after_minutes=0.001")
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    assert "stopped early (checkpoint saved)" in stopped.stdout
