"""Files this user may not read or write (another user's checkpoint, a shared folder without the
group's access): one line naming the path, exit code 2, nothing touched, and never taken for a
damaged checkpoint.

As root (CI's containers), each command runs as user nobody, for whom permissions hold: in a
forked child that gives up root before it calls the entry point (this interpreter may lie in
root's home, which nobody could start), in a workspace outside pytest's folders (root's alone)."""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import load_tool, single_rank, write_config

NOBODY = 65534


def _as_another_user(main: Callable[[list[str]], int], argv: list[str]) -> tuple[int, str]:
    """``main(argv)``'s exit code and output, run as a user without root's access to every file."""
    with tempfile.TemporaryFile() as out:
        if (pid := os.fork()) == 0:
            code = 99
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(out.fileno(), 2)
                sys.stdout = sys.stderr = io.TextIOWrapper(os.fdopen(os.dup(1), "wb"), write_through=True)
                if os.geteuid() == 0:
                    os.setgroups([])
                    os.setgid(NOBODY)
                    os.setuid(NOBODY)
                code = main(argv)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        return os.waitstatus_to_exitcode(status), out.read().decode(errors="replace")


def _hashes(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def _one_line(code: int, output: str, says: str) -> None:
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 2, output[-3000:]
    assert len(errors) == 1 and "Traceback" not in output, output[-3000:]
    assert says in errors[0], errors[0]


@pytest.fixture(scope="module")
def workspace(corpus) -> Iterator[Path]:
    """A run with checkpoints at steps 2 and 4, its corpus beside it, owned by the user the
    commands run as."""
    ws = Path(tempfile.mkdtemp(prefix="permissions-"))
    ws.chmod(0o755)
    shutil.copytree(corpus["prefix"].parent, ws / "corpus")
    local = {"prefix": ws / "corpus" / "stdlib", "tokenizer": ws / "corpus" / "spm.model"}
    config = write_config(ws / "cfg.yaml", local, ws / "run", checkpoint={"interval": 2}, train={"steps": 4})
    result = single_rank(config)
    assert result.returncode == 0, result.stderr[-4000:]
    if os.geteuid() == 0:
        for path in [ws, *ws.rglob("*")]:
            os.chown(path, NOBODY, NOBODY)
    yield ws
    shutil.rmtree(ws)


@pytest.mark.parametrize("name", ["complete.json", "common.pt"])
def test_a_resume_from_a_checkpoint_this_user_may_not_read_stops_and_passes_nothing_over(workspace, name):
    """The checkpoint is whole: resuming from the one before it would repeat steps and, by
    rotation, could remove it."""
    from megatron_train.train import main

    unreadable = workspace / "run" / "checkpoints" / "iter_0000004" / name
    before = _hashes(workspace)
    unreadable.chmod(0)
    try:
        code, output = _as_another_user(main, ["--config", str(workspace / "cfg.yaml"), "train.steps=6"])
    finally:
        unreadable.chmod(0o644)
    _one_line(code, output, f"'{unreadable}' may not be used by this user (Permission denied)")
    assert "skipping" not in output
    assert _hashes(workspace) == before


def test_a_tokenizer_this_user_may_not_read_is_named_as_such_not_as_one_that_does_not_load(workspace):
    tokenizer = workspace / "corpus" / "spm.model"
    before = _hashes(workspace)
    tokenizer.chmod(0)
    try:
        code, output = _as_another_user(
            load_tool("tools/preprocess_data.py").main,
            ["--input", str(workspace / "corpus" / "stdlib.jsonl"), "--tokenizer", str(tokenizer),
             "--output-prefix", str(workspace / "out")],
        )  # fmt: skip
    finally:
        tokenizer.chmod(0o644)
    _one_line(code, output, f"'{tokenizer}' may not be used by this user (Permission denied)")
    assert _hashes(workspace) == before
