"""Tokenize a corpus into a megatron indexed dataset (PREFIX.bin + PREFIX.idx).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type sentencepiece --tokenizer tok/spm.model --workers 4

Input: jsonl, parquet, txt or anything ``datasets.load_dataset`` reads. Each document is
tokenized, an end-of-document token is appended, and the result is written with
megatron-core's IndexedDatasetBuilder. Output appears only when complete (written under a
temporary name, then renamed); a failed run leaves nothing behind. Exit codes: 0 done, 2 bad input.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from tqdm import tqdm

from megatron_train import cli
from megatron_train.errors import ConfigError
from megatron_train.inputs import check_output_dir, checked_tokenizer
from megatron_train.outputs import made_dir
from megatron_train.text_sources import load_documents
from megatron_train.tokenizer import load_tokenizer

_tokenizer = None


def _init_worker(kind: str, path: str) -> None:
    global _tokenizer
    _tokenizer = load_tokenizer(kind, path)


def _encode(texts: list[str]) -> tuple[list[np.ndarray], int]:
    docs = [np.asarray(_tokenizer.tokenize(t) + [_tokenizer.eod], dtype=np.int32) for t in texts]
    return docs, sum(len(t.encode()) for t in texts)


def _batches(ds, text_key: str, size: int):
    for start in range(0, len(ds), size):
        texts = [t for t in ds[start : start + size][text_key] if t]
        if texts:
            yield texts


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__)
    parser.add_argument("--input", required=True)
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--tokenizer-type", choices=["sentencepiece", "huggingface"], default="sentencepiece")
    parser.add_argument("--tokenizer", required=True, help="SentencePiece .model or HF directory")
    parser.add_argument("--text-key", default="text")
    parser.add_argument("--workers", type=cli.positive_int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--batch-size", type=cli.positive_int, default=64, help="documents per worker task")
    args = parser.parse_args(argv)
    return cli.run(lambda: preprocess(args))


def preprocess(args: argparse.Namespace) -> None:
    out = Path(args.output_prefix)
    check_output_dir("--output-prefix", out.parent)
    tokenizer = checked_tokenizer(args.tokenizer_type, args.tokenizer, key="--tokenizer")
    ds = load_documents(args.input, args.text_key)
    dtype = np.uint16 if tokenizer.vocab_size < 65_500 else np.int32
    tmp_bin, tmp_idx = out.with_name(out.name + ".bin.tmp"), out.with_name(out.name + ".idx.tmp")
    with made_dir(out.parent):
        try:
            counts = _write(ds, args, dtype, tmp_bin, tmp_idx)
            os.replace(tmp_bin, out.with_name(out.name + ".bin"))
            os.replace(tmp_idx, out.with_name(out.name + ".idx"))
        finally:
            tmp_bin.unlink(missing_ok=True)
            tmp_idx.unlink(missing_ok=True)
    n_docs, n_tokens, n_bytes, elapsed = counts
    print(
        f"wrote {out}.bin/.idx: {n_docs} docs, {n_tokens} tokens in {elapsed:.1f}s "
        f"({n_docs / elapsed:.0f} docs/s, {n_bytes / elapsed / 1e6:.2f} MB/s)"
    )


def _write(ds, args: argparse.Namespace, dtype, tmp_bin: Path, tmp_idx: Path) -> tuple[int, int, int, float]:
    builder = IndexedDatasetBuilder(str(tmp_bin), dtype=dtype)
    start, n_docs, n_bytes, n_tokens = time.perf_counter(), 0, 0, 0
    ctx = mp.get_context("spawn")
    with ctx.Pool(args.workers, _init_worker, (args.tokenizer_type, args.tokenizer)) as pool:
        bar = tqdm(total=len(ds), unit="doc", desc="tokenizing", file=sys.stderr)
        for docs, size in pool.imap(_encode, _batches(ds, args.text_key, args.batch_size)):
            for doc in docs:
                builder.add_item(torch.from_numpy(doc))
                builder.end_document()
                n_tokens += len(doc)
            n_docs += len(docs)
            n_bytes += size
            bar.update(len(docs))
        bar.close()
    if n_docs == 0:
        raise ConfigError("--input", f"{args.input} has only empty texts", "point it at a corpus")
    builder.finalize(str(tmp_idx))
    return n_docs, n_tokens, n_bytes, time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
