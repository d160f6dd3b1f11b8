"""One training run at a time in a run directory (and its save dir). A second start while the
first still runs (a job submitted twice, a manual restart next to a running job) would resume
from a checkpoint the first is about to delete, rewrite its metrics.jsonl and race it for the
same checkpoint folders; it is refused instead.

The lock is the kernel's advisory lock (flock) on the directory itself: nothing is written into
the run, and the lock ends with the process however it ends (kill -9 included), so there is no
stale lock to clear by hand. Forked children (the async checkpoint writer, data loader workers)
close their copy, so a child that outlives its parent never holds it. A file system without
such locks (some NFS and Lustre mounts) leaves the run unlocked, with a note saying so.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from megatron_train.errors import ConfigError

_held: dict[Path, int] = {}


def _close_in_child() -> None:
    for fd in _held.values():
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_close_in_child)


def hold(key: str, folder: Path) -> str | None:
    """Lock the existing directory ``folder`` for the rest of this process (nothing to do when
    this process holds it already). Returns a note when it cannot be locked (a file system
    without locks); raises ConfigError, naming ``key``, when another process holds it."""
    folder = Path(folder).resolve()
    if folder in _held:
        return None
    fd = None
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            key,
            f"{folder} belongs to a training run that is still going (another process holds its lock)",
            f"wait for that run to end or stop it, or set {key} to another directory",
        ) from None
    except OSError as err:
        if fd is not None:
            os.close(fd)
        return f"{folder} cannot be locked ({err.strerror}), so nothing stops a second run there"
    _held[folder] = fd
    return None


def moved_away() -> list[Path]:
    """The folders this process holds whose path no longer leads to them: removed, or moved
    elsewhere, while it ran (the outermost, where one held folder is inside another). A save
    there would make a new folder under the old name."""
    gone = [folder for folder, fd in _held.items() if replaced(folder, fd)]
    return [f for f in gone if not any(f != g and f.is_relative_to(g) for g in gone)]


def replaced(folder: Path, fd: int) -> bool:
    """Whether ``folder`` no longer leads to the folder open as ``fd``: removed, or moved
    elsewhere (an open folder's inode is not reused by one made anew under its name)."""
    try:
        now = os.stat(folder)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:  # cannot be told (a parent made unreadable): taken as still there
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)


def open_locked(path: Path, operation: int, flags: int = os.O_RDONLY | os.O_DIRECTORY) -> int | None:
    """``path`` opened with ``flags`` (a folder, by default) and locked with ``operation``
    (``fcntl.LOCK_SH`` or ``LOCK_EX``), for the caller to close; None where another process holds
    a lock that excludes it. On a file system without locks the descriptor holds none. A path that
    cannot be opened raises OSError."""
    fd = os.open(path, flags, 0o666)
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError:
        pass
    return fd


def held_by_another(folder: Path) -> bool:
    """Whether another process holds ``folder``'s lock now: a training run still going there.
    False where that cannot be told (a file system without locks, a folder that cannot be opened)."""
    folder = Path(folder).resolve()
    if folder in _held:
        return False
    try:
        # Shared, and given back at once by the close: a run starting now is not refused.
        fd = open_locked(folder, fcntl.LOCK_SH)
    except OSError:
        return False
    if fd is None:
        return True
    os.close(fd)
    return False
