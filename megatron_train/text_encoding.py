"""Raw text to token ids for pretraining data, a batch at a time with the tokenizer library's own
threads, never reading a control token out of the text.

A corpus is text: a literal ``<s>``, ``</s>``, ``<|begin_of_text|>`` or ``<unk>`` in it is text
too. Hugging Face tokenizers match their special tokens' strings in the input unless told not
to (``encode_special_tokens``); SentencePiece never produces control symbols from text. Each
document's end-of-document token is appended by the caller, from the tokenizer's ``eod``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import sentencepiece

Encode = Callable[[list[str]], list[list[int]]]


def _sentencepiece(path: str, threads: int) -> Encode:
    processor = sentencepiece.SentencePieceProcessor(model_file=path)

    def encode(texts: list[str]) -> list[list[int]]:
        return processor.encode(texts, out_type=int, num_threads=threads)

    return encode


def _huggingface(path: str, threads: int) -> Encode:
    # The Rust thread pool reads its size once, when it first runs.
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))
    from transformers import AutoTokenizer

    backend = AutoTokenizer.from_pretrained(path).backend_tokenizer
    backend.encode_special_tokens = True

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]

    return encode


def text_encoder(kind: str, path: str, threads: int) -> Encode:
    """A function from a batch of texts to their token ids (no special tokens added or read from
    the text), for a ``sentencepiece`` model file or a ``huggingface`` tokenizer directory, using up
    to ``threads`` threads."""
    if kind == "sentencepiece":
        return _sentencepiece(path, threads)
    if kind == "huggingface":
        return _huggingface(path, threads)
    raise ValueError(f"unknown tokenizer type {kind!r}; use sentencepiece or huggingface")
