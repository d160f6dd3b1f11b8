"""Hugging Face ``config.json`` <-> our ``model.*`` options for the Llama-family decoders.

Only what megatron-core's GPTModel computes identically is accepted; anything else (another
activation, MLP biases, an unsupported RoPE variant) is refused here with the field that
differs, instead of producing a model that silently disagrees with transformers. Llama's
``attention_bias`` puts a bias on the output projection too, which GPTModel lacks: such a model
imports only where those biases are zero, and a model with QKV biases exports that way where
transformers would read its tokenizer otherwise in a Qwen2 directory.
"""

from __future__ import annotations

import torch

from megatron_train.config import ModelConfig
from megatron_train.models.hf_config import (
    common_fields,
    common_options,
    flag,
    sliding_window_caveat,
    with_head_dim,
)

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


def _variant(hf: dict) -> str:
    """``llama``, ``mistral`` or ``qwen2`` (the registry has already checked the architecture)."""
    return ARCHITECTURES[hf["architectures"][0]]


def _attention_bias(hf: dict) -> bool:
    """Llama's attention biases: on q, k, v and o (Mistral's attention has none, whatever it says)."""
    return _variant(hf) == "llama" and flag(hf, "attention_bias")


def model_options(hf: dict) -> dict:
    """Our ``model.*`` architecture options for a supported config.json."""
    qkv_bias = _variant(hf) == "qwen2" or _attention_bias(hf)
    return with_head_dim({**common_options(hf, "llama"), "qkv_bias": qkv_bias})


def zero_tensors(hf: dict, m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """With Llama's attention biases, each layer's output-projection bias (GPTModel has none)."""
    if not _attention_bias(hf):
        return {}
    return {f"model.layers.{i}.self_attn.o_proj.bias": (m.hidden_size,) for i in range(m.num_layers)}


def caveats(hf: dict) -> list[str]:
    """Differences that only matter past some length (reported, not refused)."""
    return sliding_window_caveat(hf, used_by_default=_variant(hf) == "mistral")


def hf_configs(m: ModelConfig, dtype: torch.dtype, special_tokens: dict[str, int | None]) -> list[dict]:
    """transformers config.jsons for a model we trained from scratch: Llama's; with QKV biases,
    Qwen2's, then Llama's with attention biases (zero on the output projection: see
    :func:`zero_tensors`) for a tokenizer that transformers reads otherwise in a Qwen2 directory.
    ``special_tokens`` are its tokenizer's ``bos_token_id``, ``eos_token_id`` and ``pad_token_id``."""
    import transformers

    fields = common_fields(m, special_tokens)
    configs = []
    if m.qkv_bias:
        configs.append(transformers.Qwen2Config(**fields))
        configs[-1].architectures = ["Qwen2ForCausalLM"]
    configs.append(transformers.LlamaConfig(**fields, attention_bias=m.qkv_bias))
    configs[-1].architectures = ["LlamaForCausalLM"]
    for config in configs:
        config.dtype = str(dtype).removeprefix("torch.")
    return [config.to_dict() for config in configs]
