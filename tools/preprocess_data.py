"""Tokenize a corpus into a megatron indexed dataset (PREFIX.bin + PREFIX.idx).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        --tokenizer-type sentencepiece --tokenizer tok/spm.model --workers 4

Input: jsonl, parquet, txt or anything ``datasets.load_dataset`` reads. Each document is
tokenized, an end-of-document token is appended, and the result is written with
megatron-core's IndexedDatasetBuilder. Output appears only when complete (written under a
temporary name, then renamed).
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--input", required=True)
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--tokenizer-type", choices=["sentencepiece", "huggingface"], default="sentencepiece")
    parser.add_argument("--tokenizer", required=True, help="SentencePiece .model or HF directory")
    parser.add_argument("--text-key", default="text")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--batch-size", type=int, default=64, help="documents per worker task")
    args = parser.parse_args(argv)

    try:
        if not Path(args.tokenizer).exists():
            raise FileNotFoundError(f"tokenizer {args.tokenizer} does not exist")
        ds = load_documents(args.input, args.text_key)
        tokenizer = load_tokenizer(args.tokenizer_type, args.tokenizer)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    dtype = np.uint16 if tokenizer.vocab_size < 65_500 else np.int32
    out = Path(args.output_prefix)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_bin, tmp_idx = out.with_name(out.name + ".bin.tmp"), out.with_name(out.name + ".idx.tmp")
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
    builder.finalize(str(tmp_idx))
    os.replace(tmp_bin, out.with_name(out.name + ".bin"))
    os.replace(tmp_idx, out.with_name(out.name + ".idx"))
    elapsed = time.perf_counter() - start
    print(
        f"wrote {out}.bin/.idx: {n_docs} docs, {n_tokens} tokens in {elapsed:.1f}s "
        f"({n_docs / elapsed:.0f} docs/s, {n_bytes / elapsed / 1e6:.2f} MB/s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
