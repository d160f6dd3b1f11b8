"""Hugging Face ``config.json`` <-> our ``model.*`` options for the Llama-family decoders.

Only what megatron-core's GPTModel computes identically is accepted; anything else (another
activation, biases outside QKV, an unsupported RoPE variant) is refused here with the field that
differs, instead of producing a model that silently disagrees with transformers.
"""

from __future__ import annotations

import torch

from megatron_train.config import ModelConfig
from megatron_train.models.hf_config import (
    common_fields,
    common_options,
    flag,
    refuse,
    sliding_window_caveat,
    with_head_dim,
)

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


def _variant(hf: dict) -> str:
    """``llama``, ``mistral`` or ``qwen2`` (the registry has already checked the architecture)."""
    return ARCHITECTURES[hf["architectures"][0]]


def model_options(hf: dict) -> dict:
    """Our ``model.*`` architecture options for a supported config.json."""
    variant = _variant(hf)
    if variant == "llama" and flag(hf, "attention_bias"):
        refuse("attention_bias", True, "Llama attention biases include o_proj, which GPTModel lacks")
    return with_head_dim({**common_options(hf, "llama"), "qkv_bias": variant == "qwen2"})


def caveats(hf: dict) -> list[str]:
    """Differences that only matter past some length (reported, not refused)."""
    return sliding_window_caveat(hf, used_by_default=_variant(hf) == "mistral")


def hf_config(m: ModelConfig, dtype: torch.dtype, special_tokens: dict[str, int | None]) -> dict:
    """A transformers config.json for a model we trained from scratch (Qwen2 when QKV has biases);
    ``special_tokens`` are its tokenizer's ``bos_token_id``, ``eos_token_id`` and ``pad_token_id``."""
    import transformers

    fields = common_fields(m, special_tokens)
    if m.qkv_bias:
        config = transformers.Qwen2Config(**fields)
        config.architectures = ["Qwen2ForCausalLM"]
    else:
        config = transformers.LlamaConfig(**fields)
        config.architectures = ["LlamaForCausalLM"]
    config.dtype = str(dtype).removeprefix("torch.")
    return config.to_dict()
