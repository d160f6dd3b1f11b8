"""Read documents from jsonl, parquet, plain-text files or any ``datasets``-loadable source."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import datasets

from megatron_train.errors import ConfigError

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


@contextmanager
def _quiet() -> Iterator[None]:
    """datasets' progress bars and its own logging of a bad file (a traceback) are held back: a
    file that cannot be read is reported once, as a ConfigError."""
    verbosity, bars = datasets.logging.get_verbosity(), datasets.is_progress_bar_enabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def load_documents(source: str, text_key: str = "text", split: str = "train") -> datasets.Dataset:
    """A Dataset with a string ``text_key`` column and at least one row, from a file, a directory
    or a hub name; ConfigError (``--input`` / ``--text-key``) for anything else.

    Files are read with the ``datasets`` builder for their extension; anything else is passed
    to ``datasets.load_dataset`` as is (a local dataset directory, or a hub name when online).
    """
    path = Path(source)
    if path.is_file():
        builder = _BUILDERS.get(path.suffix)
        if builder is None:
            raise ConfigError(
                "--input", f"{source}: unknown file type", "use .jsonl, .json, .parquet or .txt"
            )
        if path.stat().st_size == 0:
            raise ConfigError("--input", f"{source} is empty: no documents", "point it at a corpus")
        args, kwargs = (builder,), {"data_files": str(path)}
    elif path.is_dir() or not (source.startswith((".", "/", "~")) or path.suffix in _BUILDERS):
        args, kwargs = (source,), {}
    else:
        raise ConfigError("--input", f"{source} does not exist", "point it at a corpus file or dataset")
    try:
        with _quiet():
            ds = datasets.load_dataset(*args, split=split, **kwargs)
    except Exception as err:  # datasets and pyarrow raise many kinds on unreadable input
        reason = " ".join(str(err).split())[:300] or type(err).__name__
        raise ConfigError(
            "--input", f"{source} could not be read as a corpus ({reason})", "fix the file"
        ) from err
    if text_key not in ds.column_names:
        raise ConfigError(
            "--text-key", f"{source} has no column {text_key!r}", f"use one of {ds.column_names}"
        )
    feature = ds.features[text_key]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise ConfigError(
            "--text-key",
            f"column {text_key!r} of {source} holds {feature}, not a string",
            "name a text column",
        )
    if len(ds) == 0:
        raise ConfigError("--input", f"{source} holds no documents", "point it at a corpus")
    return ds


def iter_texts(ds: datasets.Dataset, text_key: str = "text") -> Iterator[str]:
    """The non-empty texts of a Dataset, in order."""
    for row in ds.select_columns([text_key]):
        text = row[text_key]
        if text:
            yield text
