"""Tokenizers through megatron-core's tokenizer library (SentencePiece or Hugging Face)."""

from __future__ import annotations

from megatron.core.tokenizers import MegatronTokenizer
from megatron.core.tokenizers.base_tokenizer import MegatronTokenizerBase

from megatron_train.megatron_compat import (
    tokenizer_libraries_with_transformers,
    tokenizer_libraries_without_transformers,
)


def load_tokenizer(kind: str, path: str) -> MegatronTokenizerBase:
    """Load a ``sentencepiece`` model file or a ``huggingface`` tokenizer directory."""
    if kind not in ("sentencepiece", "huggingface"):
        raise ValueError(f"unknown tokenizer type {kind!r}; use sentencepiece or huggingface")
    if kind == "sentencepiece":
        tokenizer_libraries_without_transformers()
    else:
        tokenizer_libraries_with_transformers()
    return MegatronTokenizer.from_pretrained(path, metadata_path={"library": kind})
