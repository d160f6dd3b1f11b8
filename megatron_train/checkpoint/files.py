"""The on-disk checkpoint layout and its integrity rules; no torch, no process groups.

``<save dir>/iter_0000100/`` holds one checkpoint as megatron-core's dist_checkpointing writes
it, plus ``complete.json``: the completion record listing every file with its size (and
SHA-256). A checkpoint without a valid record is torn and never resumed from. The tracker
``latest_checkpointed_iteration.txt`` (Megatron-LM's name) is rewritten atomically only after
a record exists.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from megatron_train import json_text, run_lock
from megatron_train.config import SAVE_DIR_IN_RUN
from megatron_train.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpoint,
    denied,
    missing,
    not_a_file,
    shown,
)
from megatron_train.hf.model_dir import is_hf_model_dir, missing_weights

RECORD = "complete.json"
TRACKER = "latest_checkpointed_iteration.txt"
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
_HASH_CHUNK = 16 * 2**20


class ChecksumsAbsent(ConfigError):
    """Checksums asked of a checkpoint saved without them: it is complete, not torn."""

    def __init__(self, ckpt_dir: Path) -> None:
        super().__init__(
            "checkpoint.verify_checksums",
            f"{ckpt_dir} was saved without checksums (checkpoint.checksums=false): its {RECORD} has none "
            "to verify",
            "set checkpoint.verify_checksums=false to load it (the sizes of its files are still checked)",
        )


def iteration_dir(save_dir: Path, iteration: int) -> Path:
    """``<save_dir>/iter_0000100`` for iteration 100."""
    return Path(save_dir) / f"iter_{iteration:07d}"


def iteration_of(path: Path) -> int | None:
    """The iteration a checkpoint directory name encodes, or None if it is not one."""
    match = _ITER_DIR.match(Path(path).name)
    return int(match.group(1)) if match else None


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so readers see the old or the new file, never a torn one;
    a write that fails (a full disk) leaves the old file and no temporary one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of a file, read in large chunks (hashlib releases the GIL on them)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _payload_files(ckpt_dir: Path) -> list[Path]:
    return sorted(p for p in ckpt_dir.rglob("*") if p.is_file() and p.name != RECORD)


def write_completion_record(ckpt_dir: Path, iteration: int, checksums: bool, extra: dict) -> dict:
    """List every file of a finished checkpoint with its size (and SHA-256), atomically."""
    files = {}
    for path in _payload_files(ckpt_dir):
        entry = {"size": path.stat().st_size}
        if checksums:
            entry["sha256"] = sha256_of(path)
        files[str(path.relative_to(ckpt_dir))] = entry
    record = {"format": 1, "iteration": iteration, **extra, "files": files}
    write_atomic(ckpt_dir / RECORD, json.dumps(record, indent=1))
    return record


def total_size(record: dict) -> int:
    """Bytes of all files a completion record lists."""
    return sum(entry["size"] for entry in record["files"].values())


def read_record(ckpt_dir: Path) -> dict:
    """The completion record, or CheckpointError when it is missing or unreadable."""
    path = Path(ckpt_dir) / RECORD
    if not path.is_file():
        raise CheckpointError(f"{ckpt_dir} has no {RECORD}: the save did not finish (torn checkpoint)")
    try:
        record = json_text.loads(path.read_text())
    except (OSError, ValueError) as err:
        if denied(err):  # whole, but not this user's to read: no reason to pass it over
            raise
        raise CheckpointError(f"{path} is unreadable ({err}): the checkpoint is torn or corrupt") from err
    entries = record.get("files") if isinstance(record, dict) else None
    if not isinstance(entries, dict) or not all(
        isinstance(e, dict) and isinstance(e.get("size"), int) for e in entries.values()
    ):
        raise CheckpointError(
            f"{path} is malformed (no mapping of files to sizes): the checkpoint is torn or corrupt"
        )
    return record


def verify(ckpt_dir: Path, checksums: bool = False) -> dict:
    """Check a checkpoint against its completion record; returns the record.

    Raises CheckpointError naming the first missing, truncated or corrupted file.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{ckpt_dir} does not exist or is not a directory")
    record = read_record(ckpt_dir)
    if checksums:
        check_checksums_recorded(ckpt_dir, record)
    for name, entry in record["files"].items():
        path = ckpt_dir / name
        try:
            size = path.stat().st_size if path.is_file() else None
        except (OSError, ValueError) as err:  # a name too long, or with a NUL: no save wrote it
            if denied(err):
                raise
            why = err.strerror if isinstance(err, OSError) else err
            raise CheckpointError(
                f"{ckpt_dir}: {RECORD} lists a file no file system holds ({shown(name)}: {why}): the "
                "checkpoint is corrupt"
            ) from None
        if size is None:
            raise CheckpointError(f"{ckpt_dir}: file {name} listed in {RECORD} is missing")
        if size != entry["size"]:
            raise CheckpointError(
                f"{ckpt_dir}: file {name} has {size} bytes, {RECORD} says {entry['size']} "
                "(truncated or altered)"
            )
        if checksums:
            if sha256_of(path) != entry["sha256"]:
                raise CheckpointError(f"{ckpt_dir}: file {name} fails its SHA-256 check (corrupted)")
    return record


SMALL_FILES = (".metadata", "common.pt", "metadata.json")
"""The files whose every byte the load reads as structure (DCP's index of the tensors, our common
state, megatron's format record): small, so hashing them on a failed load costs nothing."""


def changed_in_place(ckpt_dir: Path) -> CorruptCheckpoint | None:
    """The error for the first of :data:`SMALL_FILES` whose SHA-256 differs from its recorded one:
    changed in place (its size right, so :func:`verify` took it as whole), which explains any
    failure of the load after it. None when they match, or the record holds no checksums."""
    try:
        entries = read_record(ckpt_dir)["files"]
        for name in SMALL_FILES:
            recorded = entries.get(name, {}).get("sha256")
            if recorded is not None and sha256_of(Path(ckpt_dir) / name) != recorded:
                return corrupt(
                    f"{Path(ckpt_dir) / name} fails its SHA-256 check: the checkpoint is corrupt", ckpt_dir
                )
    except (CheckpointError, OSError):
        pass
    return None


def corrupt(problem: str, ckpt_dir: Path) -> CorruptCheckpoint:
    """The error for checkpoint ``ckpt_dir``, whole but damaged (``problem``), naming the newest
    complete checkpoint before it in its folder, to read instead."""
    step = iteration_of(ckpt_dir)
    return CorruptCheckpoint(
        problem, None if step is None else find_latest_complete(Path(ckpt_dir).parent, before=step).path
    )


def check_checksums_recorded(ckpt_dir: Path, record: dict) -> None:
    """ChecksumsAbsent unless ``record`` holds a checksum for every file (nothing is read)."""
    if any("sha256" not in entry for entry in record["files"].values()):
        raise ChecksumsAbsent(ckpt_dir)


def checkpoint_dirs(save_dir: Path) -> list[Path]:
    """All ``iter_*`` directories in a save dir, newest first."""
    save_dir = Path(save_dir)
    if not save_dir.is_dir():
        return []
    found = [p for p in save_dir.iterdir() if p.is_dir() and iteration_of(p) is not None]
    return sorted(found, key=iteration_of, reverse=True)


@dataclass(frozen=True)
class ResumePoint:
    """Where to resume from, and the newer checkpoints that were passed over (with why)."""

    path: Path | None
    skipped: list[tuple[Path, str]]


def find_latest_complete(save_dir: Path, checksums: bool = False, before: int | None = None) -> ResumePoint:
    """The newest checkpoint that verifies (of those before step ``before``, when given); torn
    newer ones are listed in ``skipped``."""
    skipped = []
    for path in checkpoint_dirs(save_dir):
        if before is not None and iteration_of(path) >= before:
            continue
        try:
            verify(path, checksums)
        except CheckpointError as err:
            skipped.append((path, str(err)))
            continue
        return ResumePoint(path, skipped)
    return ResumePoint(None, skipped)


_WANTED = (
    "give a checkpoint (iter_*), the save dir holding them, or a run directory with a "
    f"{SAVE_DIR_IN_RUN}/ folder"
)


def locate(path: Path) -> Path:
    """The checkpoint ``path`` names: itself when it is one (``iter_*`` or holding a record),
    otherwise the newest ``iter_*`` in it (a save dir) or in its ``checkpoints/`` (a run
    directory saving where it does by default), complete or not."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{str(path)!r} {missing(path)}: {_WANTED}")
    if iteration_of(path) is not None or (path / RECORD).exists():
        return path
    dirs = checkpoint_dirs(path) or checkpoint_dirs(path / SAVE_DIR_IN_RUN)
    if dirs:
        return dirs[0]
    if is_hf_model_dir(path):
        raise CheckpointError(
            f"{str(path)!r} is a Hugging Face model directory, not a megatron-train checkpoint: train "
            "from it with checkpoint.init_from, or convert it with tools/convert_checkpoint.py import-hf"
        )
    if (path / "config.json").is_file():
        raise CheckpointError(
            f"{str(path)!r} holds a Hugging Face config.json and no checkpoint, but {missing_weights(path)}"
        )
    if any(path.glob("*.safetensors")):
        config = path / "config.json"
        raise CheckpointError(
            f"{str(path)!r} holds safetensors weights, but its config.json {not_a_file(config)}: a "
            "Hugging Face model directory needs its config.json; download it again"
        )
    raise CheckpointError(f"{str(path)!r} holds no checkpoint: {_WANTED}")


def resolve_explicit(
    path: Path, checksums: bool = False, being_saved: Callable[[str], None] | None = None
) -> Path:
    """An explicitly requested checkpoint, which must be complete: an ``iter_*`` dir, or a save dir
    whose newest checkpoint is. Anything else is a CheckpointError (never a silent fresh start),
    naming the newest complete checkpoint beside a torn one.

    With ``being_saved`` (a tool reading a run that may be training), a save dir's or run dir's
    newest checkpoint that a run still going is writing (that run holds the save dir's lock) is
    not torn: the newest complete one is read instead, and ``being_saved`` told which; the
    checkpoint returned is then held from that run's retention (:func:`held_for_reading`)."""
    found = locate(path)
    try:
        verify(found, checksums)
    except CheckpointError as err:
        if being_saved and (older := complete_beside_a_save(found, Path(path))):
            being_saved(
                f"{found.name} is being saved by a run still going in {found.parent}; reading "
                f"{older.name}, its newest complete checkpoint"
            )
            return held_for_reading(older)
        # Sizes only: the hint must not hash every older checkpoint (or refuse one saved without).
        older = find_latest_complete(found.parent).path
        beside = f" (the newest complete one beside it is {older})" if older else ""
        raise CheckpointError(f"{err}; give a complete checkpoint instead{beside}") from None
    return held_for_reading(found) if being_saved else found


def complete_beside_a_save(found: Path, asked: Path) -> Path | None:
    """Where ``asked``, a save dir or run dir, named ``found`` (:func:`locate`), an incomplete
    checkpoint that a run still going is writing (it holds the save dir's lock): the newest
    complete checkpoint beside it. None otherwise: an ``iter_*`` asked for by name, or a torn one."""
    if found == asked or not run_lock.held_by_another(found.parent):
        return None
    return find_latest_complete(found.parent).path


_reading: list[int] = []
"""Open checkpoint folders this process reads, each under a shared lock until it exits."""


def held_for_reading(path: Path) -> Path:
    """``path``, kept from a running run's retention for the rest of this process (a tool that
    reads it): retention passes over a checkpoint someone holds, and removes it at a later save.
    Where the file system has no locks, nothing is kept."""
    try:
        fd = run_lock.open_locked(path, fcntl.LOCK_SH)
    except OSError:
        fd = None
    # None: retention holds it to remove it, as the record check below finds.
    if fd is not None:
        _reading.append(fd)
    if not (path / RECORD).is_file():
        raise CheckpointError(
            f"{path} was removed by its run's retention as this started (a newer checkpoint was saved); "
            "run it again to read the newest"
        )
    return path


@dataclass(frozen=True)
class LoadDecision:
    """Where a run starts from (None: fresh weights), and what to tell the user about it."""

    path: Path | None
    notes: list[str]


def resolve_load(
    load: str, save_dir: Path, checksums: bool = False, finetune: bool = False, run_dir: Path | None = None
) -> LoadDecision:
    """Apply ``checkpoint.load``: ``none``, ``auto`` (newest complete checkpoint in ``save_dir``,
    torn newer ones reported) or an explicit path (must be complete, else CheckpointError). A
    start that would not continue the checkpoints ``save_dir`` already holds, or a fresh start in
    the ``run_dir`` of a run saved elsewhere, is a ConfigError."""
    decision = _decide_load(load, save_dir, checksums, finetune)
    if decision.path is None and run_dir is not None:
        _check_fresh_start_in_run_dir(Path(run_dir), save_dir)
    return decision


def _decide_load(load: str, save_dir: Path, checksums: bool, finetune: bool) -> LoadDecision:
    if load == "auto":  # continues save_dir by definition (the config refuses it with finetune)
        point = find_latest_complete(save_dir, checksums)
        notes = [f"skipping torn checkpoint {p.name}: {why}" for p, why in point.skipped]
        if point.path is None:
            _refuse_to_start_over_damaged(point.skipped)
            notes.append(f"no complete checkpoint in {save_dir}: starting fresh")
        return LoadDecision(point.path, notes)
    start = None if load == "none" else resolve_explicit(Path(load), checksums)
    _check_continues_save_dir(start, save_dir, finetune)
    if start is None:
        return LoadDecision(None, ["checkpoint.load=none: starting from freshly initialised weights"])
    return LoadDecision(start, [])


def _refuse_to_start_over_damaged(skipped: list[tuple[Path, str]]) -> None:
    """A save cut short leaves no record, and starting fresh over it loses nothing. A checkpoint
    that has its record was complete once: damaged since (a file gone, a file system that has
    not caught up), it may be restored, and a fresh start would overwrite it and rotate it away."""
    damaged = [(path, why) for path, why in skipped if (path / RECORD).exists()]
    if damaged:
        path, why = damaged[0]
        raise ConfigError(
            "checkpoint.load",
            f"no checkpoint in {path.parent} verifies, and {path.name} was complete when it was saved "
            f"({why})",
            "restore its files (tools/inspect_checkpoint.py names what is wrong), or set "
            "checkpoint.load=none to start afresh over it",
        )


def _check_continues_save_dir(start: Path | None, save_dir: Path, finetune: bool) -> None:
    """A start from anything but ``save_dir``'s own newest checkpoint (fresh weights, another
    run's, weights only, or an older one of its own) would write its steps over the complete
    checkpoints there and rotate the rest away; a fine-tuning job requeued after its first save
    would start over from the base model; and a run rolled back to an older checkpoint would be
    left behind by the next ``load: auto`` (a requeued job), which continues the newest."""
    if (newest := find_latest_complete(save_dir).path) is None:
        return
    inside = start is not None and not finetune and start.resolve().parent == Path(save_dir).resolve()
    # By the step its record holds: a checkpoint copied into save_dir may have a name of its own.
    if inside and read_record(start)["iteration"] >= iteration_of(newest):
        return
    if inside:
        raise ConfigError(
            "checkpoint.load",
            f"{start.name} is older than {newest.name}, the newest complete checkpoint in {save_dir}: "
            "a run rolled back to it would replace the newer ones as it saves those steps, and the next "
            "resume with checkpoint.load=auto (a requeued job) would continue them, not it",
            f"to roll back, move the checkpoints after {start.name} out of {save_dir} and start again; "
            "to go on from the newest, set checkpoint.load=auto",
        )
    if finetune:
        key, how = "checkpoint.finetune", f"it takes only the weights of {start} and starts again at step 0"
    elif start is None:
        key, how = "checkpoint.load", "checkpoint.load=none starts from fresh weights"
    else:
        key, how = "checkpoint.load", f"it resumes from {start}, outside it"
    raise ConfigError(
        key,
        f"{save_dir} already holds checkpoints (newest: {newest.name}) that this start would not continue "
        f"({how}), and its saves would overwrite them",
        "set checkpoint.load=auto to resume them, or give this start a new logging.run_dir (or "
        "checkpoint.save_dir); to start from other weights in a job that may be requeued, use "
        "checkpoint.init_from",
    )


def _recorded_save_dir(run_dir: Path) -> Path | None:
    """The save dir of the run ``run_dir`` holds, as its resolved ``config.yaml`` names it; None
    where the folder holds no run (no ``metrics.jsonl``), its config cannot be read or names a save
    dir that cannot exist (the file is damaged: the run wrote a path it used)."""
    config, metrics = Path(run_dir) / "config.yaml", Path(run_dir) / "metrics.jsonl"
    if not (config.is_file() and metrics.is_file()):
        return None
    try:
        recorded = yaml.safe_load(config.read_text())
        save_dir = recorded["checkpoint"]["save_dir"]
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError, ValueError, RecursionError):
        return None
    if not (isinstance(save_dir, str) and save_dir):
        return Path(run_dir) / SAVE_DIR_IN_RUN
    try:
        os.stat(save_dir)
    except ValueError:  # a NUL byte
        return None
    except OSError as err:
        # A path no folder can have (too long, through a file) holds no checkpoints either.
        if err.errno in (errno.ENOENT, errno.ENAMETOOLONG, errno.ENOTDIR, errno.ELOOP):
            return None
    return Path(save_dir)


def _check_fresh_start_in_run_dir(run_dir: Path, save_dir: Path) -> None:
    """A fresh start writes the run directory's ``config.yaml`` and ``metrics.jsonl`` anew. When
    the run recorded there saved its checkpoints elsewhere than this start does, and they are
    complete, that run is alive: a start in its folder would replace its config and metrics."""
    recorded = _recorded_save_dir(run_dir)
    if recorded is None or recorded.resolve() == Path(save_dir).resolve():
        return
    newest = find_latest_complete(recorded).path
    if newest is not None:
        raise ConfigError(
            "logging.run_dir",
            f"{run_dir} belongs to the run saved in {recorded} (newest: {newest.name}), whose config.yaml "
            f"and metrics.jsonl this fresh start (saving to {save_dir}) would replace",
            f"give this start a new logging.run_dir, or resume that run (checkpoint.save_dir={recorded})",
        )


def update_tracker(save_dir: Path, iteration: int) -> None:
    """Point the tracker at ``iteration`` (called only once its record is written)."""
    write_atomic(Path(save_dir) / TRACKER, f"{iteration}\n")


def to_delete(iterations: list[int], keep_last: int, keep_every: int) -> list[int]:
    """Complete checkpoints that retention removes: all but the newest ``keep_last`` (0 keeps all)
    and the multiples of ``keep_every``. The newest is always kept."""
    if keep_last == 0:
        return []
    newest_first = sorted(iterations, reverse=True)
    keep = set(newest_first[: max(keep_last, 1)])
    if keep_every:
        keep.update(i for i in iterations if i % keep_every == 0)
    return [i for i in newest_first if i not in keep]


def apply_retention(save_dir: Path, keep_last: int, keep_every: int) -> list[Path]:
    """Delete what retention drops, plus torn checkpoints older than the newest complete one.

    Called only after a new checkpoint is complete, so a complete one always survives.
    """
    dirs = checkpoint_dirs(save_dir)
    complete = [iteration_of(p) for p in dirs if (p / RECORD).is_file()]
    if not complete:
        return []
    newest = max(complete)
    doomed = set(to_delete(complete, keep_last, keep_every))
    removed = []
    for path in dirs:
        iteration = iteration_of(path)
        torn_and_old = iteration < newest and not (path / RECORD).is_file()
        if (iteration in doomed or torn_and_old) and _remove_unless_read(path):
            removed.append(path)
    return removed


def _remove_unless_read(path: Path) -> bool:
    """Remove checkpoint ``path`` unless a tool reads it now (it holds it: an export or generate
    of a running run), which a later retention pass removes; True when removed."""
    try:
        fd = run_lock.open_locked(path, fcntl.LOCK_EX)
        if fd is None:
            return False
    except OSError:
        fd = None
    try:
        # The record goes first so a half-deleted directory reads as torn, not complete.
        (path / RECORD).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    finally:
        if fd is not None:
            os.close(fd)
    return True
