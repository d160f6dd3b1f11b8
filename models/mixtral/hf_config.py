"""Hugging Face ``config.json`` <-> our ``model.*`` options for Mixtral: a Mistral decoder whose
every MLP is a softmax-routed mixture of experts, each as wide as ``intermediate_size``."""

from __future__ import annotations

import torch

from megatron_train.config import ModelConfig
from megatron_train.models.hf_config import (
    common_fields,
    common_options,
    flag,
    integer,
    no_zero_tensors,
    refuse,
    refuse_untranslatable_moe,
    sliding_window_caveat,
    with_head_dim,
)

# Its config.json refuses attention biases: every tensor it has is one of ours.
zero_tensors = no_zero_tensors

ARCHITECTURES = ("MixtralForCausalLM",)


def model_options(hf: dict) -> dict:
    """Our ``model.*`` architecture options for a supported config.json."""
    if flag(hf, "attention_bias"):
        refuse("attention_bias", True, "Mixtral has no attention biases")
    options = common_options(hf, "mixtral")
    options |= {
        "num_experts": integer(hf, "num_local_experts"),
        "moe_router_topk": integer(hf, "num_experts_per_tok"),
    }
    return with_head_dim(options)


def caveats(hf: dict) -> list[str]:
    """Differences that do not change a trained model's outputs on short sequences."""
    notes = sliding_window_caveat(hf, used_by_default=True)
    if hf.get("router_jitter_noise"):
        notes.append(f"router_jitter_noise={hf['router_jitter_noise']} (training-time noise) is not modelled")
    return notes


def hf_configs(m: ModelConfig, dtype: torch.dtype, special_tokens: dict[str, int | None]) -> list[dict]:
    """A transformers MixtralConfig config.json."""
    import transformers

    refuse_untranslatable_moe(m, "MixtralForCausalLM")
    fields = {**common_fields(m, special_tokens), "intermediate_size": m.expert_ffn_hidden_size}
    config = transformers.MixtralConfig(
        **fields,
        num_local_experts=m.num_experts,
        num_experts_per_tok=m.moe_router_topk,
        router_aux_loss_coef=m.moe_aux_loss_coeff,
        sliding_window=None,
    )
    config.architectures = ["MixtralForCausalLM"]
    config.dtype = str(dtype).removeprefix("torch.")
    return [config.to_dict()]
