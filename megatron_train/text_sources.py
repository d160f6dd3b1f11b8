"""Read documents from jsonl, parquet, plain-text files or any ``datasets``-loadable source."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import datasets

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def load_documents(source: str, text_key: str = "text", split: str = "train") -> datasets.Dataset:
    """A Dataset with a ``text_key`` column from a file, a directory or a hub name.

    Files are read with the ``datasets`` builder for their extension; anything else is passed
    to ``datasets.load_dataset`` as is (a local dataset directory, or a hub name when online).
    """
    path = Path(source)
    if path.is_file():
        builder = _BUILDERS.get(path.suffix)
        if builder is None:
            raise ValueError(f"{source}: unknown file type; use .jsonl, .json, .parquet or .txt")
        ds = datasets.load_dataset(builder, data_files=str(path), split=split)
    elif path.is_dir() or not (source.startswith((".", "/", "~")) or path.suffix in _BUILDERS):
        ds = datasets.load_dataset(source, split=split)
    else:
        raise FileNotFoundError(f"{source}: no such file or directory")
    if text_key not in ds.column_names:
        raise ValueError(f"{source}: no column {text_key!r} (columns: {ds.column_names})")
    return ds


def iter_texts(ds: datasets.Dataset, text_key: str = "text") -> Iterator[str]:
    """The non-empty texts of a Dataset, in order."""
    for row in ds.select_columns([text_key]):
        text = row[text_key]
        if text:
            yield text
