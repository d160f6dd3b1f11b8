"""tools/build_wheelhouse.sh refuses bad arguments in one line, before it downloads or writes."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "tools" / "build_wheelhouse.sh"
# The floor the script states is pyproject's own: 11 for ">=3.11".
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
FLOOR = int(PYPROJECT["project"]["requires-python"].removeprefix(">=3."))
TOO_OLD = f"3.{FLOOR - 1}"


def _build(cwd: Path, *args: str, python: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": python} if python else None
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60
    )


def _one_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: build_wheelhouse.sh: ") and "Fix: " in lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--python"], "--python needs a value"),
        (["--python", "3.12", "--out"], "--out needs a value"),
        (["--with-te"], "--with-te needs a value"),
        (["--python", "3"], "--python wants a version such as 3.12, got '3'"),
        (["--python", TOO_OLD], f"--python {TOO_OLD}: megatron-train needs Python 3.{FLOOR} or newer"),
        (["--python", "3.08"], f"--python 3.08: megatron-train needs Python 3.{FLOOR} or newer"),
        (["--with-te", "cu11"], "--with-te takes cu12 or cu13, got 'cu11'"),
        (["--with-torchtitan", "latest"], "--with-torchtitan wants a release such as 0.2.2"),
        (["--node-freeze", "missing.txt"], "--node-freeze: no file"),
        (["--node-freeze", "notes.txt"], "has no name==version line"),
        (["--out", "taken"], "exists"),
        (["--out", "/proc/megatron-train/wheelhouse"], "cannot be made"),
        (["--verbose"], "unknown argument '--verbose'"),
    ],
)
def test_bad_arguments_are_one_line_and_write_nothing(tmp_path, args, says):
    # Relative paths are the caller's: these two exist only in the folder the script is run from.
    (tmp_path / "notes.txt").write_text("torch 2.11.0 (conda list)\n")
    (tmp_path / "taken").mkdir()
    before = sorted(p.name for p in tmp_path.iterdir())

    result = _build(tmp_path, *args)

    assert says in _one_line(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    # Where the script would have put them before: relative to the repository.
    assert not (ROOT / "taken").exists() and not (ROOT / "wheelhouse").exists()


def test_a_python_that_cannot_build_the_wheel_is_named_before_anything_is_fetched(tmp_path):
    # A venv without pip has no setuptools: pip's own answer would be many lines, after the downloads.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    bare = str(tmp_path / "bare" / "bin" / "python")

    line = _one_line(_build(tmp_path, "--out", "wh", python=bare))
    assert f"'{bare}' cannot build a wheel: it needs setuptools >= 70.1" in line
    line = _one_line(_build(tmp_path, "--out", "wh", python=str(tmp_path / "missing")))
    assert "does not run" in line
    assert not (tmp_path / "wh").exists()
