"""Files this user may not read or write (another user's checkpoint, a shared folder without the
group's access): one line naming the path, exit code 2, nothing touched, and never taken for a
damaged checkpoint. As root (CI's containers), the commands run as user nobody, for whom
permissions hold, in a workspace outside pytest's folders (those are root's alone)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, write_config

NOBODY = 65534


def _as_another_user(ws: Path, *argv: str) -> subprocess.CompletedProcess:
    as_root = os.geteuid() == 0
    return subprocess.run(
        [sys.executable, *argv],
        cwd=ws,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HOME": str(ws)},
        capture_output=True,
        text=True,
        timeout=300,
        **({"user": NOBODY, "group": NOBODY, "extra_groups": []} if as_root else {}),
    )


def _hashes(folder: Path) -> dict[str, str]:
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            found[str(path.relative_to(folder))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def _one_line(result: subprocess.CompletedProcess, says: str) -> None:
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert says in errors[0], errors[0]


@pytest.fixture(scope="module")
def workspace(corpus) -> Iterator[Path]:
    """A run with checkpoints at steps 2 and 4, its corpus beside it, owned by the user the
    commands run as."""
    ws = Path(tempfile.mkdtemp(prefix="permissions-"))
    ws.chmod(0o755)
    shutil.copytree(corpus["prefix"].parent, ws / "corpus")
    local = {"prefix": ws / "corpus" / "stdlib", "tokenizer": ws / "corpus" / "spm.model"}
    write_config(ws / "cfg.yaml", local, ws / "run", checkpoint={"interval": 2}, train={"steps": 4})
    if os.geteuid() == 0:
        for path in [ws, *ws.rglob("*")]:
            os.chown(path, NOBODY, NOBODY)
    result = _as_another_user(ws, "-m", "megatron_train.train", "--config", "cfg.yaml")
    assert result.returncode == 0, result.stderr[-4000:]
    yield ws
    shutil.rmtree(ws)


def test_a_resume_from_a_checkpoint_this_user_may_not_read_stops_and_passes_nothing_over(workspace):
    """The checkpoint is whole: resuming from the one before it would repeat steps and, by
    rotation, could remove it."""
    unreadable = workspace / "run" / "checkpoints" / "iter_0000004" / "common.pt"
    before = _hashes(workspace)
    unreadable.chmod(0)
    try:
        result = _as_another_user(
            workspace, "-m", "megatron_train.train", "--config", "cfg.yaml", "train.steps=6"
        )
    finally:
        unreadable.chmod(0o644)
    after = _hashes(workspace)
    _one_line(result, f"'{unreadable}' may not be used by this user (Permission denied)")
    assert "skipping" not in result.stdout
    assert after == before


def test_a_tokenizer_this_user_may_not_read_is_named_as_such_not_as_one_that_does_not_load(workspace):
    tokenizer = workspace / "corpus" / "spm.model"
    before = _hashes(workspace)
    tokenizer.chmod(0)
    try:
        result = _as_another_user(
            workspace, str(ROOT / "tools/preprocess_data.py"),
            "--input", str(workspace / "corpus" / "stdlib.jsonl"),
            "--tokenizer", str(tokenizer), "--output-prefix", str(workspace / "out"),
        )  # fmt: skip
    finally:
        tokenizer.chmod(0o644)
    _one_line(result, f"'{tokenizer}' may not be used by this user (Permission denied)")
    assert _hashes(workspace) == before
