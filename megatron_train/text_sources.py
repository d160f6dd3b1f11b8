"""Documents streamed from corpus files: jsonl (plain, .gz or .zst), parquet and plain text, named
one by one, by glob or by directory.

Nothing is copied or cached: each file is read front to back as its documents are asked for.
A document is one JSON line's (or parquet row's) text field, or one line of a ``.txt`` file.
Problems are reported as ConfigError naming the file and line (or row), and the key to fix.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow
import pyarrow.parquet as pq
import zstandard

from megatron_train import json_text
from megatron_train.errors import ConfigError, denied, missing, reason

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".parquet", ".txt")
_PARQUET_ROWS_PER_BATCH = 1024


def _kind(path: Path) -> str | None:
    name = path.name
    return next((s for s in SUFFIXES if name.endswith(s)), None)


def _files_under(directory: Path) -> list[Path]:
    """The corpus files below ``directory`` (links to folders not followed). A folder or file it
    cannot look into is an error: ``Path.rglob`` passes over it without a word, and the dataset
    would lack its documents."""

    def refuse(err: OSError) -> None:
        raise ConfigError(
            "--input",
            f"{err.filename} below {directory} could not be read ({err.strerror})",
            "make it readable to this user, or name the files and folders to take",
        ) from err

    found = []
    for folder, _, names in os.walk(directory, onerror=refuse):
        for path in (Path(folder, name) for name in names if _kind(Path(name))):
            try:
                if path.is_file():
                    found.append(path)
            except OSError as err:
                refuse(err)
    return sorted(found)


def input_files(specs: list[str]) -> list[Path]:
    """The corpus files that ``specs`` name: files, glob patterns (``**`` recurses) and directories
    (every file with a known suffix below them), each in sorted order, every file once."""
    found: dict[Path, None] = {}
    for spec in specs:
        path = Path(spec)
        if glob.has_magic(spec):
            matches = [Path(p) for p in sorted(glob.glob(spec, recursive=True))]
            files = [p for p in matches if p.is_file() and _kind(p)]
            if not files:
                raise ConfigError(
                    "--input", f"{spec} matches no {', '.join(SUFFIXES)} file", "fix the pattern"
                )
        elif path.is_dir():
            files = _files_under(path)
            if not files:
                raise ConfigError(
                    "--input", f"{spec} holds no {', '.join(SUFFIXES)} file", "point it at a corpus"
                )
        elif path.is_file():
            if not _kind(path):
                raise ConfigError(
                    "--input", f"{spec}: unknown file type", f"use one of {', '.join(SUFFIXES)}"
                )
            files = [path]
        elif path.exists():
            # A pipe or a device: its suffix cannot say what it holds, nor can it be read twice.
            raise ConfigError(
                "--input",
                f"{spec} is neither a file nor a directory (a pipe, socket or device)",
                "write the corpus to a file first and name that file",
            )
        else:
            raise ConfigError("--input", f"{spec} {missing(spec)}", "point it at a corpus file or directory")
        found.update(dict.fromkeys(files))
    return list(found)


_JSON_NAMES = {
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def _field(record: object, key: str, where: str) -> object:
    """``record[key]``, where a dotted key (``meta.body``) walks into nested objects unless the
    record has the dotted name itself."""
    if not isinstance(record, dict):
        raise ConfigError(
            "--input",
            f"{where} is a JSON {_JSON_NAMES.get(type(record), 'value')}, not an object with a {key!r} field",
            'make each line an object such as {"text": "..."}, or remove that line',
        )
    if key in record:
        return record[key]
    value = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ConfigError("--text-key", f"{where} has no field {key!r}", f"use one of {sorted(record)}")
        value = value[part]
    return value


def _text(value: object, key: str, where: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        # A JSON integer longer than Python reads as an int arrives as a float: both are a number.
        kind = "a number" if type(value) in (int, float) else type(value).__name__
        raise ConfigError(
            "--text-key", f"{where}: field {key!r} holds {kind}, not a string", "name a text field"
        )
    return value


def _encodable(text: str) -> bool:
    """Whether ``text`` has a UTF-8 form: JSON's ``\\uXXXX`` escapes can spell half a surrogate
    pair, which Python keeps but no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# utf-8-sig: files saved by Windows tools (PowerShell 5's Out-File, Notepad) start with a byte
# order mark, which is no part of the first document.
_ENCODING = "utf-8-sig"


def _open_text(path: Path) -> io.TextIOBase:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding=_ENCODING)
    if path.name.endswith(".zst"):
        raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
        return io.TextIOWrapper(raw, encoding=_ENCODING)
    return open(path, encoding=_ENCODING)


def _json_integer(digits: str) -> int | float:
    """A JSON integer; one longer than Python turns into an int (4300 digits) as a float, which
    JSON allows a reader: only the text field is read, and the line's other fields may hold
    anything."""
    return int(digits) if len(digits.lstrip("-")) <= sys.get_int_max_str_digits() else float(digits)


def _json_lines(path: Path, key: str) -> Iterator[str]:
    with _open_text(path) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                record = json_text.loads(line, parse_int=_json_integer)
            except json.JSONDecodeError as err:
                raise ConfigError(
                    "--input", f"{where} is not JSON ({err})", "fix or remove that line"
                ) from err
            text = _text(_field(record, key, where), key, where)
            if "\\u" in line and not _encodable(text):
                raise ConfigError(
                    "--input",
                    f"{where}: field {key!r} holds a lone surrogate (such as \\ud800), not text",
                    "fix or remove that line",
                )
            yield text


def _parquet_rows(path: Path, key: str) -> Iterator[str]:
    table = pq.ParquetFile(path)
    column = key if key in table.schema_arrow.names else key.split(".")[0]
    if column not in table.schema_arrow.names:
        raise ConfigError(
            "--text-key", f"{path} has no column {column!r}", f"use one of {table.schema_arrow.names}"
        )
    row = 0
    for batch in table.iter_batches(batch_size=_PARQUET_ROWS_PER_BATCH, columns=[column]):
        for value in batch.column(0).to_pylist():
            row += 1
            where = f"{path} row {row}"
            if column != key:
                value = _field({column: value}, key, where)
            yield _text(value, key, where)


def _text_lines(path: Path) -> Iterator[str]:
    with _open_text(path) as lines:
        for line in lines:
            yield line.rstrip("\n")


def read_texts(path: Path, key: str = "text") -> Iterator[str]:
    """Every document's text in ``path``, in order; an empty or null text is yielded as ``""``."""
    kind = _kind(path)
    try:
        if kind == ".parquet":
            yield from _parquet_rows(path, key)
        elif kind == ".txt":
            yield from _text_lines(path)
        else:
            yield from _json_lines(path, key)
    except (OSError, UnicodeDecodeError, EOFError, zstandard.ZstdError, pyarrow.ArrowException) as err:
        if denied(err):
            raise
        raise ConfigError(
            "--input", f"{path} could not be read ({reason(err)})", "fix or replace the file"
        ) from err


def iter_texts(files: list[Path], key: str = "text") -> Iterator[str]:
    """The non-empty texts of ``files``, file after file."""
    for path in files:
        yield from (text for text in read_texts(path, key) if text)
