"""Train a SentencePiece tokenizer on a text corpus.

    python tools/train_tokenizer.py --input corpus.jsonl --output-prefix tok/spm --vocab-size 8192

The model is lossless on any text (identity normalisation, whitespace kept, byte fallback), so
decode(encode(text)) == text, which code and multilingual data need. Exit codes: 0 done, 2 bad
input (an existing model under the prefix is left as it was).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import sentencepiece as spm

from megatron_train import cli
from megatron_train.errors import ConfigError
from megatron_train.inputs import check_output_dir
from megatron_train.outputs import made_dir
from megatron_train.text_sources import iter_texts, load_documents

# SentencePiece rejects longer "sentences"; documents are fed in pieces of at most this size.
_MAX_PIECE_CHARS = 4000


def _pieces(texts, limit: int):
    seen = 0
    for text in texts:
        for start in range(0, len(text), _MAX_PIECE_CHARS):
            if seen >= limit:
                return
            seen += 1
            yield text[start : start + _MAX_PIECE_CHARS]


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__)
    parser.add_argument("--input", required=True, help="jsonl/parquet/txt file or datasets name")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--vocab-size", type=cli.positive_int, default=8192)
    parser.add_argument("--text-key", default="text")
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument(
        "--max-sentences", type=cli.positive_int, default=2_000_000, help="training pieces cap"
    )
    args = parser.parse_args(argv)
    return cli.run(lambda: train(args))


def train(args: argparse.Namespace) -> None:
    out = Path(args.output_prefix)
    check_output_dir("--output-prefix", out.parent)
    ds = load_documents(args.input, args.text_key)
    with made_dir(out.parent):
        # Trained under a temporary prefix, renamed at the end: a failure never touches an existing model.
        tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
        try:
            _train(iter_texts(ds, args.text_key), args, tmp)
            for suffix in (".model", ".vocab"):
                os.replace(f"{tmp}{suffix}", f"{out}{suffix}")
        finally:
            for suffix in (".model", ".vocab"):
                Path(f"{tmp}{suffix}").unlink(missing_ok=True)
    print(f"wrote {out}.model ({args.vocab_size} pieces)")


def _train(texts, args: argparse.Namespace, prefix: Path) -> None:
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_pieces(texts, args.max_sentences),
            model_prefix=str(prefix),
            vocab_size=args.vocab_size,
            model_type=args.model_type,
            character_coverage=1.0,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            max_sentence_length=_MAX_PIECE_CHARS * 4,
            pad_id=0, unk_id=1, bos_id=2, eos_id=3,
            num_threads=2,
            minloglevel=2,
        )  # fmt: skip
    except RuntimeError as err:  # SentencePiece's only error type: the text cannot give this vocabulary
        reason = " ".join(str(err).split())
        raise ConfigError(
            "--vocab-size", f"SentencePiece refused to train: {reason}", "lower it or add text"
        ) from err


if __name__ == "__main__":
    sys.exit(main())
