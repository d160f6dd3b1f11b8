"""Hugging Face ``config.json`` <-> our ``model.*`` options for the Llama-family decoders.

Only what megatron-core's GPTModel computes identically is accepted; anything else (another
activation, biases outside QKV, an unsupported RoPE variant) is refused here with the field that
differs, instead of producing a model that silently disagrees with transformers.
"""

from __future__ import annotations

import torch

from megatron_train.config import ModelConfig
from megatron_train.errors import ConversionError

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}

# megatron-core's Llama-3.1 RoPE scaling hard-codes these (rotary_pos_embedding._apply_scaling).
_LLAMA3_ROPE_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


_REQUIRED = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
             "max_position_embeddings", "vocab_size")  # fmt: skip


def _variant(hf: dict) -> str:
    """``llama``, ``mistral`` or ``qwen2`` (the registry has already checked the architecture)."""
    return ARCHITECTURES[hf["architectures"][0]]


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from transformers 5's ``rope_parameters`` or 4's fields."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        scaling = None if params.get("rope_type", "default") == "default" else params
        return params.get("rope_theta", 10000.0), scaling
    return hf.get("rope_theta", 10000.0), hf.get("rope_scaling")


def _refuse(field: str, value, why: str) -> None:
    raise ConversionError(f"config.json {field}={value!r}: {why}")


def model_options(hf: dict) -> dict:
    """Our ``model.*`` architecture options for a supported config.json."""
    variant = _variant(hf)
    missing = [key for key in _REQUIRED if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool)]
    if missing:
        raise ConversionError(
            f"config.json lacks integer field(s) {missing}; it is not a complete {variant} config"
        )
    if hf.get("hidden_act", "silu") != "silu":
        _refuse("hidden_act", hf["hidden_act"], "only SwiGLU (silu) MLPs are supported")
    if hf.get("mlp_bias"):
        _refuse("mlp_bias", True, "MLP biases are not supported")
    if variant == "llama" and hf.get("attention_bias"):
        _refuse("attention_bias", True, "Llama attention biases include o_proj, which GPTModel lacks")
    theta, scaling = _rope(hf)
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type != "llama3":
            _refuse("rope_scaling", scaling, "only Llama-3.1 ('llama3') RoPE scaling is supported")
        for key, fixed in _LLAMA3_ROPE_FIXED.items():
            if float(scaling.get(key, fixed)) != fixed:
                _refuse(f"rope_scaling.{key}", scaling[key], f"megatron-core fixes it at {fixed:g}")
    if float(theta) != int(theta):
        _refuse("rope_theta", theta, "a non-integer RoPE base is not supported")
    heads = hf["num_attention_heads"]
    options = {
        "family": "llama",
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"],
        "num_attention_heads": heads,
        "num_query_groups": hf.get("num_key_value_heads") or heads,
        "kv_channels": hf.get("head_dim"),
        "max_position_embeddings": hf["max_position_embeddings"],
        "vocab_size": hf["vocab_size"],
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rotary_base": int(theta),
        "rope_scaling": scaling is not None,
        "rope_scaling_factor": float(scaling["factor"]) if scaling else 8.0,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": variant == "qwen2",
    }
    # Recorded explicitly (transformers' default is ours), so a saved config never depends on it.
    options["kv_channels"] = ModelConfig(**options).head_dim
    return options


def caveats(hf: dict) -> list[str]:
    """Differences that only matter past some length (reported, not refused)."""
    window = hf.get("sliding_window")
    uses_window = hf.get("use_sliding_window", _variant(hf) == "mistral")
    if window and uses_window:
        return [f"sliding_window={window} is not modelled: outputs match for sequences up to {window} tokens"]
    return []


def hf_config(m: ModelConfig, dtype: torch.dtype, special_tokens: dict[str, int | None]) -> dict:
    """A transformers config.json for a model we trained from scratch (Qwen2 when QKV has biases);
    ``special_tokens`` are its tokenizer's ``bos_token_id``, ``eos_token_id`` and ``pad_token_id``."""
    import transformers

    common = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.query_groups,
        head_dim=m.head_dim,
        max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_embeddings,
        hidden_act="silu",
        **special_tokens,
    )
    rope = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
    if m.rope_scaling:
        rope = {**rope, "rope_type": "llama3", "factor": m.rope_scaling_factor, **_LLAMA3_ROPE_FIXED}
    if m.qkv_bias:
        config = transformers.Qwen2Config(**common, rope_parameters=rope)
        config.architectures = ["Qwen2ForCausalLM"]
    else:
        config = transformers.LlamaConfig(**common, rope_parameters=rope)
        config.architectures = ["LlamaForCausalLM"]
    config.dtype = str(dtype).removeprefix("torch.")
    return config.to_dict()
