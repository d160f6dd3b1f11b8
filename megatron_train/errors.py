"""The bad-input errors: each message names the problem and the fix, and every entry point turns
them into one line on stderr and exit code 2 (no traceback). A write the file system refuses is
not bad input, but it too ends in one line (exit code 1)."""

from __future__ import annotations

import errno
import math
import os
import re
import reprlib
from pathlib import Path

NAME_MAX = 255
"""The longest file name, in bytes, of the file systems Linux clusters use (ext4, xfs, Lustre, NFS)."""


class _Shown(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        # Python refuses to turn an int of over 4300 digits into text (YAML reads 0xff...f).
        if x.bit_length() > 256:
            sign = "a negative" if x < 0 else "an"
            return f"{sign} integer of about {int(x.bit_length() * math.log10(2)) + 1:,} digits"
        return super().repr_int(x, level)


_SHOWN = _Shown()
# Long enough to recognise a value, short enough for one line: a few lines of YAML aliases make a
# list of millions, whose full repr takes gigabytes and minutes to build.
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict = 2, 6, 6, 4
_SHOWN.maxstring = _SHOWN.maxother = _SHOWN.maxlong = 80


def shown(value: object) -> str:
    """A value given as input (a config entry, a config.json field) as an error line shows it:
    its repr, with long strings and large or deep containers cut."""
    return _SHOWN.repr(value)


class ConfigError(ValueError):
    """A bad config value; ``key`` is the dotted path of the offending option."""

    def __init__(self, key: str, problem: str, fix: str) -> None:
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(f"config error at '{key}': {problem}. Fix: {fix}")

    def __reduce__(self) -> tuple:
        # Raised in a worker process, it reaches the parent pickled.
        return ConfigError, (self.key, self.problem, self.fix)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with the reason and what to do."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint whose every file has its recorded size (so not torn) but whose bytes do not
    read: ``problem`` names the file; ``older`` is the newest complete checkpoint before it in its
    folder, if any; ``fix`` says what to do instead (by default, read ``older``), where the caller
    knows better (a resume: move the damaged one out of its save dir)."""

    def __init__(self, problem: str, older: Path | None = None, fix: str | None = None) -> None:
        self.problem, self.older = problem, older
        self.fix = fix or (
            f"use another checkpoint ({older} is complete)" if older else "use another checkpoint"
        )
        super().__init__(f"{problem}; {self.fix}")

    def __reduce__(self) -> tuple:
        return CorruptCheckpoint, (self.problem, self.older, self.fix)


class ConversionError(ValueError):
    """Input a conversion cannot handle; the message names the problem and the fix."""


BAD_INPUT = (ConfigError, CheckpointError, ConversionError)


class Failure(RuntimeError):
    """A failure that is not the input's (a worker process killed under a tool), said in one line
    with what to do: exit code 1, without a traceback that would point at the tool's code."""


def out_of_room(err: BaseException) -> str | None:
    """The reason of the write in ``err`` that the file system refused for want of room (a full
    disk, a quota, a file-size limit), or None. numpy's ``tofile`` and PyTorch's zip writer
    (``torch.save``) report a short write without an errno; PyTorch's distributed checkpoint
    gathers the ranks' errors in ``failures``, and writer processes chain theirs as the cause."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return reason(err)
    text = str(err)
    if (
        isinstance(err, OSError)
        and err.errno is None
        and " requested and " in text
        and text.endswith(" written")
    ):
        return f"numpy wrote its file short, as on a full disk: {reason(err)}"
    if isinstance(err, RuntimeError) and ("PytorchStreamWriter failed" in text or "unexpected pos" in text):
        return f"torch.save wrote its file short, as on a full disk: {reason(err)}"
    return next((found for exc in _inner(err) if (found := out_of_room(exc))), None)


def _inner(err: BaseException) -> list[BaseException]:
    """The errors ``err`` stands for: PyTorch's distributed checkpoint gathers the ranks' errors in
    ``failures``, and writer processes chain theirs as the cause."""
    inner = [exc for exc, _ in getattr(err, "failures", {}).values()] + [err.__cause__]
    return [exc for exc in inner if exc is not None]


# What gloo and NCCL say of a collective whose peer process went away.
_PEER_GONE = re.compile(
    r"Connection (?:closed|reset) by peer(?: \[[^\]]*\]:\d+)?"
    r"|remote process exit\w*(?: or there was a network error)?"
)


def peer_gone(err: BaseException) -> str | None:
    """gloo's or NCCL's words (without gloo's source location) where ``err``, or an error it was
    raised in handling, is a collective that failed because another rank's process went away,
    most often by failing first; None for any other error."""
    return _said(err, _PEER_GONE)


# gloo's words for a collective that waited out its timeout.
_TIMED_OUT = re.compile(r"Timed out waiting \d+ms for (?:send|recv) operation to complete")


def collective_timed_out(err: BaseException) -> str | None:
    """gloo's words where ``err``, or an error it was raised in handling, is a collective that
    waited out its timeout for another rank; None for any other error."""
    return _said(err, _TIMED_OUT)


def _said(err: BaseException, words: re.Pattern) -> str | None:
    """``words`` as a RuntimeError among the errors ``err`` stands for (:func:`_inner`), or the one
    it was raised in handling (a collective that failed under a ``finally`` that ran another)."""
    if isinstance(err, RuntimeError) and (found := words.search(str(err))):
        return found[0].strip()
    inner = [*_inner(err), err.__context__]
    return next((found for exc in inner if exc is not None and (found := _said(exc, words))), None)


# torch's words for a loader worker that found /dev/shm full. (A worker's SIGBUS, which torch
# puts down to it too, is as often a dataset file that shrank under its memory map.)
_SHM_FULL = re.compile(r"unable to allocate shared memory\(shm\)")


def out_of_shared_memory(err: BaseException) -> str | None:
    """Why ``err`` says shared memory (``/dev/shm``, where data loader workers hand their batches
    over) is full, or None: torch's report of a worker that found no room, or the ENOSPC of a
    semaphore multiprocessing could not create there (a loader's queues need some)."""
    text = str(err)
    if isinstance(err, RuntimeError) and _SHM_FULL.search(text):
        return next((line.strip() for line in reversed(text.splitlines()) if _SHM_FULL.search(line)), "")
    if isinstance(err, OSError) and err.errno == errno.ENOSPC and err.filename is None:
        tb = err.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename.endswith(os.path.join("multiprocessing", "synchronize.py")):
                return f"a semaphore could not be created: {reason(err)}"
            tb = tb.tb_next
    return None


# torch's words for a loader worker process that a signal ended, or that exited.
_WORKER_LOST = re.compile(
    r"DataLoader worker \(pids?(?:\(s\))? [^)]*\) "
    r"(?:is killed by signal: [^.]+|exited unexpectedly(?: with exit code -?\d+)?)"
)


def loader_worker_lost(err: BaseException) -> str | None:
    """torch's words where ``err`` reports a data loader worker process that went away (killed:
    the out-of-memory killer's SIGKILL most often), or None."""
    found = _WORKER_LOST.search(str(err)) if isinstance(err, RuntimeError) else None
    return found[0] if found else None


_REFUSED = (errno.EACCES, errno.EPERM, errno.EROFS)


def denied(err: BaseException) -> str | None:
    """The error line (without ``error:``) for ``err`` when the file system refused this user a
    path: its permissions or owner, or a file system mounted read-only. Not damage: the files are
    whole, and another user (or the same one after a chmod) can use them. None for any other error."""
    # Without a file name, the same codes come from sockets, signals and process groups.
    if isinstance(err, OSError) and err.filename is not None and err.errno in _REFUSED:
        path = repr(_clipped(os.fsdecode(err.filename)))
        if err.errno == errno.EROFS:
            return f"{path} is on a read-only file system. Fix: write elsewhere or have it mounted read-write"
        return (
            f"{path} may not be used by this user ({err.strerror}). Fix: give this user access to it "
            "(chmod, chown or the group), run as a user who has it, or name another path"
        )
    return next((found for exc in _inner(err) if (found := denied(exc))), None)


def check_readable(path: os.PathLike) -> None:
    """The file system's PermissionError for a file this user may not read, raised before a
    library reads it and reports that as something else (sentencepiece: "does not load",
    safetensors: "No such file")."""
    with open(path, "rb"):
        pass


def reason(err: BaseException) -> str:
    """A library exception's message as one line of at most 300 characters, for an error line."""
    return " ".join(str(err).split())[:300] or type(err).__name__


_PATHLIB_LOOP = "Symlink loop from "


def unusable_path(err: BaseException) -> str | None:
    """The error line (without ``error:``) for ``err`` when the file system refused a path for its
    form: longer than it allows (a name over 255 bytes, a path over 4096), or through a loop of
    symbolic links. Such a path can only have come from the input, wherever it was first used.
    None for any other error."""
    if isinstance(err, RuntimeError) and str(err).startswith(_PATHLIB_LOOP):
        # Path.resolve() before Python 3.13 reports a loop of links as this RuntimeError.
        err = OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(err).removeprefix(_PATHLIB_LOOP)[1:-1])
    if not (isinstance(err, OSError) and err.errno in (errno.ENAMETOOLONG, errno.ELOOP)):
        return None
    path = _clipped(os.fsdecode(err.filename)) if err.filename is not None else None
    if err.errno == errno.ELOOP:
        where = f"the path {path!r}" if path else "a path given"
        return f"{where} goes through a loop of symbolic links. Fix: correct the links or give another path"
    if path is None:
        return f"a path given is longer than the file system allows ({reason(err)}). Fix: shorten it"
    full = os.fsdecode(err.filename)
    longest = max(len(name.encode()) for name in full.split("/"))
    what = f"a name in it is {longest}" if longest > NAME_MAX else f"it is {len(full.encode())}"
    return (
        f"the path {path!r} is longer than the file system allows: {what} bytes long. "
        f"Fix: shorten it (at most {NAME_MAX} bytes a name, 4096 a path)"
    )


def missing(path: os.PathLike | str) -> str:
    """The words "does not exist", with where a relative ``path`` was looked for: a job started
    from another folder (``sbatch --chdir``, a script that changes directory) reads its config's
    relative paths from there, and the path alone looks right."""
    if Path(path).is_absolute():
        return "does not exist"
    try:
        return f"does not exist under {os.getcwd()}, the current directory"
    except OSError:  # the current directory itself is gone
        return "does not exist"


def not_a_file(path: os.PathLike) -> str | None:
    """Why ``path`` cannot be read as a file, as the end of a sentence that starts with the path
    ("does not exist", "is a directory", ...); None where it is a regular file. Path's tests, unlike
    os.path's, raise for a path too long, which :func:`unusable_path` then names."""
    path = Path(path)
    if path.is_file():
        return None
    if path.is_symlink() and not path.exists():
        return f"is a symbolic link to {os.readlink(path)!r}, which leads nowhere"
    if path.is_dir():
        return "is a directory"
    return "is not a regular file (a device, pipe or socket)" if path.exists() else missing(path)


def _clipped(text: str, keep: int = 40) -> str:
    """``text``, its middle cut when long, so an error line stays readable."""
    return text if len(text) <= 2 * keep + 3 else f"{text[:keep]}...{text[-keep:]}"
