"""Train a SentencePiece tokenizer on a text corpus.

    python tools/train_tokenizer.py --input corpus.jsonl --output-prefix tok/spm --vocab-size 8192

The model is lossless on any text (identity normalisation, whitespace kept, byte fallback), so
decode(encode(text)) == text, which code and multilingual data need.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import sentencepiece as spm

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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--input", required=True, help="jsonl/parquet/txt file or datasets name")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--text-key", default="text")
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument("--max-sentences", type=int, default=2_000_000, help="training pieces cap")
    args = parser.parse_args(argv)

    try:
        ds = load_documents(args.input, args.text_key)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=_pieces(iter_texts(ds, args.text_key), args.max_sentences),
        model_prefix=args.output_prefix,
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
    print(f"wrote {args.output_prefix}.model ({args.vocab_size} pieces)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
