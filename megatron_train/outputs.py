"""Outputs appear whole or not at all: output locations are checked before anything is written,
an earlier output is never replaced, a failed tool run leaves no folder it created behind, and a
dataset appears only once complete."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from megatron_train import run_lock
from megatron_train.errors import NAME_MAX, ConfigError, Failure

TEMPORARY_NAME_EXTRA = 17
"""The most a temporary name adds to an output's name (``.<name>.partial-<pid>``)."""


def name_room(suffixes: tuple[str, ...]) -> int:
    """The longest name, in bytes, an output may have to which a tool adds one of ``suffixes``
    and, while writing, a temporary ending."""
    return NAME_MAX - max(len(suffix) for suffix in suffixes) - TEMPORARY_NAME_EXTRA


def check_name_room(key: str, path: Path, suffixes: tuple[str, ...] = ("",)) -> None:
    """``path``'s name leaves room for the endings a tool adds to it (one of ``suffixes``, and a
    temporary name while it writes): a name the file system takes could fail only at the end."""
    allowed = name_room(suffixes)
    if len(path.name.encode()) > allowed:
        raise ConfigError(
            key,
            f"its file name is {len(path.name.encode())} bytes long, and with the ending the tool "
            f"adds (a suffix, a temporary name) it would pass the file system's {NAME_MAX} bytes a name",
            f"shorten {path.name[:20]}... to at most {allowed} bytes",
        )


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
        with _kept_in_place(Path(path)):
            yield Path(path)
    except BaseException:
        if created:
            shutil.rmtree(created[-1], ignore_errors=True)
        raise


@contextmanager
def _kept_in_place(folder: Path) -> Iterator[None]:
    """The body's error, where ``folder`` was removed or moved away while the body wrote into it
    (by hand, a scratch file system's clean-up), as the one line that says so: the error itself
    names at best a file the folder held ("No such file or directory"), came with a traceback, or
    (SentencePiece's) blamed an option."""
    # O_PATH: a folder this user may write into but not list (a drop box) opens too.
    fd = os.open(folder, os.O_PATH | os.O_DIRECTORY)
    try:
        yield
    except Exception as err:
        # A Failure is said already: that of a watch inside this one (a dataset in a made_dir).
        if isinstance(err, Failure) or not run_lock.replaced(folder, fd):
            raise
        raise Failure(
            f"{folder} was removed or moved away while the output was written into it, so the "
            "output is not there. Fix: run it again, with the folder left in place"
        ) from err
    finally:
        os.close(fd)


@contextmanager
def dataset_files(prefix: Path, key: str) -> Iterator[tuple[Path, Path]]:
    """Temporary ``.bin`` and ``.idx`` paths for the indexed dataset at ``prefix``. When the body
    succeeds they become ``prefix.bin`` and ``prefix.idx``, the ``.idx`` last, so a dataset whose
    ``.idx`` exists is complete; either way no temporary file stays. One process at a time writes
    a given dataset: another one writing it (the same command started twice), or one that
    finished it meanwhile, is a ConfigError naming ``key``, and its files are left as they are."""
    tmp_bin, tmp_idx = _dataset_tmp_files(prefix)
    done = prefix.with_name(prefix.name + ".idx")
    # A Ctrl-C or SIGTERM just after the claim made the temporary file, before the clean-up below
    # was in place, left it behind.
    with _kept_in_place(prefix.parent), _stops_held() as release, _claimed(tmp_bin, key) as claimed:
        if not claimed:
            raise ConfigError(
                key,
                f"{prefix}.bin/.idx is being written by another process now (it holds {tmp_bin})",
                f"let that process finish, or choose another {key}",
            )
        try:
            release()
            if done.exists():
                raise ConfigError(
                    key,
                    f"{prefix}.bin/.idx was written by another process meanwhile",
                    f"choose another {key}",
                )
            yield tmp_bin, tmp_idx
            os.replace(tmp_bin, prefix.with_name(prefix.name + ".bin"))
            os.replace(tmp_idx, done)
        finally:
            tmp_bin.unlink(missing_ok=True)
            tmp_idx.unlink(missing_ok=True)


_STOPS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def _stops_held() -> Iterator[Callable[[], None]]:
    """Inside, SIGINT and SIGTERM are only noted until the function yielded is called or the
    block ends; one that came meanwhile is then handled. Their Python handlers are swapped rather
    than the signals blocked: the kernel gives a signal sent to the process to any thread that
    does not block it (pyarrow and the tokenizers start native ones), and Python then runs its
    handler in the main thread all the same."""
    if threading.current_thread() is not threading.main_thread():
        # Python's handlers run in the main thread alone: they cannot interrupt this one.
        yield lambda: None
        return
    noted: list[int] = []
    previous = {sig: signal.getsignal(sig) for sig in _STOPS}
    held = [sig for sig, handler in previous.items() if handler is not None]  # None: set from C
    for sig in held:
        signal.signal(sig, lambda signum, frame: noted.append(signum))

    def release() -> None:
        while held:
            sig = held.pop()
            signal.signal(sig, previous[sig])
        while noted:
            signal.raise_signal(noted.pop(0))

    try:
        yield release
    finally:
        release()


def _dataset_tmp_files(prefix: Path) -> tuple[Path, Path]:
    return prefix.with_name(f"{prefix.name}.bin.tmp"), prefix.with_name(f"{prefix.name}.idx.tmp")


@contextmanager
def _claimed(tmp: Path, key: str) -> Iterator[bool]:
    """Whether this process alone holds ``tmp`` (created if missing, its contents kept): the
    kernel's lock on it, which ends with the process however it ends, so a file left by a killed
    writer is free. A file system without such locks lets every process hold it."""
    if os.path.lexists(tmp) and not stat.S_ISREG(os.lstat(tmp).st_mode):
        raise ConfigError(key, f"{tmp}, a temporary name of the output, is {_kind(tmp)}", "move it away")
    fd = run_lock.open_locked(tmp, fcntl.LOCK_EX, os.O_WRONLY | os.O_CREAT)
    if fd is None:
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)


def _kind(path: Path) -> str:
    if path.is_symlink():
        return "a symbolic link"
    return "a directory" if path.is_dir() else "not a regular file"


def discard_partial_dataset(prefix: Path) -> None:
    """Remove the temporary files :func:`dataset_files` wrote for ``prefix`` and left behind, its
    process stopped before its own clean-up; those another process is writing stay."""
    tmp_bin, tmp_idx = _dataset_tmp_files(prefix)
    if not os.path.lexists(tmp_bin) or not stat.S_ISREG(os.lstat(tmp_bin).st_mode):
        return
    with _claimed(tmp_bin, "") as claimed:
        if claimed:
            tmp_bin.unlink(missing_ok=True)
            tmp_idx.unlink(missing_ok=True)


def publish(renames: list[tuple[Path, Path]], key: str) -> None:
    """Rename each finished temporary file or folder to its output, none of which may exist:
    one that another process wrote while this one worked (the same command started twice) is
    kept, and this process's refused, as ConfigError naming ``key``."""
    for _, out in renames:
        if os.path.lexists(out):
            raise ConfigError(
                key,
                f"{out} was written by another process meanwhile",
                f"keep that one, or choose another {key}",
            )
    for tmp, out in renames:
        os.replace(tmp, out)


def output_prefix(key: str, text: str, suffixes: tuple[str, ...]) -> Path:
    """The checked ``--output-prefix`` ``text``: it names files (not a folder) without one of their
    ``suffixes``, their folder is writable or can be made, and none of ``prefix`` + suffix exists
    yet."""
    if not text or text.endswith(("/", os.sep)) or Path(text).name in ("", ".", ".."):
        raise ConfigError(
            key,
            f"{text!r} names a folder, not files: the output would go beside it",
            f"end it with a file name stem, e.g. {os.path.join(text or '.', 'corpus')}",
        )
    given = next((suffix for suffix in suffixes if suffix and text.endswith(suffix)), None)
    if given:
        # Every tool adds the suffixes itself: 'corpus.bin' would write corpus.bin.bin, a prefix
        # that data.blend then refuses for naming a .bin file.
        raise ConfigError(
            key,
            f"{text!r} ends in {given}, which the tool adds itself: it would write {text}{suffixes[0]}",
            f"drop the suffix: {key} {text[: -len(given)]}",
        )
    prefix = Path(text)
    check_name_room(key, prefix, suffixes)
    check_output_dir(key, prefix.parent)
    # After the length checks: Path.exists raises for a name or path the file system refuses.
    if all(suffixes) and prefix.exists() and not (prefix.is_file() or prefix.is_dir()):
        # /dev/null as a prefix, meaning "discard it", would write /dev/null.bin into /dev.
        raise ConfigError(
            key,
            f"{text} is a device, pipe or socket: the output would go beside it as {text}{suffixes[0]}",
            "name a file stem in a folder for the output, e.g. data/corpus",
        )
    check_new_files(key, prefix, suffixes)
    return prefix


def check_new_files(key: str, prefix: Path, suffixes: tuple[str, ...]) -> None:
    """No ``prefix`` + suffix file exists yet: a dataset or tokenizer that took hours to make is
    not replaced by a mistyped prefix."""
    # lexists: writing would replace a link that leads nowhere, where the user may mean it to lead.
    existing = [f"{prefix}{suffix}" for suffix in suffixes if os.path.lexists(f"{prefix}{suffix}")]
    if existing:
        raise ConfigError(
            key, f"{existing[0]} already exists", f"choose another {key} or remove the old files first"
        )


def check_run_dir(key: str, path: Path) -> None:
    """``path`` can hold a run (:func:`check_own_dir`), and a start there replaces no file it did
    not write: each start writes ``config.yaml`` next to ``metrics.jsonl``, so a ``config.yaml``
    without one is somebody's own (often the experiment config itself, kept beside its outputs)."""
    check_own_dir(key, path)
    config, metrics = Path(path) / "config.yaml", Path(path) / "metrics.jsonl"
    for written in (config, metrics):
        check_output_file(key, written)
    if config.exists() and not metrics.exists():
        raise ConfigError(
            key,
            f"{config} is not a training run's resolved config, and a start would replace it",
            "set it to a new directory, or keep your own config outside the run directory",
        )


def check_own_dir(key: str, path: Path) -> None:
    """:func:`check_output_dir`, for a folder its writer fills with files of its own names: not the
    filesystem's root, where a path built from an unset shell variable (``$RUN/``) leads."""
    # realpath, not Path.resolve: a loop of links is check_output_dir's to name, not a RuntimeError.
    resolved = os.path.realpath(path)
    if resolved == os.path.dirname(resolved):
        raise ConfigError(
            key,
            f"{str(path)!r} is the filesystem's root, where the files written would sit among the "
            "system's (a path built from an unset shell variable leads there)",
            "set it to a directory of its own, e.g. runs/my-run",
        )
    check_output_dir(key, path)


def check_output_file(key: str, path: Path) -> None:
    """``path``, where it exists, is a regular file that can be written (appended to or replaced)."""
    if not os.path.lexists(path):
        return
    if not path.exists():
        raise ConfigError(
            key,
            f"{path} is a symbolic link to {os.readlink(path)!r}, which leads nowhere",
            "correct the link or remove it",
        )
    if not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise ConfigError(
            key, f"{path} is {kind}, where the run writes a file", f"move it away or choose another {key}"
        )
    if not os.access(path, os.W_OK):
        raise ConfigError(key, f"{path} is not writable", "make it writable or choose another location")


def check_output_dir(key: str, path: Path) -> None:
    """``path`` exists as a writable directory or can be created as one (nothing is created)."""
    probe = Path(path).absolute()
    while not probe.exists():
        if probe.is_symlink():
            # Making the folder would fail on the link, after the run had started.
            raise ConfigError(
                key,
                f"{probe} is a symbolic link to {os.readlink(probe)!r}, which leads nowhere",
                "correct the link or choose another path",
            )
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(
            key, f"{path} cannot be a directory: {probe} is a file", "choose a path outside that file"
        )
    # root passes os.access everywhere, even in /proc; a folder that grants nobody write access
    # (kernel file systems, folders made read-only on purpose) is refused for root too.
    read_only = os.geteuid() == 0 and not probe.stat().st_mode & 0o222
    if read_only or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(key, f"{probe} is not writable", "choose a writable location")
