"""What every family's ``config.json`` reading and writing shares: the Llama-style fields
(sizes, norms, RoPE, tied embeddings) every supported architecture has, and refusing a field
whose value our model would not compute identically, naming that field."""

from __future__ import annotations

import math

from megatron_train.config import ModelConfig
from megatron_train.errors import ConversionError, shown

# megatron-core's Llama-3.1 RoPE scaling hard-codes these (rotary_pos_embedding._apply_scaling).
LLAMA3_ROPE_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# Our model.* options read from a config.json field of another name (the rest keep theirs).
HF_FIELDS = {
    "num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size",
    "num_query_groups": "num_key_value_heads", "kv_channels": "head_dim", "norm_eps": "rms_norm_eps",
    "rotary_base": "rope_theta", "rope_scaling_factor": "rope_scaling.factor",
    "tie_embeddings": "tie_word_embeddings", "num_experts": "num_local_experts",
    "moe_ffn_hidden_size": "moe_intermediate_size", "moe_router_topk": "num_experts_per_tok",
}  # fmt: skip

_REQUIRED = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
             "max_position_embeddings", "vocab_size")  # fmt: skip


UNSUPPORTED = "megatron-train cannot import this model (README, Hugging Face models: what it can)"
MALFORMED = "correct config.json, or download the model again"


def refuse(field: str, value, why: str, fix: str = UNSUPPORTED) -> None:
    """Raise the one-line refusal of a config.json value: a feature our model lacks (the default
    fix) or a value no config.json holds (:data:`MALFORMED`)."""
    raise ConversionError(f"config.json {field}={shown(value)}: {why}; {fix}")


def no_zero_tensors(hf: dict, m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``zero_tensors`` of a family whose config.json describes no tensor our model lacks."""
    return {}


def flag(hf: dict, key: str, default: bool = False) -> bool:
    """A true/false field (a refusal naming it otherwise: a string "false" is true to Python)."""
    value = hf.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        refuse(key, value, "expected true or false", MALFORMED)
    return value


def _number(field: str, value) -> float:
    """A numeric field's value as a float (a refusal naming ``field`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        refuse(field, value, "expected a finite number", MALFORMED)
    return float(value)


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) as transformers reads them: a ``rope_scaling`` dict (4's
    field) wins over ``rope_parameters`` (5's) when both are present, and a top-level
    ``rope_theta`` fills in a dict without one."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        refuse("rope_parameters", params, "expected a mapping of RoPE parameters", MALFORMED)
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if _number("partial_rotary_factor", factor) != 1.0:
        refuse("partial_rotary_factor", factor, "RoPE over part of each head is not supported")
    theta = _number("rope_theta", params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    return theta, None if rope_type == "default" else params


def integer(hf: dict, key: str, default: int | None = None) -> int:
    """An integer field (ConversionError when absent without a default, or not an integer)."""
    value = hf.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConversionError(
            f"config.json lacks integer field {key!r} (found {shown(value)}); download the model again"
        )
    return value


def common_options(hf: dict, family: str) -> dict:
    """Our ``model.*`` options for the fields every supported architecture shares."""
    missing = [key for key in _REQUIRED if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool)]
    if missing:
        raise ConversionError(
            f"config.json lacks integer field(s) {missing}: it is not a complete config; download the "
            "model again"
        )
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", hf["hidden_act"], "only SwiGLU (silu) MLPs are supported")
    if flag(hf, "mlp_bias"):
        refuse("mlp_bias", True, "MLP biases are not supported")
    theta, scaling = _rope(hf)
    scaled = {}  # without scaling, ModelConfig's own factor stays
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type != "llama3":
            refuse("rope_scaling", scaling, "only Llama-3.1 ('llama3') RoPE scaling is supported")
        if "factor" not in scaling:
            refuse("rope_scaling", scaling, "Llama-3.1 RoPE scaling needs its 'factor'", MALFORMED)
        scaled["rope_scaling_factor"] = _number("rope_scaling.factor", scaling["factor"])
        for key, fixed in LLAMA3_ROPE_FIXED.items():
            if _number(f"rope_scaling.{key}", scaling.get(key, fixed)) != fixed:
                refuse(f"rope_scaling.{key}", scaling[key], f"megatron-core fixes it at {fixed:g}")
    if theta != int(theta):
        refuse("rope_theta", theta, "a non-integer RoPE base is not supported")
    heads = hf["num_attention_heads"]
    return {
        "family": family,
        "num_layers": hf["num_hidden_layers"],
        "hidden_size": hf["hidden_size"],
        "ffn_hidden_size": hf["intermediate_size"],
        "num_attention_heads": heads,
        # Absent or null means one group per head, as transformers reads it; 0 meets the range check.
        "num_query_groups": heads if hf.get("num_key_value_heads") is None else hf["num_key_value_heads"],
        "kv_channels": hf.get("head_dim"),
        "max_position_embeddings": hf["max_position_embeddings"],
        "vocab_size": hf["vocab_size"],
        "norm_eps": _number("rms_norm_eps", hf.get("rms_norm_eps", 1e-6)),
        "rotary_base": int(theta),
        "rope_scaling": scaling is not None,
        **scaled,
        "tie_embeddings": flag(hf, "tie_word_embeddings"),
        "attention_dropout": _number("attention_dropout", hf.get("attention_dropout", 0.0)),
    }


def with_head_dim(options: dict) -> dict:
    """``options`` with the head dimension recorded explicitly (transformers' default is ours),
    so a saved config never depends on it."""
    if not options["num_attention_heads"]:
        return options  # no head dimension to derive; the validation names the head count
    return {**options, "kv_channels": ModelConfig(**options).head_dim}


def sliding_window_caveat(hf: dict, used_by_default: bool) -> list[str]:
    """A note when config.json asks for sliding-window attention, which we do not model."""
    window = hf.get("sliding_window")
    if window and hf.get("use_sliding_window", used_by_default):
        return [f"sliding_window={window} is not modelled: outputs match for sequences up to {window} tokens"]
    return []


def common_fields(m: ModelConfig, special_tokens: dict[str, int | None]) -> dict:
    """The transformers config fields every supported architecture shares, RoPE included."""
    rope = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
    if m.rope_scaling:
        rope = {**rope, "rope_type": "llama3", "factor": m.rope_scaling_factor, **LLAMA3_ROPE_FIXED}
    return dict(
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
        attention_dropout=m.attention_dropout,
        hidden_act="silu",
        rope_parameters=rope,
        **special_tokens,
    )


def refuse_untranslatable_moe(m: ModelConfig, architecture: str) -> None:
    """Refuse exporting router options ``architecture`` has no field for (ConversionError)."""
    lacks = None
    if m.moe_router_score_function != "softmax":
        lacks = "routes with softmax; this model uses sigmoid scores (model.moe_router_score_function)"
    elif m.moe_router_expert_bias:
        lacks = "has no expert bias (model.moe_router_expert_bias)"
    elif m.moe_shared_expert_ffn_hidden_size:
        lacks = "has no shared expert (model.moe_shared_expert_ffn_hidden_size)"
    if lacks:
        raise ConversionError(
            f"{architecture} {lacks}: transformers would compute another model, so it is not exported; "
            "keep it as a megatron-train checkpoint (tools/generate.py samples from it)"
        )
