"""Checkpoints end to end: exact resume after kill -9, resharding, signals, torn saves, integrity."""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from megatron_train.checkpoint import files
from megatron_train.checkpoint.state import Progress
from tests.conftest import (
    ROOT,
    records,
    run_tool,
    single_rank,
    torchrun,
    torchrun_command,
    torchrun_env,
    write_config,
)

pytestmark = pytest.mark.slow

EXIT_BAD_INPUT, EXIT_STOPPED_EARLY = 2, 3


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    """Start a run in its own session so the test can kill its whole process tree."""
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=torchrun_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def wait_for(condition, proc: subprocess.Popen, log: Path, timeout: float = 240, poll: float = 0.005) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"run ended early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out:\n{log.read_text()[-3000:]}"
        time.sleep(poll)


def tracker_at(save_dir: Path, iteration: int):
    tracker = save_dir / files.TRACKER
    return lambda: tracker.is_file() and tracker.read_text().strip() == str(iteration)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every descendant at once (torchrun puts workers in new sessions)."""
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:
        # A short-lived descendant may have exited since the listing.
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGKILL)
    psutil.wait_procs(tree, timeout=30)
    proc.wait()


def metric_lines(run_dir: Path) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("val_loss")) for r in records(run_dir)]


# PP and VPP, DP > 1, TP with SP, our context parallelism over document masks, recompute and expert
# parallelism (tests/test_slurm.py adds TP2 x PP2 across two nodes). Dropout: the resumed run must
# draw the same masks from the restored RNG streams (TP's tracker too; recompute draws them twice).
# Each layout costs three launches, so layouts share one where their features are independent.
DROPOUT = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
EXACT_LAYOUTS = [
    ("dp2-recompute-full-dropout", 2, ["model.recompute=full", *DROPOUT]),
    ("tp2-sp-dropout", 2, ["parallel.tensor=2", "parallel.sequence_parallel=true", *DROPOUT]),
    ("cp2-documents", 2, ["parallel.context=2", "data.document_mask=true"]),
    (
        "pp4vpp2",
        4,
        [
            "parallel.pipeline=4",
            "parallel.virtual_pipeline=2",
            "model.num_layers=8",
            "train.micro_batch_size=1",
        ],
    ),
    ("moe-ep2", 2, ["model.preset=qwen3-moe-tiny", "model.max_position_embeddings=128", "parallel.expert=2"]),
]


@pytest.mark.parametrize(("name", "nproc", "layout"), EXACT_LAYOUTS, ids=[x[0] for x in EXACT_LAYOUTS])
def test_kill9_after_a_save_then_auto_resume_is_bitwise_identical(tmp_path, corpus, name, nproc, layout):
    checkpoint = {"interval": 4}
    # Step 4's save may be recorded only when step 8's starts (async); eight steps after it leave
    # the random kill below time to land before the run ends.
    train = {"steps": 16, "eval_interval": 4}
    straight = write_config(tmp_path / "a.yaml", corpus, tmp_path / "a", checkpoint=checkpoint, train=train)
    result = torchrun(nproc, straight, *layout)
    assert result.returncode == 0, result.stderr[-4000:]

    config = write_config(tmp_path / "b.yaml", corpus, tmp_path / "b", checkpoint=checkpoint, train=train)
    save_dir = tmp_path / "b" / "checkpoints"
    log = tmp_path / "killed.log"
    proc = start(torchrun_command(nproc, config, *layout), log)
    wait_for(tracker_at(save_dir, 4), proc, log)
    time.sleep(random.uniform(0.0, 1.0))
    kill_tree(proc)
    assert "done." not in log.read_text(), "the run finished before it could be killed"
    latest = files.iteration_of(files.find_latest_complete(save_dir).path)

    resumed = torchrun(nproc, config, *layout)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"at step {latest} (" in resumed.stdout
    assert metric_lines(tmp_path / "b") == metric_lines(tmp_path / "a"), "losses differ after resume"


# Adam amplifies fp32 reduction-order noise across TP sizes; this LR keeps 1e-5 meaningful.
SMALL_LR = {"lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 2}


def test_reshard_on_resume_changes_layout_and_world_size(tmp_path, corpus):
    train = {"steps": 6, "micro_batch_size": 1, "eval_interval": 0}
    base = write_config(
        tmp_path / "base.yaml",
        corpus,
        tmp_path / "base",
        optimizer=SMALL_LR,
        train=train,
        checkpoint={"interval": 3, "optimizer_format": "fully_reshardable"},
    )
    # DP1 here: the interval-save test below moves DP-sharded optimizer state between DP sizes.
    result = torchrun(4, base, "parallel.tensor=2", "parallel.pipeline=2")
    assert result.returncode == 0, result.stderr[-4000:]
    expected = {r["step"]: r["loss"] for r in records(tmp_path / "base") if "loss" in r}

    for name, nproc, layout in [
        ("tp1pp1dp1", 1, []),
        ("tp1pp1dp2", 2, ["checkpoint.fully_parallel_load=true"]),
    ]:
        run_dir = tmp_path / name
        shutil.copytree(
            tmp_path / "base" / "checkpoints" / "iter_0000003", run_dir / "checkpoints" / "iter_0000003"
        )
        config = write_config(tmp_path / f"{name}.yaml", corpus, run_dir, optimizer=SMALL_LR, train=train)
        result = torchrun(nproc, config, *layout)
        assert result.returncode == 0, result.stderr[-4000:]
        assert "resharded from TP2 x PP2 x VPP1 x DP1" in result.stdout
        got = {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}
        assert sorted(got) == [4, 5, 6], "resumed runs continue at the next global sample"
        for step, loss in got.items():
            assert abs(loss - expected[step]) <= 1e-5 * abs(expected[step]), f"{name} step {step}"


def test_interval_saves_resume_at_any_dp_size_and_move_to_another_model_split_by_a_stop_save(
    tmp_path, corpus
):
    """``optimizer_format=auto``: interval saves keep each DP rank's optimizer shard as is
    (dp_reshardable), the end-of-run and stop saves are fully_reshardable."""
    train = {"steps": 6, "micro_batch_size": 1, "eval_interval": 0}
    base = write_config(tmp_path / "base.yaml", corpus, tmp_path / "base", optimizer=SMALL_LR, train=train,
                        checkpoint={"interval": 3})  # fmt: skip
    result = torchrun(2, base)
    assert result.returncode == 0, result.stderr[-4000:]
    save_dir = tmp_path / "base" / "checkpoints"
    commons = [torch.load(files.iteration_dir(save_dir, i) / "common.pt", weights_only=True) for i in (3, 6)]
    formats = [common["optimizer_format"] for common in commons]
    assert formats == ["dp_reshardable", "fully_reshardable"]
    expected = {r["step"]: r["loss"] for r in records(tmp_path / "base") if "loss" in r}

    for name, nproc, layout in [
        ("dp4", 4, ["checkpoint.fully_parallel_load=true"]),
        ("tp2", 2, ["parallel.tensor=2"]),
    ]:
        run_dir = tmp_path / name
        shutil.copytree(files.iteration_dir(save_dir, 3), files.iteration_dir(run_dir / "checkpoints", 3))
        config = write_config(tmp_path / f"{name}.yaml", corpus, run_dir, optimizer=SMALL_LR, train=train)
        resumed = torchrun(nproc, config, *layout)
        if name == "dp4":
            assert resumed.returncode == 0, resumed.stderr[-4000:]
            assert "resharded from TP1 x PP1 x VPP1 x DP2 to TP1 x PP1 x VPP1 x DP4" in resumed.stdout
        else:
            errors = [line for line in resumed.stderr.splitlines() if line.startswith("error:")]
            assert len(errors) == 1, resumed.stderr[-3000:]
            assert "(dp_reshardable), which resumes only at TP1 x PP1 x VPP1 (any DP)" in errors[0]
            assert "[rank" not in resumed.stderr, "a rank printed a traceback"
            assert "exitcode  : 2" in resumed.stderr
            assert not (run_dir / "metrics.jsonl").exists()
            # The way out the error names: the run's next step at its own layout, then a stop save.
            moved = torchrun(2, config, "train.exit_after_minutes=0.001")
            assert "exitcode  : 3" in moved.stderr, moved.stderr[-3000:]
            common = torch.load(
                files.iteration_dir(run_dir / "checkpoints", 4) / "common.pt", weights_only=True
            )
            assert common["optimizer_format"] == "fully_reshardable"
            resumed = torchrun(2, config, *layout)
            assert resumed.returncode == 0, resumed.stderr[-4000:]
        got = {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}
        assert sorted(got) == [4, 5, 6]
        for step, loss in got.items():
            assert abs(loss - expected[step]) <= 1e-5 * abs(expected[step]), f"{name}, step {step}"


def test_a_run_that_keeps_dp_reshardable_saves_is_told_how_to_move_its_checkpoint(tmp_path, corpus):
    """With ``checkpoint.optimizer_format=dp_reshardable`` set, the stop save that the refusal
    advised was dp_reshardable too, and the checkpoint still did not load at the other layout."""
    train = {"steps": 3, "micro_batch_size": 1, "eval_interval": 0}
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run", optimizer=SMALL_LR, train=train,
                          checkpoint={"optimizer_format": "dp_reshardable"})  # fmt: skip
    assert torchrun(2, config).returncode == 0
    refused = torchrun(2, config, "train.steps=6", "parallel.tensor=2")
    [error] = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    # The overrides the error names, followed as written.
    move = re.search(r"run once at that layout with (.+?):", error)[1].split()
    assert "checkpoint.optimizer_format=fully_reshardable" in move, error
    moved = torchrun(2, config, "train.steps=6", *move)
    assert "exitcode  : 3" in moved.stderr, moved.stderr[-3000:]
    resumed = torchrun(2, config, "train.steps=6", "parallel.tensor=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(r["step"] for r in records(tmp_path / "run") if "loss" in r) == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    "workers, saves",
    [(0, {}), (2, {}), (0, {"async_save": False, "interval": 2})],
    ids=["no-workers", "workers", "sync-saves"],
)
def test_sigterm_under_torchrun_saves_the_current_step_and_resume_finishes(tmp_path, corpus, workers, saves):
    """torchrun signals each rank's process group, so all the rank's processes: its loader's
    workers died of it, and the rank's save or shutdown ended in torch's "DataLoader worker ... is
    killed by signal"; the Manager that megatron's writer reported through after a synchronous
    save died of it too, and the stop save failed in a BrokenPipeError traceback."""
    config = write_config(
        tmp_path / "cfg.yaml", corpus, tmp_path / "run", train={"steps": 400, "eval_interval": 0},
        data={"num_workers": workers}, checkpoint=saves,
    )  # fmt: skip
    log = tmp_path / "run.log"
    proc = start(torchrun_command(2, config, "parallel.pipeline=2"), log)
    wait_for(lambda: "step 3/" in log.read_text(), proc, log, poll=0.05)
    proc.send_signal(signal.SIGTERM)  # torchrun forwards it to every rank
    proc.wait(timeout=120)
    text = log.read_text()
    assert "on signal SIGTERM" in text and "stopped early (checkpoint saved)" in text, text[-3000:]
    assert "error on rank" not in text, text[-3000:]
    save_dir = tmp_path / "run" / "checkpoints"
    stopped_at = int((save_dir / files.TRACKER).read_text())
    files.verify(files.iteration_dir(save_dir, stopped_at), checksums=True)

    resumed = torchrun(2, config, "parallel.pipeline=2", "train.steps=" + str(stopped_at + 2))
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"at step {stopped_at} " in resumed.stdout
    assert [r["step"] for r in records(tmp_path / "run")] == list(range(1, stopped_at + 3))


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGHUP], ids=["SIGUSR1", "SIGHUP"])
def test_a_stop_signal_to_the_local_launcher_saves_and_stops_every_rank(tmp_path, corpus, sig):
    """launch/local.sh's launcher passes SIGUSR1 (Slurm's pre-timeout signal) on to the ranks,
    which save and stop; plain torchrun died of it at once and its ranks trained on without it.
    SIGHUP (the terminal or ssh session the launcher ran in closed) killed the ranks unsaved."""
    config = write_config(
        tmp_path / "cfg.yaml", corpus, tmp_path / "run", train={"steps": 400, "eval_interval": 0}
    )
    log = tmp_path / "run.log"
    cmd = torchrun_command(2, config)
    proc = start([sys.executable, "-m", "megatron_train.torchrun", *cmd[3:]], log)
    wait_for(lambda: "step 3/" in log.read_text(), proc, log, poll=0.05)
    proc.send_signal(sig)
    assert proc.wait(timeout=120) == 128 + sig
    text = log.read_text()
    assert f"on signal {sig.name}" in text and "stopped early (checkpoint saved)" in text, text[-3000:]
    save_dir = tmp_path / "run" / "checkpoints"
    files.verify(files.iteration_dir(save_dir, int((save_dir / files.TRACKER).read_text())), checksums=True)


def test_sigterm_to_every_process_of_a_rank_saves_and_stops(tmp_path, corpus):
    """Slurm's cgroup process tracking (scancel) and ``pkill -f megatron_train.train`` signal each
    process, the loader's workers too: torch's worker handler died of a SIGTERM that its rank had not
    sent, and the rank's stop save failed on "a data loader worker process went away"."""
    config = write_config(
        tmp_path / "cfg.yaml", corpus, tmp_path / "run", train={"steps": 400, "eval_interval": 0},
        data={"num_workers": 2},
    )  # fmt: skip
    log = tmp_path / "run.log"
    proc = start(torchrun_command(1, config), log)
    wait_for(lambda: "step 3/" in log.read_text(), proc, log, poll=0.05)
    [rank] = psutil.Process(proc.pid).children()
    for p in [rank, *rank.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    text = log.read_text()
    assert "on signal SIGTERM" in text and "stopped early (checkpoint saved)" in text, text[-3000:]
    assert "error on rank" not in text, text[-3000:]
    save_dir = tmp_path / "run" / "checkpoints"
    files.verify(files.iteration_dir(save_dir, int((save_dir / files.TRACKER).read_text())), checksums=True)


def test_ranks_whose_launcher_is_killed_outright_save_and_stop(tmp_path, corpus):
    """torchrun starts its ranks in sessions of their own: with the launcher killed (kill -9, the
    out-of-memory killer) they trained on unseen, holding the run directory and the devices."""
    config = write_config(
        tmp_path / "cfg.yaml", corpus, tmp_path / "run", train={"steps": 400, "eval_interval": 0}
    )
    log = tmp_path / "run.log"
    proc = start(torchrun_command(2, config, "parallel.pipeline=2"), log)
    wait_for(lambda: "step 3/" in log.read_text(), proc, log, poll=0.05)
    ranks = psutil.Process(proc.pid).children()
    assert len(ranks) == 2
    proc.kill()
    proc.wait()
    _, alive = psutil.wait_procs(ranks, timeout=120)
    assert not alive, log.read_text()[-3000:]
    text = log.read_text()
    assert "on signal SIGTERM" in text and "stopped early (checkpoint saved)" in text, text[-3000:]
    save_dir = tmp_path / "run" / "checkpoints"
    files.verify(files.iteration_dir(save_dir, int((save_dir / files.TRACKER).read_text())), checksums=True)


def test_sigusr1_during_a_long_validation_cuts_it_short_and_saves_the_step(tmp_path, corpus):
    """Slurm's pre-timeout signal in a validation longer than its window: the validation gives
    way, the step is saved and the run stops with code 3; it waited for the whole validation, and
    the scheduler's kill came before the save."""
    config = write_config(
        tmp_path / "cfg.yaml", corpus, tmp_path / "run",
        train={"steps": 4, "eval_interval": 2, "eval_steps": 100000}, logging={"log_interval": 1},
    )  # fmt: skip
    log = tmp_path / "run.log"
    proc = start([sys.executable, "-m", "megatron_train.train", "--config", str(config)], log)
    wait_for(lambda: "validation at step 2 | batch 2/" in log.read_text(), proc, log, poll=0.05)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=120) == EXIT_STOPPED_EARLY, log.read_text()[-3000:]
    text = log.read_text()
    cut = re.search(r"validation at step 2 \| (batch [\d,]+/100,000) \| cut short on signal SIGUSR1", text)
    assert cut, text[-3000:]
    # log_interval 1 makes every batch a progress batch: the one cut short prints that line alone.
    assert text.count(f"validation at step 2 | {cut[1]} |") == 1, text[-3000:]
    assert "stopping after step 2 on signal SIGUSR1" in text, text[-3000:]
    save_dir = tmp_path / "run" / "checkpoints"
    assert (save_dir / files.TRACKER).read_text().strip() == "2"
    files.verify(files.iteration_dir(save_dir, 2), checksums=True)
    assert [r["step"] for r in records(tmp_path / "run")] == [1, 2]


def test_a_second_start_in_a_running_run_is_refused_and_sigusr1_saves_with_code_3(tmp_path, corpus):
    config = write_config(
        tmp_path / "cfg.yaml", corpus, tmp_path / "run",
        train={"steps": 400, "eval_interval": 0}, checkpoint={"interval": 2},
    )  # fmt: skip
    log = tmp_path / "run.log"
    proc = start([sys.executable, "-m", "megatron_train.train", "--config", str(config)], log)
    wait_for(lambda: "checkpoint step 2 complete" in log.read_text(), proc, log, poll=0.05)
    # The same job started again (submitted twice): it would resume from a checkpoint the running
    # one is about to delete and rewrite its metrics.
    second = single_rank(config)
    assert second.returncode == EXIT_BAD_INPUT and second.stderr.splitlines() == [
        f"error: config error at 'logging.run_dir': {(tmp_path / 'run').resolve()} belongs to a training "
        "run that is still going (another process holds its lock). Fix: wait for that run to end or stop "
        "it, or set logging.run_dir to another directory"
    ], second.stderr[-3000:]
    assert "resumed from" not in second.stdout
    proc.send_signal(signal.SIGUSR1)  # what Slurm's --signal delivers to each srun task
    assert proc.wait(timeout=120) == EXIT_STOPPED_EARLY, log.read_text()[-3000:]
    assert "on signal SIGUSR1" in log.read_text()
    stopped_at = int((tmp_path / "run" / "checkpoints" / files.TRACKER).read_text())
    assert [r["step"] for r in records(tmp_path / "run")] == list(range(1, stopped_at + 1))
    assert files.find_latest_complete(tmp_path / "run" / "checkpoints").path is not None


@pytest.mark.parametrize("how", ["removed", "moved"])
def test_a_run_directory_removed_or_moved_while_it_trains_is_saved_anew_and_the_run_stops(
    tmp_path, corpus, how
):
    """A run directory removed (rm -rf by hand, a scratch file system's clean-up) or moved while
    its run trained: the next save failed in a traceback, or wrote alone into a folder made anew
    (which no lock kept a second run out of), and metrics.jsonl went on into the gone folder.
    Rank 0 holds the folders' locks, so it sees that: every rank saves the step and stops (exit
    3), and the same command resumes from the save."""
    run = tmp_path / "run"
    config = write_config(tmp_path / "cfg.yaml", corpus, run, train={"steps": 400, "eval_interval": 0})
    log = tmp_path / "run.log"
    proc = start([sys.executable, "-m", "megatron_train.torchrun", *torchrun_command(2, config)[3:]], log)
    wait_for(lambda: "step 3/" in log.read_text(), proc, log, poll=0.05)
    if how == "removed":
        shutil.rmtree(run)
    else:
        run.rename(tmp_path / "moved")
    assert proc.wait(timeout=120) == EXIT_STOPPED_EARLY, log.read_text()[-3000:]
    text = log.read_text()
    assert f"on {run.resolve()} removed or moved away while the run trained" in text, text[-3000:]
    assert "stopped early (checkpoint saved)" in text and "error" not in text, text[-3000:]
    if how == "moved":
        assert not any((tmp_path / "moved" / "checkpoints").iterdir())
    stopped_at = int((run / "checkpoints" / files.TRACKER).read_text())
    resumed = torchrun(2, config, f"train.steps={stopped_at + 2}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {stopped_at} " in resumed.stdout


def test_a_second_ctrl_c_ends_the_run_at_once_with_one_line_and_code_130(tmp_path, corpus):
    # 32 micro-batches a step: the two signals, 0.1 s apart, arrive within one step, or the
    # second during the save the first asked for; either way nothing waits for that save.
    config = write_config(
        tmp_path / "cfg.yaml", corpus, tmp_path / "run",
        train={"steps": 400, "eval_interval": 0, "global_batch_size": 64}, checkpoint={"interval": 1000},
    )  # fmt: skip
    log = tmp_path / "run.log"
    proc = start([sys.executable, "-m", "megatron_train.train", "--config", str(config)], log)
    wait_for(lambda: "step 2/" in log.read_text(), proc, log, poll=0.02)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text and text.splitlines()[-1] == (
        "error: interrupted before the run saved; a save it had begun is left torn, and the next start "
        "skips it. Fix: run the same command again to resume from the last complete checkpoint"
    ), text[-3000:]
    assert files.find_latest_complete(tmp_path / "run" / "checkpoints").path is None


def test_time_budget_and_minute_interval(tmp_path, corpus):
    config = write_config(
        tmp_path / "cfg.yaml", corpus, tmp_path / "run",
        train={"steps": 5000, "eval_interval": 0, "exit_after_minutes": 0.25},
        checkpoint={"interval_minutes": 0.05, "keep_last": 2},
    )  # fmt: skip
    result = single_rank(config)
    assert result.returncode == EXIT_STOPPED_EARLY, result.stderr[-3000:]
    assert "train.exit_after_minutes=0.25" in result.stdout
    saves = result.stdout.count("save started")
    assert saves >= 3, result.stdout[-3000:]
    assert len(files.checkpoint_dirs(tmp_path / "run" / "checkpoints")) == 2, "keep_last=2"


def test_kill_during_async_save_resumes_from_previous_complete(tmp_path, corpus):
    config = write_config(
        tmp_path / "cfg.yaml", corpus, tmp_path / "run", checkpoint={"interval": 2}, train={"steps": 6}
    )
    save_dir = tmp_path / "run" / "checkpoints"
    log = tmp_path / "run.log"
    proc = start([sys.executable, "-m", "megatron_train.train", "--config", str(config)], log)
    wait_for(lambda: files.iteration_dir(save_dir, 4).is_dir(), proc, log, poll=0.002)
    kill_tree(proc)
    assert not (files.iteration_dir(save_dir, 4) / files.RECORD).exists(), "killed after the save completed"

    resumed = single_rank(config)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "skipping torn checkpoint iter_0000004" in resumed.stdout
    assert "iter_0000002 at step 2" in resumed.stdout
    assert [r["step"] for r in records(tmp_path / "run") if "loss" in r] == [1, 2, 3, 4, 5, 6]


# Run in the training process through sitecustomize: the first process it forks (the first
# save's writer) hangs before running any Python of its own, where CPython before 3.11.10 leaves
# a child forked while another thread held its thread list lock (gh-112275); the second (the
# writer forked again) dies before it starts, as one the out-of-memory killer picks would.
HANG_THEN_KILL_FORKED_CHILDREN = """
import os
import time


def _hang_then_die():
    for marker, act in (({hung!r}, lambda: time.sleep(3600)), ({died!r}, lambda: os._exit(7))):
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        act()
        return


os.register_at_fork(after_in_child=_hang_then_die)
"""


def test_a_writer_stuck_or_dead_after_fork_is_forked_again_and_its_checkpoint_resumes_exactly(
    tmp_path, corpus
):
    hook, hung, died = tmp_path / "hook", tmp_path / "hung-once", tmp_path / "died-once"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        HANG_THEN_KILL_FORKED_CHILDREN.format(hung=str(hung), died=str(died))
    )
    train = {"steps": 4, "eval_interval": 0}
    checkpoint = {"interval": 2}
    config = write_config(tmp_path / "a.yaml", corpus, tmp_path / "a", checkpoint=checkpoint, train=train)
    cmd = [sys.executable, "-m", "megatron_train.train", "--config", str(config)]
    env = {**torchrun_env(), "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert hung.exists() and died.exists(), "the writer was not forked three times"
    assert "rank 0: the checkpoint writer forked for this save did not start within 10 s" in result.stdout
    assert "rank 0: the checkpoint writer forked for this save ended (exit code 7) before it started" in (
        result.stdout
    )
    assert "checkpoint step 2 complete" in result.stdout and "checkpoint step 4 complete" in result.stdout
    save_dir = tmp_path / "a" / "checkpoints"
    files.verify(files.iteration_dir(save_dir, 2), checksums=True)

    # The re-forked writer's checkpoint holds step 2's state: training on from it repeats steps 3-4.
    resumed_dir = tmp_path / "b" / "checkpoints" / "iter_0000002"
    shutil.copytree(files.iteration_dir(save_dir, 2), resumed_dir)
    resumed = single_rank(
        write_config(tmp_path / "b.yaml", corpus, tmp_path / "b", checkpoint=checkpoint, train=train)
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert metric_lines(tmp_path / "b") == metric_lines(tmp_path / "a")[2:]


def test_a_save_the_file_system_refuses_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, trained):
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    save_dir = run / "checkpoints"
    shard = max(p.stat().st_size for p in files.iteration_dir(save_dir, 4).glob("*.distcp"))
    # A per-process file size limit fails the next shard's write as a full disk would (Python
    # ignores SIGXFSZ, so the write returns an error instead of killing the writer).
    limit = shard // 2
    cmd = [sys.executable, "-m", "megatron_train.train", "--config", str(trained["config"]),
           f"logging.run_dir={run}", "train.steps=6"]  # fmt: skip
    result = subprocess.run(
        cmd, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=300,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)),
    )  # fmt: skip
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1, result.stderr[-3000:]
    assert len(errors) == 1 and "checkpoint step 6 could not be written" in errors[0], errors
    assert "iter_0000004 is the newest complete checkpoint" in errors[0]
    assert (save_dir / files.TRACKER).read_text().strip() == "4"
    files.verify(files.iteration_dir(save_dir, 4), checksums=True)


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_results_server_killed_mid_run_fails_the_next_save_in_one_line(tmp_path, corpus, nproc):
    """The small server each rank's checkpoint writers report to, killed (the out-of-memory
    killer, a ``pkill python``): the next save's writer printed a traceback, and the run, meeting
    a BrokenPipeError as it collected the result, took it for its own output's reader gone and
    ended without a word, exit code 141. With two ranks, the last rank's: the launcher named rank
    0, whose line only says that another rank went away, as the rank that failed first."""
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "run", train={"steps": 1000})
    cmd = [*torchrun_command(nproc, config), "checkpoint.interval=4"]
    cmd[:3] = [sys.executable, "-m", "megatron_train.torchrun"]
    log = tmp_path / "log"
    proc = start(cmd, log)
    save_dir = tmp_path / "run" / "checkpoints"
    last = nproc - 1
    try:
        wait_for(tracker_at(save_dir, 4), proc, log)
        rank = next(p for p in psutil.Process(proc.pid).children() if p.environ()["RANK"] == str(last))
        [server] = [p for p in rank.children() if "results_server.py" in " ".join(p.cmdline())]
        server.kill()
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    assert proc.returncode == 1, log.read_text()[-3000:]
    lines = [line for line in log.read_text().splitlines() if line.startswith("error")]
    assert lines[0].startswith(f"error on rank {last}: checkpoint step 8 could not be written to "), lines
    assert (
        f"(rank {last}'s checkpoint results server (pid {server.pid}), which its writer reports to, was "
        "killed; " in lines[0]
    )
    assert (
        "iter_0000004 is the newest complete checkpoint: fix the cause and run the same command to resume"
        in lines[0]
    )
    assert lines[-1] == f"error: rank {last} failed first, with exit code 1; its output is above", lines
    assert "Traceback" not in log.read_text()
    assert (save_dir / files.TRACKER).read_text().strip() == "4"
    files.verify(files.iteration_dir(save_dir, 4), checksums=True)


# Run in the training process through sitecustomize: the first process that the save's writer
# forks to write its files (megatron forks one per bucket) records its pid and kills the writer
# once the writer waits for it. megatron's worker then waits forever for the dead writer to
# acknowledge its "done" (multiprocessing's Condition.notify_all).
KILL_WRITER_UNDER_ITS_WORKER = """
import os
import signal
import time

_TRAINING = os.getpid()


def _kill_the_writer_once():
    if os.getppid() == _TRAINING:
        return
    try:
        fd = os.open({marker!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    time.sleep(1.0)
    os.kill(os.getppid(), signal.SIGKILL)


os.register_at_fork(after_in_child=_kill_the_writer_once)
"""


def test_a_writer_killed_mid_save_is_named_its_workers_end_with_it_and_the_last_checkpoint_stays(
    tmp_path, trained
):
    """An orphaned worker would wait forever, holding the job's output open (a pipe never ends)."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    hook, marker = tmp_path / "hook", tmp_path / "worker-pid"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_WRITER_UNDER_ITS_WORKER.format(marker=str(marker)))
    cmd = [sys.executable, "-m", "megatron_train.train", "--config", str(trained["config"]),
           f"logging.run_dir={run}", "train.steps=6"]  # fmt: skip
    env = {**torchrun_env(), "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    worker = int(marker.read_text())
    try:
        deadline = time.monotonic() + 10
        while _alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(worker), "the writer's worker outlived it"
    finally:
        if _alive(worker):
            os.kill(worker, signal.SIGKILL)
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-3000:]
    assert "checkpoint step 6 could not be written" in errors[0], errors
    assert "rank 0's checkpoint writer process was killed" in errors[0], errors
    save_dir = run / "checkpoints"
    assert (save_dir / files.TRACKER).read_text().strip() == "4"
    files.verify(files.iteration_dir(save_dir, 4), checksums=True)


# Run in the training process through sitecustomize: the first process forked once the save's
# folder exists (its writer, or a worker of the writer) removes that folder, as an ``rm -rf`` by
# hand or a scratch file system's clean-up would while the save writes into it. With {anew}, the
# folder is made again under its name, as megatron's planning of the save makes it when the
# removal lands before that: the rest of the files go there.
REMOVE_THE_FOLDER_WHILE_IT_IS_WRITTEN = """
import os
import shutil


def _remove_the_folder_once():
    folder = {folder!r}
    if os.path.isdir(folder) and not os.path.exists({marker!r}):
        open({marker!r}, "w").close()
        shutil.rmtree(folder)
        if {anew}:
            os.mkdir(folder)


os.register_at_fork(after_in_child=_remove_the_folder_once)
"""


@pytest.mark.parametrize("anew", [False, True], ids=["gone", "made-anew"])
def test_a_checkpoint_folder_removed_while_it_is_saved_fails_the_save_in_one_line(tmp_path, trained, anew):
    """The writes into a folder that was gone failed with a bare "[Errno 2] No such file or
    directory" as the cause; into one made anew, the run recorded what was written there, without
    common.pt, as the complete step 6, exit 0, and the next start failed on it."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    save_dir = run / "checkpoints"
    hook, marker = tmp_path / "hook", tmp_path / "removed"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        REMOVE_THE_FOLDER_WHILE_IT_IS_WRITTEN.format(
            folder=str(files.iteration_dir(save_dir, 6)), marker=str(marker), anew=anew
        )
    )
    cmd = [sys.executable, "-m", "megatron_train.train", "--config", str(trained["config"]),
           f"logging.run_dir={run}", "train.steps=6"]  # fmt: skip
    env = {**torchrun_env(), "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}"}
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert marker.exists(), result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1 and len(errors) == 1, result.stderr[-3000:]
    assert f"checkpoint step 6 could not be written to {files.iteration_dir(save_dir, 6)} (" in errors[0]
    assert (
        f"{files.iteration_dir(save_dir, 6)} removed or moved away while the save wrote into it" in errors[0]
    )
    assert "iter_0000004 is the newest complete checkpoint" in errors[0], errors
    assert (save_dir / files.TRACKER).read_text().strip() == "4"
    assert not (files.iteration_dir(save_dir, 6) / files.RECORD).exists()
    resumed = single_rank(trained["config"], f"logging.run_dir={run}", "train.steps=6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    resumed_from = f"resumed from {files.iteration_dir(save_dir, 4)} at step 4 "
    assert resumed_from in resumed.stdout, resumed.stdout[-3000:]
    files.verify(files.iteration_dir(save_dir, 6), checksums=True)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_truncated_latest_falls_back_in_auto_and_fails_when_explicit(tmp_path, trained):
    save_dir = tmp_path / "checkpoints"
    shutil.copytree(trained["save_dir"], save_dir)
    latest = files.iteration_dir(save_dir, 4)
    victim = max(latest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    os.truncate(victim, victim.stat().st_size // 2)

    inspect = run_tool("tools/inspect_checkpoint.py", str(latest), check=False)
    assert inspect.returncode == 1 and "truncated" in inspect.stdout

    explicit = single_rank(
        trained["config"], f"checkpoint.load={latest}", f"logging.run_dir={tmp_path / 'x'}"
    )
    assert explicit.returncode == EXIT_BAD_INPUT
    assert f"{victim.name} has" in explicit.stderr and "truncated" in explicit.stderr

    # A file under the name of a step the run saves is no save of ours: the save takes its place.
    files.iteration_dir(save_dir, 5).write_text("a stray file")
    auto = single_rank(trained["config"], f"checkpoint.save_dir={save_dir}", "train.steps=5",
                       f"logging.run_dir={tmp_path / 'y'}")  # fmt: skip
    assert auto.returncode == 0, auto.stderr[-3000:]
    assert "skipping torn checkpoint iter_0000004" in auto.stdout and "at step 2 " in auto.stdout
    assert (files.iteration_dir(save_dir, 5) / files.RECORD).is_file()


def test_bad_load_requests_are_clear_errors(tmp_path, trained):
    missing = single_rank(trained["config"], f"checkpoint.load={tmp_path / 'nope'}")
    assert missing.returncode == EXIT_BAD_INPUT and "does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr

    mismatch = single_rank(
        trained["config"], f"checkpoint.load={trained['save_dir']}", "model.ffn_hidden_size=256",
        f"logging.run_dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert mismatch.returncode == EXIT_BAD_INPUT
    assert mismatch.stderr.startswith(
        "error: architecture mismatch: tensor 'decoder.layers.mlp.linear_fc1.weight' has shape "
        "(4, 704, 128) in the checkpoint, (4, 512, 128) in the model; this config changes the model "
        "the checkpoint was saved from (model.ffn_hidden_size: 352 -> 256). Fix: set those back"
    ), mismatch.stderr

    # Taking only the weights names the differing settings too.
    warm = single_rank(
        trained["config"], f"checkpoint.init_from={trained['save_dir']}", "model.num_layers=2",
        "model.num_attention_heads=8", f"logging.run_dir={tmp_path / 'warm'}",
    )  # fmt: skip
    assert warm.returncode == EXIT_BAD_INPUT
    errors = [line for line in warm.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "(model.num_layers: 4 -> 2; model.num_attention_heads: 4 -> 8)" in errors[0]


def test_a_finished_run_started_again_says_so_and_trains_nothing(tmp_path, trained):
    """A requeued job that had finished is done at once, and says why."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    before = (run / "metrics.jsonl").read_text()
    again = single_rank(trained["config"], f"logging.run_dir={run}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "the run has trained all 4 steps: nothing to do (raise train.steps to go on)" in again.stdout
    assert "step 5" not in again.stdout and (run / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in (run / "checkpoints").glob("iter_*")) == ["iter_0000002", "iter_0000004"]


def test_a_resume_that_changes_batch_and_sequence_counts_tokens_on_and_keeps_the_lr_in_steps(
    tmp_path, trained
):
    """A resumed run may change the batch (as a batch-size ramp does) and the sequence length; the
    token count goes on from the checkpoint's own, not from step x tokens per step, and the
    learning rate follows the schedule's steps. Before, megatron's scheduler counted samples at
    the new batch size: the decay would have ended at step 10 (96 samples), not at train.steps=6."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    result = single_rank(
        trained["config"], f"logging.run_dir={run}", "train.steps=6", "train.global_batch_size=16",
        "data.seq_length=48",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(32 samples, 2,048 tokens consumed;" in result.stdout
    tokens = {r["step"]: r["consumed_tokens"] for r in records(run) if "consumed_tokens" in r}
    assert tokens[4] == 4 * 8 * 64 and tokens[5] == tokens[4] + 16 * 48 and tokens[6] == tokens[5] + 16 * 48
    lrs = {r["step"]: r["lr"] for r in records(run) if "lr" in r}
    # warmup 2, cosine to step 6: step 5 is three quarters of the way
    assert lrs[5] == pytest.approx(3e-5 + (1e-3 - 3e-5) * 0.5 * (1 + math.cos(math.pi * 3 / 4)), rel=1e-6)
    assert lrs[6] == pytest.approx(3e-5, rel=1e-6), lrs
    # A checkpoint written before tokens were counted: its samples at its own sequence length.
    assert Progress.saved({"iteration": 4, "consumed_samples": 32}, 64) == Progress(4, 32, 0, 2048)


def test_a_resume_trains_with_the_optimizer_settings_its_config_changed(tmp_path, trained):
    """optimizer.lr, min_lr, adam_beta2 and adam_eps changed on resume take effect. Before, the
    loaded param groups kept the checkpoint's, megatron's scheduler decayed between their max_lr
    and min_lr, and the new checkpoint's config named settings the run had not trained with."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    changed = [
        "optimizer.lr=2e-3",
        "optimizer.min_lr=2e-4",
        "optimizer.adam_beta2=0.9",
        "optimizer.adam_eps=1e-6",
    ]
    result = single_rank(trained["config"], f"logging.run_dir={run}", "train.steps=6", *changed)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "changed since that checkpoint: optimizer.lr: 0.001 -> 0.002; optimizer.min_lr:" in result.stdout
    lrs = {r["step"]: r["lr"] for r in records(run) if "lr" in r}

    def cosine(step: int, warmup: int = 2, steps: int = 6) -> float:
        return 2e-4 + (2e-3 - 2e-4) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))

    assert lrs[5] == pytest.approx(cosine(5), rel=1e-6) and lrs[6] == pytest.approx(2e-4, rel=1e-6), lrs
    saved = torch.load(run / "checkpoints" / "iter_0000006" / "common.pt", weights_only=False)
    for group in saved["optimizer"]["optimizer"]["param_groups"]:
        assert (group["max_lr"], group["min_lr"], group["betas"], group["eps"]) == (
            2e-3,
            2e-4,
            (0.9, 0.9),
            1e-6,
        )


def test_a_resume_that_lowers_the_batch_reads_on_past_the_new_batches_times_the_steps(tmp_path, corpus):
    """4 steps of 16 samples, then resumed to step 12 with batches of 4: the run reads 64 + 8 x 4
    = 96 samples. The dataset was sized for train.steps x the new batch (48, fewer than were already
    read), and a small dataset ran out mid-run: a StopIteration traceback from the data loader."""
    docs = [line for line in corpus["jsonl"].read_text().splitlines() if len(line) > 2000][:3]
    (tmp_path / "small.jsonl").write_text("\n".join(docs) + "\n")
    run_tool(
        "tools/preprocess_data.py", "--input", str(tmp_path / "small.jsonl"), "--output-prefix",
        str(tmp_path / "small"), "--tokenizer", str(corpus["tokenizer"]),
    )  # fmt: skip
    run = tmp_path / "run"
    config = write_config(
        tmp_path / "cfg.yaml", corpus, run, data={"blend": [str(tmp_path / "small")], "split": "100,0,0"},
        train={"steps": 4, "global_batch_size": 16, "eval_interval": 0},
    )  # fmt: skip
    first = single_rank(config)
    assert first.returncode == 0, first.stderr[-3000:]
    samples = int(re.search(r"([\d,]+) training samples", first.stdout).group(1).replace(",", ""))
    assert 64 <= samples < 96, "the dataset covers the first run, not the whole one"
    resumed = single_rank(config, "train.steps=12", "train.global_batch_size=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in records(run) if "loss" in r][-1] == 12


@pytest.mark.parametrize("decay_steps", [None, 4])
def test_a_resume_that_extends_the_run_keeps_the_decay_end_it_is_given(tmp_path, trained, decay_steps):
    """train.steps 4 -> 8 on resume: optimizer.decay_steps=4 (the first run's end) keeps its
    schedule, every further step at min_lr; without it the cosine stretches to step 8 and a line
    says so, naming the setting that keeps the old end."""
    run = tmp_path / "run"
    shutil.copytree(trained["run"], run)
    extra = [f"optimizer.decay_steps={decay_steps}"] if decay_steps else []
    result = single_rank(trained["config"], f"logging.run_dir={run}", "train.steps=8", *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    lrs = {r["step"]: r["lr"] for r in records(run) if "lr" in r}
    note = "the learning-rate decay now ends at step 8, not 4, so the lr from here on follows the new "
    if decay_steps:
        assert [lrs[step] for step in range(5, 9)] == pytest.approx([3e-5] * 4, rel=1e-6), lrs
        assert note not in result.stdout
    else:
        # warmup 2, decay to step 8: at step 5, half way, cos(pi / 2) = 0
        assert lrs[5] == pytest.approx(3e-5 + (1e-3 - 3e-5) * 0.5, rel=1e-6), lrs
        assert (
            note + "schedule; set optimizer.decay_steps=4 to keep the schedule it was following"
            in result.stdout
        )


def test_finetune_loads_weights_only(tmp_path, trained):
    result = single_rank(
        trained["config"], f"checkpoint.load={trained['save_dir']}", "checkpoint.finetune=true",
        f"logging.run_dir={tmp_path / 'ft'}", "train.steps=3", "optimizer.warmup_steps=1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fine-tuning from the weights of" in result.stdout
    fresh_first = records(trained["run"])[0]["loss"]
    tuned = [r for r in records(tmp_path / "ft") if "loss" in r]
    assert tuned[0]["step"] == 1 and tuned[0]["loss"] < fresh_first - 0.05


def test_checkpoint_contents_are_plain_and_inspectable(trained):
    latest = files.iteration_dir(trained["save_dir"], 4)
    common = torch.load(latest / "common.pt", weights_only=True)
    progress = {"iteration": 4, "consumed_samples": 32, "skipped_steps": 0, "consumed_tokens": 32 * 64}
    assert common["progress"] == progress
    assert (trained["save_dir"] / files.TRACKER).read_text() == "4\n"
    record = files.verify(latest, checksums=True)
    assert {"common.pt", "metadata.json", ".metadata"} <= set(record["files"])

    result = run_tool("tools/inspect_checkpoint.py", str(trained["save_dir"]), "--verify-checksums")
    assert "iteration:   4 of 4" in result.stdout and "SHA-256 verified" in result.stdout
    assert "embedding.word_embeddings.weight" in result.stdout
    assert "optimizer.state.exp_avg_sq.decoder.final_layernorm.weight" in result.stdout
