"""Hugging Face ``config.json`` <-> our ``model.*`` options for Qwen3 and Qwen3-MoE.

Both normalise queries and keys per head (QK-norm) and have no attention biases; Qwen3-MoE
replaces every MLP with routed experts (no shared expert). Layer-selective MoE
(``decoder_sparse_step`` > 1, ``mlp_only_layers``) is refused.
"""

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

ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def model_options(hf: dict) -> dict:
    """Our ``model.*`` architecture options for a supported config.json."""
    if flag(hf, "attention_bias"):
        refuse("attention_bias", True, "Qwen3 has no attention biases; this checkpoint is not a Qwen3")
    options = {**common_options(hf, "qwen3"), "qk_norm": True}
    if hf["architectures"][0] == "Qwen3MoeForCausalLM":
        if hf.get("decoder_sparse_step", 1) != 1:
            refuse(
                "decoder_sparse_step", hf["decoder_sparse_step"], "only an MoE in every layer is supported"
            )
        if hf.get("mlp_only_layers"):
            refuse("mlp_only_layers", hf["mlp_only_layers"], "only an MoE in every layer is supported")
        # transformers 4 calls it num_experts, 5 num_local_experts.
        experts_key = "num_experts" if "num_experts" in hf else "num_local_experts"
        options |= {
            "num_experts": integer(hf, experts_key),
            "moe_ffn_hidden_size": integer(hf, "moe_intermediate_size"),
            "moe_router_topk": integer(hf, "num_experts_per_tok"),
            "moe_router_pre_softmax": not flag(hf, "norm_topk_prob"),
        }
    return with_head_dim(options)


def caveats(hf: dict) -> list[str]:
    """Differences that only matter past some length (reported, not refused)."""
    return sliding_window_caveat(hf, used_by_default=False)


def hf_configs(m: ModelConfig, dtype: torch.dtype, special_tokens: dict[str, int | None]) -> list[dict]:
    """A transformers config.json: Qwen3 for a dense model, Qwen3-MoE for a mixture of experts."""
    import transformers

    fields = {**common_fields(m, special_tokens), "attention_bias": False}
    if m.num_experts is None:
        config = transformers.Qwen3Config(**fields)
        config.architectures = ["Qwen3ForCausalLM"]
    else:
        refuse_untranslatable_moe(m, "Qwen3MoeForCausalLM")
        config = transformers.Qwen3MoeConfig(
            **fields,
            num_experts=m.num_experts,
            num_experts_per_tok=m.moe_router_topk,
            moe_intermediate_size=m.expert_ffn_hidden_size,
            norm_topk_prob=not m.moe_router_pre_softmax,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=m.moe_aux_loss_coeff,
        )
        config.architectures = ["Qwen3MoeForCausalLM"]
    config.dtype = str(dtype).removeprefix("torch.")
    return [config.to_dict()]
