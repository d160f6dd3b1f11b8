"""Tokenize a corpus into megatron indexed datasets (PREFIX.bin + PREFIX.idx).

    python tools/preprocess_data.py --input 'corpus/*.jsonl.zst' more/ one.parquet \\
        --output-prefix data/corpus --tokenizer-type sentencepiece --tokenizer tok/spm.model
    python tools/preprocess_data.py --input corpus/ --output-dir data/shards ...   # one per input file

Input: files, glob patterns and directories of jsonl (plain, .gz, .zst), parquet and txt (one
document per line), streamed in order without a copy. ``--text-key`` names the text field (a
dotted path such as ``meta.body`` reaches into nested objects). Empty and null texts are skipped
and counted. Documents are tokenized a batch at a time with the tokenizer library's own threads
(``--workers`` in all, at most the CPU cores the tool may run on); text never produces a special
token (a literal ``<s>`` is text). Each document is followed by the tokenizer's end-of-document
token (EOD, the id megatron-core's tokenizer calls ``eod``) and written in megatron-core's indexed
dataset format, one sequence per document.

``--output-prefix`` writes one dataset, never over an existing one. ``--output-dir`` writes one
per input file (named after its path below the inputs' common folder), several files at a time; a
run that stops or fails keeps the datasets it finished, and running it again writes only the
missing ones.
``tools/merge_datasets.py`` joins them into one. A dataset appears only when complete (written
under temporary names, the .idx renamed last, by one process at a time); a failed dataset leaves
nothing behind. Exit codes:
0 done, 2 bad input.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Iterable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import astuple, dataclass, replace
from pathlib import Path

# First: this checkout's package, which names a Python without the project's environment.
import use_checkout  # noqa: F401

# isort: split
import numpy as np
from tqdm import tqdm

from megatron_train import cli
from megatron_train.errors import ConfigError, Failure
from megatron_train.outputs import (
    check_own_dir,
    dataset_files,
    discard_partial_dataset,
    made_dir,
    name_room,
    output_prefix,
)
from megatron_train.text_encoding import Encode, text_encoder
from megatron_train.text_sources import SUFFIXES, input_files, read_texts
from megatron_train.token_writer import TokenWriter, token_dtype


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--input", type=cli.non_empty, required=True, nargs="+", help="files, glob patterns or directories"
    )
    out = parser.add_mutually_exclusive_group(required=True)
    out.add_argument("--output-prefix", type=cli.non_empty, help="one dataset: PREFIX.bin and PREFIX.idx")
    out.add_argument("--output-dir", type=cli.non_empty, help="one dataset per input file in this folder")
    parser.add_argument("--tokenizer-type", choices=["sentencepiece", "huggingface"], default="sentencepiece")
    parser.add_argument(
        "--tokenizer", type=cli.non_empty, required=True, help="SentencePiece .model or HF directory"
    )
    parser.add_argument("--text-key", default="text", help="the text field; a.b for a nested one")
    parser.add_argument(
        "--workers", type=cli.positive_int, default=len(os.sched_getaffinity(0)), help="threads in all"
    )
    parser.add_argument("--batch-size", type=cli.positive_int, default=1024, help="documents per batch")
    args = parser.parse_args(argv)
    return cli.run(lambda: preprocess(args))


@dataclass
class Counts:
    """What a dataset was written from."""

    docs: int = 0
    empty: int = 0
    tokens: int = 0
    bytes: int = 0

    def __add__(self, other: Counts) -> Counts:
        return Counts(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))


@dataclass(frozen=True)
class Job:
    """How to tokenize: the tool's arguments that every dataset shares."""

    tokenizer_type: str
    tokenizer: str
    text_key: str
    batch_size: int
    eod: int
    dtype: np.dtype
    threads: int


def check_counts(workers: int, batch_size: int) -> None:
    """Refuse more threads than the CPU cores this process may run on (its affinity, which Slurm's
    --cpus-per-task narrows; two pass on one core, as the demo's do): the tokenizers start them all
    at once (HF: 10,000 took a minute to tokenize 20 documents, 2**31 had not ended after one). And a
    batch past what Python can slice."""
    cores = len(os.sched_getaffinity(0))
    most = max(cores, 2)
    if workers > most:
        raise ConfigError(
            "--workers",
            f"is {workers:,}, more threads than the {cores} CPU core{'s' * (cores != 1)} this process "
            "may run on",
            f"set --workers to at most {most}",
        )
    if batch_size > sys.maxsize:
        raise ConfigError(
            "--batch-size",
            f"is {batch_size:,}, more documents than Python can slice",
            f"set --batch-size to at most {sys.maxsize:,} (the default is 1024)",
        )


def preprocess(args: argparse.Namespace) -> None:
    check_counts(args.workers, args.batch_size)
    if args.output_dir:
        out = Path(args.output_dir)
        check_own_dir("--output-dir", out)
    else:
        out = output_prefix("--output-prefix", args.output_prefix, (".bin", ".idx"))
    tokenizer = text_encoder(args.tokenizer_type, args.tokenizer, args.workers, key="--tokenizer")
    files = input_files(args.input)
    job = Job(
        args.tokenizer_type,
        args.tokenizer,
        args.text_key,
        args.batch_size,
        tokenizer.eod,
        token_dtype(tokenizer.vocab_size),
        args.workers,
    )
    start = time.perf_counter()
    if args.output_dir:
        counts, written = _write_shards(files, out, job)
    else:
        with made_dir(out.parent):
            texts = _texts(files, job.text_key)
            counts = write_dataset(
                out, "--output-prefix", texts, " ".join(args.input), tokenizer.encode, job, show_progress=True
            )
        written = f"{out}.bin/.idx"
    elapsed = time.perf_counter() - start
    cli.say(
        f"wrote {written} from {len(files)} file(s): {counts.docs} docs ({counts.empty} empty skipped), "
        f"{counts.tokens} tokens in {elapsed:.1f}s "
        f"({counts.docs / elapsed:.0f} docs/s, {counts.bytes / elapsed / 1e6:.2f} MB/s)"
    )


def _texts(files: list[Path], key: str) -> Iterable[str]:
    return itertools.chain.from_iterable(read_texts(path, key) for path in files)


def write_dataset(
    prefix: Path,
    key: str,
    texts: Iterable[str],
    source: str,
    encode: Encode,
    job: Job,
    show_progress: bool = False,
) -> Counts:
    """Tokenize ``texts`` (read from ``source``) with ``encode`` into ``prefix``.bin/.idx, which
    appear only once complete; ``key`` is the option that named the output."""
    counts = Counts()
    with dataset_files(prefix, key) as (tmp_bin, tmp_idx), open(tmp_bin, "wb") as bin_file:
        writer = TokenWriter(bin_file, job.dtype)
        bar = tqdm(unit="doc", desc="tokenizing", file=sys.stderr, disable=None if show_progress else True)
        texts, previous = iter(texts), None

        def write(encoded: Future, batch: list[str], documents: list[str]) -> Counts:
            ids = encoded.result()
            for doc in ids:
                doc.append(job.eod)
            bar.update(len(batch))
            text_bytes = sum(len(t.encode()) for t in documents)
            return Counts(len(documents), len(batch) - len(documents), writer.add(ids), text_bytes)

        # The tokenizers release the GIL: while one batch is encoded, the one before it is
        # written and the next one read.
        with ThreadPoolExecutor(1) as tokenizing:
            while batch := list(itertools.islice(texts, job.batch_size)):
                documents = [t for t in batch if t]
                current = (tokenizing.submit(encode, documents), batch, documents)
                if previous:
                    counts += write(*previous)
                previous = current
            if previous:
                counts += write(*previous)
        bar.close()
        if counts.docs == 0:
            raise ConfigError("--input", f"{source} holds no documents", "point it at a corpus")
        writer.write_index(tmp_idx)
    return counts


def shard_names(files: list[Path]) -> list[str]:
    """Each input file's dataset name: its path below the files' common folder, ``/`` as ``__``,
    without its suffix (``sub/c.jsonl.zst`` -> ``sub__c``)."""
    root = Path(os.path.commonpath([f.resolve().parent for f in files]))
    names = []
    for f in files:
        relative = f.resolve().relative_to(root).as_posix()
        suffix = next(s for s in SUFFIXES if relative.endswith(s))
        names.append(relative.removesuffix(suffix).replace("/", "__"))
    seen: dict[str, Path] = {}
    allowed = name_room((".bin", ".idx"))
    for f, name in zip(files, names, strict=True):
        if len(name.encode()) > allowed:
            # Found before any dataset is written, not when the worker reaches this file.
            raise ConfigError(
                "--input",
                f"{f} would be written as dataset {name[:30]!r}..., a name of {len(name.encode())} bytes, "
                f"more than the {allowed} the file system allows with the tool's endings",
                "move the deeply nested files to a shallower folder, or give them their own --output-prefix",
            )
        if name in seen:
            raise ConfigError(
                "--input", f"{seen[name]} and {f} would both be written as dataset {name!r}", "rename one"
            )
        seen[name] = f
    return names


def _write_shard(path: Path, prefix: Path, job: Job) -> Counts:
    # Each worker loads its own: a tokenizer does not pickle, and a forked Hugging Face one would
    # keep the parent's thread count.
    encode = text_encoder(job.tokenizer_type, job.tokenizer, job.threads).encode
    return write_dataset(prefix, "--output-dir", read_texts(path, job.text_key), str(path), encode, job)


def _as_worker() -> None:
    # Ctrl-C reaches every process of the terminal's group: the main process alone stops the run.
    # SIGTERM (Slurm sends it to every process of the job) ends a worker at once, without the
    # tool's handler it forked with; the main process removes what the worker had begun.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _write_shards(files: list[Path], out: Path, job: Job) -> tuple[Counts, str]:
    prefixes = [out / name for name in shard_names(files)]
    todo = [(f, p) for f, p in zip(files, prefixes, strict=True) if not p.with_name(p.name + ".idx").exists()]
    if len(todo) < len(files):
        done = len(files) - len(todo)
        cli.say(f"{done} of {len(files)} datasets already written in {out}; writing the rest")
    jobs = max(1, min(len(todo), job.threads))
    shard_job = replace(job, threads=max(1, job.threads // jobs))
    counts, created = Counts(), not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    # fork: the workers start at once, with everything this process has imported.
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"), initializer=_as_worker)
    with pool:
        futures = [pool.submit(_write_shard, f, p, shard_job) for f, p in todo]
        try:
            for future in tqdm(futures, unit="file", desc="datasets", file=sys.stderr, disable=None):
                counts += future.result()
        except BaseException as err:
            # Waiting for the files being written (and those queued behind them) would take as long
            # as they do, past Slurm's grace between SIGTERM and SIGKILL.
            for worker in multiprocessing.active_children():
                worker.terminate()
            pool.shutdown(cancel_futures=True)
            for _, prefix in todo:
                discard_partial_dataset(prefix)
            # Finished datasets stay for the next run; a folder this run made and left empty goes.
            if created and not any(out.iterdir()):
                out.rmdir()
            if isinstance(err, BrokenProcessPool):
                kept = sum(p.with_name(p.name + ".idx").exists() for _, p in todo)
                raise Failure(
                    "a worker process ended abruptly while writing the datasets (killed: the kernel's "
                    f"out-of-memory killer is the usual one, as `dmesg` shows); the datasets it finished "
                    f"({kept}) are kept. Fix: run it again, with fewer --workers if memory ran out"
                ) from None
            raise
    return counts, f"{len(todo)} dataset(s) in {out}"


if __name__ == "__main__":
    cli.exit_process(main())
