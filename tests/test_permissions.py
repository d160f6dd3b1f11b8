"""Files this user may not read or write (another user's checkpoint, a shared folder without the
group's access): one line naming the path, exit code 2, nothing touched, and never taken for a
damaged checkpoint.

As root (CI's containers), each command runs without the capabilities that let root read and
write any file (``setpriv`` drops them from its bounding set), so that a file's mode holds for it
as for any other user. A forked child that gave up root instead could deadlock on a lock another
thread of the test process held, and an unprivileged user may not reach an interpreter in
root's home."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, single_rank, write_config

_AS_ANY_USER = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []


def _without_root_access(*argv: str) -> subprocess.CompletedProcess:
    """``python argv`` from the repo root, for which file modes hold even when this runs as root."""
    return subprocess.run(
        [*_AS_ANY_USER, sys.executable, *argv],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _hashes(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def _one_line(result: subprocess.CompletedProcess, says: str) -> None:
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert says in errors[0], errors[0]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, corpus) -> Path:
    """A run with checkpoints at steps 2 and 4, its corpus beside it."""
    ws = tmp_path_factory.mktemp("permissions")
    shutil.copytree(corpus["prefix"].parent, ws / "corpus")
    local = {"prefix": ws / "corpus" / "stdlib", "tokenizer": ws / "corpus" / "spm.model"}
    config = write_config(ws / "cfg.yaml", local, ws / "run", checkpoint={"interval": 2}, train={"steps": 4})
    result = single_rank(config)
    assert result.returncode == 0, result.stderr[-4000:]
    return ws


@pytest.mark.parametrize("name", ["complete.json", "common.pt"])
def test_a_resume_from_a_checkpoint_this_user_may_not_read_stops_and_passes_nothing_over(workspace, name):
    """The checkpoint is whole: resuming from the one before it would repeat steps and, by
    rotation, could remove it (an unreadable complete.json was passed over as torn, then removed)."""
    unreadable = workspace / "run" / "checkpoints" / "iter_0000004" / name
    before = _hashes(workspace)
    unreadable.chmod(0)
    try:
        result = _without_root_access(
            "-m", "megatron_train.train", "--config", str(workspace / "cfg.yaml"), "train.steps=6"
        )
    finally:
        unreadable.chmod(0o644)
    _one_line(result, f"iter_0000004/{name}' may not be used by this user (Permission denied)")
    assert "skipping" not in result.stdout
    assert _hashes(workspace) == before


def test_a_tokenizer_this_user_may_not_read_is_named_as_such_not_as_one_that_does_not_load(workspace):
    tokenizer = workspace / "corpus" / "spm.model"
    before = _hashes(workspace)
    tokenizer.chmod(0)
    try:
        result = _without_root_access(
            "tools/preprocess_data.py", "--input", str(workspace / "corpus" / "stdlib.jsonl"),
            "--tokenizer", str(tokenizer), "--output-prefix", str(workspace / "out"),
        )  # fmt: skip
    finally:
        tokenizer.chmod(0o644)
    _one_line(result, "spm.model' may not be used by this user (Permission denied)")
    assert _hashes(workspace) == before


def test_a_folder_below_a_corpus_directory_that_cannot_be_read_is_refused_not_skipped(workspace, tmp_path):
    """Path.rglob passed over it without a word: the dataset lacked its documents."""
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.jsonl").write_text('{"text": "one"}\n')
    (corpus / "sub" / "b.jsonl").write_text('{"text": "two"}\n')
    (corpus / "sub").chmod(0)
    try:
        result = _without_root_access(
            "tools/preprocess_data.py", "--input", str(corpus),
            "--tokenizer", str(workspace / "corpus" / "spm.model"), "--output-prefix", str(tmp_path / "out"),
        )  # fmt: skip
    finally:
        (corpus / "sub").chmod(0o755)
    _one_line(result, f"{corpus / 'sub'} below {corpus} could not be read (Permission denied)")
    assert not list(tmp_path.glob("out*"))
