"""Tokenize a corpus into a megatron indexed dataset (PREFIX.bin + PREFIX.idx).

    python tools/preprocess_data.py --input 'corpus/*.jsonl.zst' more/ one.parquet \
        --output-prefix data/corpus --tokenizer-type sentencepiece --tokenizer tok/spm.model

Input: files, glob patterns and directories of jsonl (plain, .gz, .zst), parquet and txt (one
document per line), streamed in order without a copy. ``--text-key`` names the text field (a
dotted path such as ``meta.body`` reaches into nested objects). Empty and null texts are skipped
and counted. Documents are tokenized a batch at a time with the tokenizer library's own
``--workers`` threads; text never produces a special token (a literal ``<s>`` is text). Each
document is followed by the tokenizer's end-of-document token (EOD) and written with
megatron-core's IndexedDatasetBuilder. Output appears only when complete (written under a
temporary name, then renamed); a failed run leaves nothing behind. Exit codes: 0 done, 2 bad input.
"""

from __future__ import annotations

import argparse
import itertools
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
from megatron_train.text_encoding import text_encoder
from megatron_train.text_sources import input_files, read_texts


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__)
    parser.add_argument("--input", required=True, nargs="+", help="files, glob patterns or directories")
    parser.add_argument("--output-prefix", required=True)
    parser.add_argument("--tokenizer-type", choices=["sentencepiece", "huggingface"], default="sentencepiece")
    parser.add_argument("--tokenizer", required=True, help="SentencePiece .model or HF directory")
    parser.add_argument("--text-key", default="text", help="the text field; a.b for a nested one")
    parser.add_argument(
        "--workers", type=cli.positive_int, default=os.cpu_count() or 1, help="tokenizer threads"
    )
    parser.add_argument("--batch-size", type=cli.positive_int, default=1024, help="documents per batch")
    args = parser.parse_args(argv)
    return cli.run(lambda: preprocess(args))


def preprocess(args: argparse.Namespace) -> None:
    out = Path(args.output_prefix)
    check_output_dir("--output-prefix", out.parent)
    tokenizer = checked_tokenizer(args.tokenizer_type, args.tokenizer, key="--tokenizer")
    files = input_files(args.input)
    dtype = np.uint16 if tokenizer.vocab_size < 65_500 else np.int32
    tmp_bin, tmp_idx = out.with_name(out.name + ".bin.tmp"), out.with_name(out.name + ".idx.tmp")
    with made_dir(out.parent):
        try:
            counts = _write(files, args, tokenizer.eod, dtype, tmp_bin, tmp_idx)
            os.replace(tmp_bin, out.with_name(out.name + ".bin"))
            os.replace(tmp_idx, out.with_name(out.name + ".idx"))
        finally:
            tmp_bin.unlink(missing_ok=True)
            tmp_idx.unlink(missing_ok=True)
    n_docs, n_empty, n_tokens, n_bytes, elapsed = counts
    print(
        f"wrote {out}.bin/.idx from {len(files)} file(s): {n_docs} docs ({n_empty} empty skipped), "
        f"{n_tokens} tokens in {elapsed:.1f}s "
        f"({n_docs / elapsed:.0f} docs/s, {n_bytes / elapsed / 1e6:.2f} MB/s)"
    )


def _write(
    files: list[Path], args: argparse.Namespace, eod: int, dtype, tmp_bin: Path, tmp_idx: Path
) -> tuple:
    encode = text_encoder(args.tokenizer_type, args.tokenizer, args.workers)
    builder = IndexedDatasetBuilder(str(tmp_bin), dtype=dtype)
    start, n_docs, n_empty, n_bytes, n_tokens = time.perf_counter(), 0, 0, 0, 0
    bar = tqdm(unit="doc", desc="tokenizing", file=sys.stderr, disable=None)  # shown on a terminal only
    texts = itertools.chain.from_iterable(read_texts(path, args.text_key) for path in files)
    while batch := list(itertools.islice(texts, args.batch_size)):
        documents = [t for t in batch if t]
        n_empty += len(batch) - len(documents)
        for ids in encode(documents):
            ids.append(eod)
            builder.add_item(torch.from_numpy(np.asarray(ids, dtype=dtype)))
            builder.end_document()
            n_tokens += len(ids)
        n_docs += len(documents)
        n_bytes += sum(len(t.encode()) for t in documents)
        bar.update(len(batch))
    bar.close()
    if n_docs == 0:
        raise ConfigError("--input", f"{' '.join(args.input)} hold no documents", "point it at a corpus")
    builder.finalize(str(tmp_idx))
    return n_docs, n_empty, n_tokens, n_bytes, time.perf_counter() - start


if __name__ == "__main__":
    sys.exit(main())
