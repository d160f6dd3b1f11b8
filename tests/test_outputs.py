"""Outputs appear whole, and once: a dataset written by one process at a time, a finished output
never replaced by another process's."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from megatron_train import outputs, run_lock
from megatron_train.errors import ConfigError, Failure
from megatron_train.outputs import dataset_files, discard_partial_dataset, made_dir, publish
from megatron_train.token_writer import TokenWriter
from tests.conftest import load_tool


def test_a_dataset_is_written_by_one_process_at_a_time_and_never_over_a_finished_one(tmp_path):
    """The same command started twice wrote both runs' tokens into one temporary file, and the
    second ended in a traceback when the first had renamed it."""
    prefix = tmp_path / "d"
    with dataset_files(prefix, "--output-prefix") as (tmp_bin, tmp_idx):
        tmp_bin.write_bytes(b"first")
        # Another open file of the same path, as another process would have: the lock is per open.
        with pytest.raises(ConfigError, match="being written by another process now"):
            with dataset_files(prefix, "--output-prefix"):
                pass
        assert tmp_bin.read_bytes() == b"first"
        tmp_idx.write_bytes(b"index")
    assert (tmp_path / "d.bin").read_bytes() == b"first"
    with pytest.raises(ConfigError, match="written by another process meanwhile"):
        with dataset_files(prefix, "--output-prefix"):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]


def test_partial_files_are_discarded_unless_another_process_writes_them(tmp_path):
    prefix = tmp_path / "d"
    (tmp_path / "d.bin.tmp").write_bytes(b"left by a killed writer")
    (tmp_path / "d.idx.tmp").write_bytes(b"")
    discard_partial_dataset(prefix)
    assert not list(tmp_path.iterdir())
    with dataset_files(prefix, "--output-dir") as (tmp_bin, tmp_idx):
        tmp_bin.write_bytes(b"being written")
        discard_partial_dataset(prefix)
        assert tmp_bin.read_bytes() == b"being written"
        tmp_idx.write_bytes(b"index")


def test_an_output_another_process_finished_meanwhile_is_kept(tmp_path):
    """The same conversion or tokenizer training started twice: the second's rename replaced the
    first's model (or failed with a traceback on its non-empty folder)."""
    (tmp_path / "a.tmp").write_text("this run's")
    (tmp_path / "b.tmp").write_text("this run's")
    (tmp_path / "b").write_text("the other run's")
    with pytest.raises(ConfigError, match="b was written by another process meanwhile"):
        publish([(tmp_path / "a.tmp", tmp_path / "a"), (tmp_path / "b.tmp", tmp_path / "b")], "--out")
    # Neither of this run's is published where the other's is.
    assert not (tmp_path / "a").exists() and (tmp_path / "b").read_text() == "the other run's"
    publish([(tmp_path / "a.tmp", tmp_path / "a")], "--out")
    assert (tmp_path / "a").read_text() == "this run's"


def _take_away(folder: Path, how: str) -> None:
    if how == "removed":
        shutil.rmtree(folder)
    else:
        folder.rename(folder.with_name(folder.name + "-moved"))


@pytest.mark.parametrize("how", ["removed", "moved"])
def test_an_output_folder_taken_away_while_it_is_written_is_said_so(tmp_path, how):
    """A dataset's folder removed (by hand, a scratch file system's clean-up) or moved while the
    dataset was written: the next write failed with the traceback of its "No such file or
    directory", which names a temporary file of the folder and not what happened to it."""
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(Failure, match=f"^{out} was removed or moved away while the output was written"):
        with dataset_files(out / "d", "--output-prefix") as (tmp_bin, tmp_idx):
            tmp_bin.write_bytes(b"tokens")
            _take_away(out, how)
            tmp_idx.write_bytes(b"index")
    # made_dir, which the other tools write their outputs under, likewise, whatever error the
    # writer made of it: SentencePiece's blamed --vocab-size.
    models = tmp_path / "models"
    with pytest.raises(Failure, match=f"^{models} was removed or moved away"):
        with made_dir(models):
            _take_away(models, how)
            raise ConfigError("--vocab-size", "SentencePiece refused to train: NOT_FOUND", "change it")
    # A file of its own missing, in the folder still in place, is not taken for that.
    with pytest.raises(FileNotFoundError):
        with made_dir(tmp_path / "kept"):
            (tmp_path / "kept" / "no-such-folder" / "f").write_bytes(b"")


def test_the_tokenizing_tool_says_its_output_folder_was_removed_in_one_line(
    tmp_path, corpus, monkeypatch, capfd
):
    out = tmp_path / "out"
    write_index = TokenWriter.write_index

    def removed_first(self, idx_path: Path) -> None:
        shutil.rmtree(out)
        write_index(self, idx_path)

    monkeypatch.setattr(TokenWriter, "write_index", removed_first)
    code = load_tool("tools/preprocess_data.py").main(
        ["--input", str(corpus["jsonl"]), "--output-prefix", str(out / "d"),
         "--tokenizer", str(corpus["tokenizer"]), "--workers", "1"]
    )  # fmt: skip
    err = capfd.readouterr().err
    assert code == 1, err[-3000:]
    assert [line for line in err.splitlines() if line.startswith(("error", "Traceback"))] == [
        f"error: {out} was removed or moved away while the output was written into it, so the output is "
        "not there. Fix: run it again, with the folder left in place"
    ], err[-3000:]
    assert not out.exists()


@pytest.mark.parametrize("taken_by", ["main-thread", "another-thread"])
def test_a_ctrl_c_as_the_temporary_file_is_made_leaves_no_file(tmp_path, monkeypatch, taken_by):
    """A stop just after the claim made the file, before the writer's clean-up was in place, left
    it behind (a CI flake): the stop waits until the clean-up is there. The kernel gives a signal
    sent to the process to any of its threads that takes it: one taken by another thread (pyarrow
    and the tokenizers start native ones) runs Python's handler in the main thread all the same,
    and that left the file behind where the main thread alone had blocked the signal (a CI flake
    of preprocess_data's Ctrl-C test)."""
    open_locked = run_lock.open_locked
    other = threading.Event()
    taker = threading.Thread(target=other.wait)
    taker.start()

    def then_ctrl_c(*args, **kwargs):
        fd = open_locked(*args, **kwargs)
        if taken_by == "main-thread":
            signal.raise_signal(signal.SIGINT)
        else:
            signal.pthread_kill(taker.ident, signal.SIGINT)
            time.sleep(0.2)  # for the other thread to take it
        return fd

    monkeypatch.setattr(outputs.run_lock, "open_locked", then_ctrl_c)
    # Ctrl-C raises as it does in a terminal: a test run started in the background (CI's) inherits
    # SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            with dataset_files(tmp_path / "d", "--output-prefix"):
                pytest.fail("the stop came after the claim")
    finally:
        signal.signal(signal.SIGINT, previous)
        other.set()
        taker.join()
    assert list(tmp_path.iterdir()) == []
