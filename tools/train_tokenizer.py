"""Train a SentencePiece tokenizer on a text corpus.

    python tools/train_tokenizer.py --input corpus.jsonl --output-prefix tok/spm --vocab-size 8192

Input as for preprocess_data.py: files, glob patterns and directories of jsonl (plain, .gz,
.zst), parquet and txt.

The model is lossless on any text (identity normalisation, whitespace kept, byte fallback), so
decode(encode(text)) == text, which code and multilingual data need. Exit codes: 0 done, 2 bad
input, or a model already under the prefix (it is never replaced).
"""

from __future__ import annotations

import argparse
import errno
import itertools
import os
import re
from collections.abc import Iterator
from pathlib import Path

# First: this checkout's package, which names a Python without the project's environment.
import use_checkout  # noqa: F401

# isort: split
import sentencepiece as spm

from megatron_train import cli
from megatron_train.errors import ConfigError, reason
from megatron_train.outputs import made_dir, output_prefix, publish
from megatron_train.text_sources import input_files, iter_texts

# SentencePiece rejects longer "sentences"; documents are fed in pieces of at most this size.
_MAX_PIECE_CHARS = 4000
_MAX_VOCAB = 2**31 - 1  # SentencePiece holds the size in an int32
# pad, unk, bos and eos; below this many SentencePiece fails on an internal check, naming no size.
_SPECIAL_PIECES = 4
_BYTES = 256


class _Pieces:
    """The texts in pieces SentencePiece accepts, up to ``limit`` of them. SentencePiece pulls them
    from C++, which would turn a bad corpus line's ConfigError into its own error: the error is
    kept here (``failure``) and the pieces end."""

    def __init__(self, texts: Iterator[str], limit: int) -> None:
        self.texts, self.limit = texts, limit
        self.failure: ConfigError | None = None

    def __iter__(self) -> Iterator[str]:
        seen = 0
        try:
            for text in self.texts:
                for start in range(0, len(text), _MAX_PIECE_CHARS):
                    if seen >= self.limit:
                        return
                    seen += 1
                    yield text[start : start + _MAX_PIECE_CHARS]
        except ConfigError as err:
            self.failure = err


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--input", type=cli.non_empty, required=True, nargs="+", help="files, glob patterns or directories"
    )
    parser.add_argument(
        "--output-prefix", type=cli.non_empty, required=True, help="writes PREFIX.model and PREFIX.vocab"
    )
    parser.add_argument("--vocab-size", type=cli.positive_int, default=8192)
    parser.add_argument("--text-key", default="text")
    parser.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument(
        "--max-sentences", type=cli.positive_int, default=2_000_000, help="training pieces cap"
    )
    args = parser.parse_args(argv)
    return cli.run(lambda: train(args))


def train(args: argparse.Namespace) -> None:
    if args.vocab_size > _MAX_VOCAB:
        raise ConfigError(
            "--vocab-size",
            f"{args.vocab_size} is beyond SentencePiece's int32",
            f"set it to at most {_MAX_VOCAB:,}",
        )
    if args.vocab_size < _SPECIAL_PIECES:
        raise ConfigError(
            "--vocab-size",
            f"{args.vocab_size} pieces cannot hold the {_SPECIAL_PIECES} special ones (pad, unk, bos, eos), "
            f"let alone the {_BYTES} bytes and each character of the text a lossless tokenizer needs",
            f"set it to at least {_SPECIAL_PIECES + _BYTES} plus the text's characters (default 8192)",
        )
    out = output_prefix("--output-prefix", args.output_prefix, (".model", ".vocab"))
    texts = iter_texts(input_files(args.input), args.text_key)
    first = next(texts, None)
    if first is None:
        verb = "holds" if len(args.input) == 1 else "hold"
        raise ConfigError("--input", f"{' '.join(args.input)} {verb} no documents", "point it at a corpus")
    texts = itertools.chain([first], texts)
    with made_dir(out.parent):
        # Trained under a temporary prefix, renamed at the end: a failure never touches an existing model.
        tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
        try:
            _train(texts, args, tmp)
            publish([(Path(f"{tmp}{s}"), Path(f"{out}{s}")) for s in (".model", ".vocab")], "--output-prefix")
        finally:
            for suffix in (".model", ".vocab"):
                Path(f"{tmp}{suffix}").unlink(missing_ok=True)
    cli.say(f"wrote {out}.model ({args.vocab_size} pieces)")


def _train(texts: Iterator[str], args: argparse.Namespace, prefix: Path) -> None:
    pieces = _Pieces(texts, args.max_sentences)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(pieces),
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
    # SentencePiece raises RuntimeError when the text cannot give this vocabulary, and ValueError
    # for an option it cannot parse.
    except (RuntimeError, ValueError) as err:
        if pieces.failure is None:
            if "output->Write" in str(err):
                # Its output files are open by then (the prefix was checked writable): a write
                # fails only for want of room.
                raise OSError(errno.ENOSPC, "SentencePiece could not write its model and vocabulary") from err
            raise _vocab_size_error(args.vocab_size, err) from err
    if pieces.failure is not None:
        raise pieces.failure


def _vocab_size_error(size: int, err: Exception) -> ConfigError:
    """SentencePiece's refusal of ``size`` as one line: its bound, when it names one, and the way
    past it."""
    message = str(err)
    if found := re.search(r"smaller than required_chars\. \d+ vs (\d+)", message):
        return ConfigError(
            "--vocab-size",
            f"{size} pieces cannot hold the {found[1]} this text requires (each of its characters, "
            "the 256 bytes and the special pieces, for a lossless tokenizer)",
            f"set --vocab-size to at least {found[1]}",
        )
    if found := re.search(r"too high \(\d+\)\. Please set it to a value <= (\d+)", message):
        return ConfigError(
            "--vocab-size",
            f"this text yields at most {found[1]} pieces, fewer than {size}",
            f"set --vocab-size to at most {found[1]}, or train on more text",
        )
    return ConfigError(
        "--vocab-size", f"SentencePiece refused to train: {reason(err)}", "change it or add text"
    )


if __name__ == "__main__":
    cli.exit_process(main())
