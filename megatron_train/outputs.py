"""Outputs appear whole or not at all: a failed tool run leaves no folder it created behind."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def made_dir(path: Path) -> Iterator[Path]:
    """``path`` as a directory, with its missing parents created; if the body fails, the folders
    created here are removed again (with what the body wrote into them)."""
    created, probe = [], Path(path).absolute()
    while not probe.exists():
        created.append(probe)
        probe = probe.parent
    Path(path).mkdir(parents=True, exist_ok=True)
    try:
        yield Path(path)
    except BaseException:
        if created:
            shutil.rmtree(created[-1], ignore_errors=True)
        raise
