"""Raw text to token ids for pretraining data, a batch at a time with the tokenizer library's own
threads, never reading a control token out of the text.

A corpus is text: a literal ``<s>``, ``</s>``, ``<|begin_of_text|>`` or ``<unk>`` in it is text
too. Hugging Face tokenizers match their special tokens' strings in the input unless told not
to (``encode_special_tokens``); SentencePiece never produces control symbols from text. Each
document's end-of-document token (``eod``: the same id megatron-core's tokenizer calls ``eod``,
which training masks documents by) is appended by the caller. A SentencePiece BPE model encodes
long texts in parts where that gives the same ids, which is faster (``sentencepiece_cuts``).

The tokenizers are loaded without megatron-core (and SentencePiece without torch): preprocessing
is bound by the tokenizer, and those imports would be most of a small job's time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import sentencepiece

from megatron_train.errors import ConfigError, check_readable, denied, missing, reason
from megatron_train.sentencepiece_cuts import bpe_cutter

Encode = Callable[[list[str]], list[list[int]]]


@dataclass(frozen=True)
class TextEncoder:
    """A tokenizer as preprocessing needs it."""

    encode: Encode
    """A batch of texts to their token ids; no special token added or read from the text."""
    eod: int
    """The end-of-document id appended to each document."""
    vocab_size: int
    """Every id is below it."""


def _sentencepiece(path: str, threads: int) -> tuple[Encode, int | None, int]:
    processor = sentencepiece.SentencePieceProcessor(model_file=path)
    eod = processor.eos_id()
    cuts = bpe_cutter(processor.serialized_model_proto())
    if cuts is None:

        def encode(texts: list[str]) -> list[list[int]]:
            return processor.encode(texts, out_type=int, num_threads=threads)

    else:
        model, cut = cuts
        parts_processor = sentencepiece.SentencePieceProcessor(model_proto=model)

        def encode(texts: list[str]) -> list[list[int]]:
            parts = [cut(text) for text in texts]
            flat = [part for text_parts in parts for part in text_parts]
            ids = iter(parts_processor.encode(flat, out_type=int, num_threads=threads))
            docs = []
            for text_parts in parts:
                doc = next(ids)
                for _ in range(len(text_parts) - 1):
                    doc += next(ids)
                docs.append(doc)
            return docs

    return encode, None if eod < 0 else eod, processor.get_piece_size()


def _huggingface(path: str, threads: int) -> tuple[Encode, int | None, int]:
    # The Rust thread pool reads its size once, when it first runs: set here, before any encoding,
    # it gives each of preprocessing's forked shard writers its own share of the threads.
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    from transformers import AutoTokenizer

    # transformers, not tokenizer.json alone: its tokenizer classes may rebuild the pipeline on
    # load, and training reads the data with the tokenizer they give.
    tokenizer = AutoTokenizer.from_pretrained(path)
    backend = tokenizer.backend_tokenizer
    backend.encode_special_tokens = True

    def encode(texts: list[str]) -> list[list[int]]:
        # The fast variant skips the character offsets, which ids do not need.
        return [e.ids for e in backend.encode_batch_fast(texts, add_special_tokens=False)]

    return encode, tokenizer.eos_token_id, len(tokenizer)


@contextlib.contextmanager
def tokenizer_loading(kind: str, path: str, key: str, type_key: str) -> Iterator[None]:
    """Around loading the ``kind`` tokenizer at ``path``: a missing path, or any failure of the
    body, is a ConfigError at ``key`` (``type_key`` names the option that gives the type)."""
    if not Path(path).exists():
        raise ConfigError(
            key,
            f"{path!r} {missing(path)}",
            "train one with tools/train_tokenizer.py or point to an existing tokenizer",
        )
    if not (Path(path).is_file() or Path(path).is_dir()):
        # SentencePiece reads it whole: /dev/zero took 16 GB and two minutes to fail.
        raise ConfigError(
            key,
            f"{path} is neither a file nor a folder (a device, pipe or socket)",
            "point it at the tokenizer's model file or folder",
        )
    if Path(path).is_file():
        check_readable(path)
    try:
        yield
    except Exception as err:  # sentencepiece, transformers and megatron raise many kinds
        if denied(err):  # a file of the folder: the entry point names it, with the fix
            raise
        raise ConfigError(
            key,
            f"{path} does not load as a {kind} tokenizer ({reason(err)})",
            f"point it at a tokenizer of that type, or set {type_key} to the type it is",
        ) from err


def text_encoder(kind: str, path: str, threads: int, key: str = "--tokenizer") -> TextEncoder:
    """The ``sentencepiece`` model file or ``huggingface`` tokenizer directory at ``path``, using
    up to ``threads`` threads; a missing or unloadable tokenizer, or one without an
    end-of-document token, is a ConfigError at ``key``."""
    if kind not in ("sentencepiece", "huggingface"):
        raise ValueError(f"unknown tokenizer type {kind!r}; use sentencepiece or huggingface")
    with tokenizer_loading(kind, path, key, type_key="--tokenizer-type"):
        encode, eod, vocab_size = (_sentencepiece if kind == "sentencepiece" else _huggingface)(path, threads)
    if eod is None:
        raise ConfigError(
            key, f"{path} has no end-of-document (eos) token", "use a tokenizer that defines one"
        )
    return TextEncoder(encode, eod, vocab_size)
