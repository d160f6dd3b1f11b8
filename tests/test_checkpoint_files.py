"""The checkpoint directory format: completion records, integrity, retention, safe unpickling."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint import FileSystemReader

from megatron_train.checkpoint import files
from megatron_train.checkpoint.files import CheckpointError
from megatron_train.checkpoint.safe_load import UnsafeCheckpointError, safe_unpickling
from megatron_train.errors import ConfigError
from tests.conftest import ROOT, torchrun_env


def make_checkpoint(save_dir: Path, iteration: int, complete: bool = True) -> Path:
    path = files.iteration_dir(save_dir, iteration)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(os.urandom(4096))
    (path / "common.pt").write_bytes(b"x" * 100)
    if complete:
        files.write_completion_record(path, iteration, checksums=True, extra={})
    return path


def test_record_lists_every_file_with_size_and_checksum(tmp_path):
    path = make_checkpoint(tmp_path, 100)
    record = files.verify(path, checksums=True)
    assert path.name == "iter_0000100" and record["iteration"] == 100
    assert record["files"]["__0_0.distcp"]["size"] == 4096
    assert len(record["files"]["common.pt"]["sha256"]) == 64
    assert not list(tmp_path.rglob(".*tmp*")), "atomic writes leave no temp files"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / files.RECORD).unlink(), "torn checkpoint"),
        (lambda p: (p / "__0_0.distcp").unlink(), "__0_0.distcp listed in complete.json is missing"),
        (lambda p: os.truncate(p / "__0_0.distcp", 1000), "has 1000 bytes, complete.json says 4096"),
        (lambda p: (p / files.RECORD).write_text("{"), "unreadable"),
    ],
    ids=["no-record", "deleted-file", "truncated-file", "garbled-record"],
)
def test_damaged_checkpoints_are_reported(tmp_path, damage, message):
    path = make_checkpoint(tmp_path, 5)
    damage(path)
    with pytest.raises(CheckpointError, match=message):
        files.verify(path)


def test_checksums_catch_same_size_corruption_only_when_asked(tmp_path):
    path = make_checkpoint(tmp_path, 5)
    data = bytearray((path / "__0_0.distcp").read_bytes())
    data[10] ^= 0xFF
    (path / "__0_0.distcp").write_bytes(bytes(data))
    files.verify(path)
    with pytest.raises(CheckpointError, match="fails its SHA-256 check"):
        files.verify(path, checksums=True)


def test_auto_resume_skips_a_torn_latest(tmp_path):
    make_checkpoint(tmp_path, 10)
    torn = make_checkpoint(tmp_path, 20)
    os.truncate(torn / "common.pt", 3)
    make_checkpoint(tmp_path, 30, complete=False)
    point = files.find_latest_complete(tmp_path)
    assert point.path == files.iteration_dir(tmp_path, 10)
    assert [p.name for p, _ in point.skipped] == ["iter_0000030", "iter_0000020"]
    assert files.find_latest_complete(tmp_path / "missing").path is None


def test_auto_resume_starts_fresh_only_over_saves_that_never_finished(tmp_path):
    """A checkpoint with its record was complete once: damaged since, it may be restored, and a
    fresh start would write over it; one saved without checksums is complete, not torn."""
    make_checkpoint(tmp_path, 10, complete=False)
    assert files.resolve_load("auto", tmp_path).notes[-1].endswith("starting fresh")
    damaged = make_checkpoint(tmp_path, 20)
    (damaged / "common.pt").unlink()
    with pytest.raises(ConfigError, match="iter_0000020 was complete when it was saved") as err:
        files.resolve_load("auto", tmp_path)
    assert err.value.key == "checkpoint.load"
    shutil.rmtree(damaged)
    make_checkpoint(tmp_path, 30)
    without = make_checkpoint(tmp_path, 40)
    files.write_completion_record(without, 40, checksums=False, extra={})
    assert files.resolve_load("auto", tmp_path).path == without
    for load in ("auto", str(without)):
        with pytest.raises(ConfigError, match="iter_0000040 was saved without checksums") as err:
            files.resolve_load(load, tmp_path, checksums=True)
        assert err.value.key == "checkpoint.verify_checksums"


@pytest.mark.parametrize("tracker", ["garbage\n", "99\n", "", "-1"])
def test_a_malformed_or_stale_tracker_is_never_trusted(tmp_path, tracker):
    """Resume scans the iter_* directories and verifies each record; the tracker (kept for tools
    that expect Megatron-LM's layout) decides nothing, so a damaged one cannot mislead a resume."""
    make_checkpoint(tmp_path, 10)
    make_checkpoint(tmp_path, 20, complete=False)
    (tmp_path / files.TRACKER).write_text(tracker)
    decision = files.resolve_load("auto", tmp_path)
    assert decision.path == files.iteration_dir(tmp_path, 10)


def test_explicit_paths_must_be_complete(tmp_path):
    good = make_checkpoint(tmp_path, 10)
    assert files.resolve_explicit(good) == good
    assert files.resolve_explicit(tmp_path) == good
    torn = make_checkpoint(tmp_path, 20, complete=False)
    for asked in (tmp_path, torn):
        with pytest.raises(CheckpointError, match="torn") as err:
            files.resolve_explicit(asked)
        assert str(err.value).endswith(
            f"give a complete checkpoint instead (the newest complete one beside it is {good})"
        )
    (tmp_path / "alone").mkdir()
    torn.rename(tmp_path / "alone" / torn.name)
    with pytest.raises(CheckpointError, match="torn checkpoint[)]; give a complete checkpoint instead$"):
        files.resolve_explicit(tmp_path / "alone")
    with pytest.raises(CheckpointError, match="does not exist: give a checkpoint"):
        files.resolve_explicit(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no checkpoint: give a checkpoint"):
        files.resolve_explicit(tmp_path / "empty")


# What a training run holds on its save dir while it runs (run_lock), from a process of its own.
_RUN_HOLDS = (
    "import fcntl, os, sys, time; fcntl.flock(os.open(sys.argv[1], os.O_RDONLY), fcntl.LOCK_EX); "
    "print('held', flush=True); time.sleep(120)"
)


def test_a_tool_reads_a_running_runs_newest_complete_checkpoint_and_keeps_it_from_retention(tmp_path):
    """Export, generate and inspect of a run that was training refused the checkpoint it was
    saving as torn, and retention deleted the one they read while they read it."""
    make_checkpoint(tmp_path, 10)
    newest = make_checkpoint(tmp_path, 20)
    saving = make_checkpoint(tmp_path, 30, complete=False)
    notes = []
    with pytest.raises(CheckpointError, match="torn"):  # no run holds the folder: torn, as before
        files.resolve_explicit(tmp_path, being_saved=notes.append)
    run = subprocess.Popen(
        [sys.executable, "-c", _RUN_HOLDS, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert run.stdout.readline() == "held\n"
        assert files.resolve_explicit(tmp_path, being_saved=notes.append) == newest
        assert notes == [
            f"iter_0000030 is being saved by a run still going in {tmp_path}; reading iter_0000020, its "
            "newest complete checkpoint"
        ]
        # A checkpoint named itself, and training's own explicit load, stay as strict as before.
        for asked, told in ((saving, notes.append), (tmp_path, None)):
            with pytest.raises(CheckpointError, match="torn"):
                files.resolve_explicit(asked, being_saved=told)
    finally:
        run.kill()
        run.wait()
    # The save completes and the next one too; retention keeps the checkpoint this process reads.
    files.write_completion_record(saving, 30, checksums=False, extra={})
    make_checkpoint(tmp_path, 40)
    removed = files.apply_retention(tmp_path, keep_last=1, keep_every=0)
    assert [p.name for p in removed] == ["iter_0000030", "iter_0000010"]
    assert files.verify(newest)["iteration"] == 20


def test_a_rollback_beside_newer_checkpoints_is_refused_until_they_are_moved_out(tmp_path):
    """The rolled-back run's saves would replace the newer checkpoints one at a time, and a
    requeued job's load=auto would continue the newest, leaving the rollback behind."""
    older, newest = make_checkpoint(tmp_path, 10), make_checkpoint(tmp_path, 20)
    make_checkpoint(tmp_path, 30, complete=False)  # a torn one: the newest save replaces it
    assert files.resolve_load(str(newest), tmp_path).path == newest
    with pytest.raises(ConfigError, match="iter_0000010 is older than iter_0000020") as err:
        files.resolve_load(str(older), tmp_path)
    assert err.value.key == "checkpoint.load"
    shutil.copytree(older, tmp_path / "best")  # a copy under a name of its own: its record's step
    with pytest.raises(ConfigError, match="best is older than iter_0000020"):
        files.resolve_load(str(tmp_path / "best"), tmp_path)
    newest.rename(tmp_path.parent / "set-aside")
    assert files.resolve_load(str(older), tmp_path).path == older
    assert files.resolve_load("auto", tmp_path).path == older


def test_a_run_directory_names_the_checkpoints_in_its_default_save_dir(tmp_path):
    save_dir = tmp_path / "run" / "checkpoints"
    save_dir.mkdir(parents=True)
    good = make_checkpoint(save_dir, 10)
    assert files.resolve_explicit(tmp_path / "run") == good


@pytest.mark.parametrize(
    "recorded",
    ["with\0nul", "x" * 300, "/".join(["x"] * 3000), "config.yaml/under-a-file"],
    ids=["nul", "name-too-long", "path-too-long", "under-a-file"],
)
def test_a_fresh_start_over_a_run_whose_config_names_a_save_dir_that_cannot_exist(tmp_path, recorded):
    """A damaged config.yaml of an earlier run (it crashed before its first save) names a save dir
    no folder can have: that run holds no checkpoints, so a fresh start goes on (it raised a
    ValueError on the NUL, and blamed this start's config for the long paths)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recorded = recorded.replace("config.yaml/", f"{run_dir}/config.yaml/")
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"checkpoint": {"save_dir": recorded}}))
    (run_dir / "metrics.jsonl").touch()
    assert files.resolve_load("auto", run_dir / "checkpoints", run_dir=run_dir).path is None


def test_tracker_update_overwrites_and_leaves_no_temp_files(tmp_path):
    files.update_tracker(tmp_path, 7)
    files.update_tracker(tmp_path, 8)
    assert (tmp_path / files.TRACKER).read_text() == "8\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [files.TRACKER]


def test_retention_keeps_last_k_and_every_mth():
    assert files.to_delete([2, 4, 6, 8, 10], keep_last=2, keep_every=4) == [6, 2]
    assert files.to_delete([2, 4, 6], keep_last=0, keep_every=0) == []
    assert files.to_delete([6], keep_last=1, keep_every=0) == []


def test_retention_deletes_only_after_a_newer_complete_one(tmp_path):
    for step in (2, 4, 6):
        make_checkpoint(tmp_path, step)
    make_checkpoint(tmp_path, 3, complete=False)
    make_checkpoint(tmp_path, 8, complete=False)  # a save still being written
    removed = files.apply_retention(tmp_path, keep_last=1, keep_every=4)
    assert sorted(p.name for p in removed) == ["iter_0000002", "iter_0000003"]
    assert [p.name for p in files.checkpoint_dirs(tmp_path)] == [
        "iter_0000008",
        "iter_0000006",
        "iter_0000004",
    ]


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch pwned",))


def test_malicious_metadata_pickle_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    with safe_unpickling():
        assert "w" in FileSystemReader(tmp_path / "ckpt").read_metadata().state_dict_metadata
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(_Payload()))
    with safe_unpickling(), pytest.raises(UnsafeCheckpointError, match="posix.system"):
        FileSystemReader(tmp_path / "ckpt").read_metadata()
    assert not (tmp_path / "pwned").exists()


def test_torch_load_is_weights_only_inside_safe_unpickling(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.save({"ok": torch.ones(2)}, tmp_path / "good.pt")
    (tmp_path / "bad.pt").write_bytes(pickle.dumps(_Payload()))
    with safe_unpickling():
        assert torch.load(tmp_path / "good.pt")["ok"].sum() == 2
        with pytest.raises(UnsafeCheckpointError, match="unpickler refused it: Unsupported") as err:
            torch.load(tmp_path / "bad.pt", weights_only=False)
        assert "weights_only=False" not in str(err.value) and "will likely succeed" not in str(err.value)
    assert not (tmp_path / "pwned").exists()


def test_parallel_load_auto_shares_the_reading_only_across_nodes():
    # Ranks of one node share its page cache; ranks on two nodes would each read every byte.
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "tests/helpers/parallel_load_worker.py", "n1,n1", "n1,n2"]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=torchrun_env(), capture_output=True, text=True, timeout=99)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        "n1,n1 auto -> False", "n1,n1 True -> True", "n1,n1 False -> False",
        "n1,n2 auto -> True", "n1,n2 True -> True", "n1,n2 False -> False",
    ]  # fmt: skip
