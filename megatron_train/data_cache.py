"""The dataset index cache megatron-core builds in ``data.cache_dir``: the files a cut-short build
left behind, and which datasets its indices were built from.

megatron names cached indices after the dataset's path, split, sequence length and seed, not its
contents. A dataset tokenized again under the same prefix would be read through indices built for
the old one: documents that no longer exist (an IndexError mid-run), or silently other samples
than the ones a resumed run would have read. So the cache records what each dataset was when its
indices were built, and a start against a changed one is refused.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy

from megatron_train import json_text
from megatron_train.checkpoint.files import write_atomic
from megatron_train.errors import ConfigError

RECORD = "datasets.json"
"""The cache's record of the datasets its indices were built from, by prefix as the blend writes it:
megatron's cache names hold that text, so a relative prefix met from another working directory
reuses the same indices, and must be the same dataset too."""

LOCK = "build.lock"
"""The file whose lock a run holds while it builds or reads indices in the cache (:func:`building`)."""

# Bytes read from each end of the .idx: its header and first sequence lengths, and its last
# document offsets. A blend of thousands of shards reads a few MB at every start, not its indices.
_SAMPLE = 16 * 1024


def identity(prefix: str) -> dict:
    """What distinguishes this dataset from another written under the same prefix: its files'
    sizes and a hash of both ends of its .idx (a copy elsewhere, or with other timestamps, is the
    same dataset)."""
    idx, data = Path(f"{prefix}.idx"), Path(f"{prefix}.bin")
    size = idx.stat().st_size
    with idx.open("rb") as f:
        sample = f.read(_SAMPLE)
        f.seek(max(size - _SAMPLE, len(sample)))
        sample += f.read()
    return {
        "bin_bytes": data.stat().st_size,
        "idx_bytes": size,
        "idx_ends_sha256": hashlib.sha256(sample).hexdigest(),
    }


def _recorded(cache_dir: Path) -> dict:
    # Not a file (a pipe, a link to a device): reading would block, or never end; the start
    # refuses it where the run writes its record (inputs.check_inputs).
    if not (cache_dir / RECORD).is_file():
        return {}
    try:
        found = json_text.loads((cache_dir / RECORD).read_text())
    except (OSError, ValueError):  # no record yet (or one a crash mangled): nothing to compare
        return {}
    if not isinstance(found, dict):
        return {}
    # An entry of another shape (edited by hand) is as good as none.
    return {prefix: entry for prefix, entry in found.items() if _is_identity(entry)}


def _is_identity(entry: object) -> bool:
    """Whether ``entry`` has the fields and types :func:`identity` gives."""
    return (
        isinstance(entry, dict)
        and all(type(entry.get(key)) is int for key in ("bin_bytes", "idx_bytes"))
        and isinstance(entry.get("idx_ends_sha256"), str)
    )


def built_from(cache_dir: str | Path) -> set[str]:
    """The dataset prefixes whose indices the cache in ``cache_dir`` holds."""
    return set(_recorded(Path(cache_dir)))


def check_unchanged(cache_dir: str | Path, prefixes: dict[str, str]) -> None:
    """Refuse a start whose cache holds indices built from another dataset at one of ``prefixes``
    (each with the option that names it)."""
    recorded = _recorded(Path(cache_dir))
    for prefix in prefixes:
        then = recorded.get(prefix)
        if then is None:
            continue
        now = identity(prefix)
        if now != then:
            sizes = (
                f".bin {then['bin_bytes']:,} bytes then, {now['bin_bytes']:,} now"
                if then["bin_bytes"] != now["bin_bytes"]
                else "files of the same size, other documents"
            )
            raise ConfigError(
                prefixes[prefix],
                f"{prefix} is not the dataset the index cache in {cache_dir} was built from ({sizes}): "
                "its cached indices would read documents of the old one",
                "restore that dataset to continue on the same data, or set data.cache_dir to a new "
                "folder to index this one (a resumed run then reads other samples than it would have)",
            )


def record(cache_dir: str | Path, prefixes: list[str]) -> None:
    """Note what each of ``prefixes`` is now, as the datasets this cache's indices come from."""
    cache_dir = Path(cache_dir)
    recorded = _recorded(cache_dir)
    now = {prefix: identity(prefix) for prefix in prefixes}
    if all(recorded.get(key) == value for key, value in now.items()):
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(cache_dir / RECORD, json.dumps({**recorded, **now}, indent=1, sort_keys=True) + "\n")


@contextlib.contextmanager
def building(cache_dir: str | Path, log: Callable[[str], None]) -> Iterator[None]:
    """Hold ``cache_dir`` while this run checks, builds and reads its indices there (rank 0 of
    the run; the other ranks read after it built).

    Runs may share a cache dir (a blend of thousands of shards takes minutes to index).
    megatron writes its index files in place, so a second run starting while the first builds
    would take the half-written files as torn and delete them, or write them again under the
    first run's readers. The lock is the kernel's advisory lock (flock) on :data:`LOCK`: it ends
    with the process however it ends. A file system without such locks builds unlocked.
    """
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    # A file of its own, not the folder: the cache dir may be the run dir, which run_lock holds.
    fd = os.open(cache_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"data cache: another run is building indices in {cache_dir}; waiting for it")
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # no locks on this file system
            pass
        yield
    finally:
        os.close(fd)


# Only megatron's own index files ("<hash>-GPTDataset-train-sample_index.npy"): the cache may be a
# folder that holds other arrays too.
_INDEX_FILES = "*Dataset-*_index.npy"


def check_no_folders(cache_dir: str | Path) -> None:
    """Refuse a start whose cache holds a folder under the name of an index file: megatron-core
    would take it for the file and fail reading it."""
    folder = next((p for p in sorted(Path(cache_dir).glob(_INDEX_FILES)) if p.is_dir()), None)
    if folder is not None:
        raise ConfigError(
            "data.cache_dir",
            f"{folder} is a folder under the name of an index file megatron-core keeps there",
            "remove it, or set data.cache_dir to another folder",
        )


def drop_torn_indices(cache_dir: str) -> list[Path]:
    """Delete the index files in ``cache_dir`` that are shorter than their header says (or are
    no files at all: a link to nowhere, a pipe), and return them. megatron writes its cached
    indices in place and takes the cache as built when all of a dataset's files exist, so a build
    cut short (a full disk, a job killed while writing the last file) would fail every later
    start; without the file it builds them again.
    Rank 0 calls this holding :func:`building`, before the build."""
    torn = []
    for path in sorted(Path(cache_dir).glob(_INDEX_FILES)):
        if path.is_dir():  # refused at the start (check_no_folders)
            continue
        if not path.is_file():
            # A link that leads nowhere, or to a pipe or device (reading a pipe would block the
            # start for good): no index file, whatever its name says.
            path.unlink()
            torn.append(path)
            continue
        try:
            numpy.load(path, mmap_mode="r")
        except (ValueError, EOFError):
            path.unlink(missing_ok=True)
            torn.append(path)
    return torn
