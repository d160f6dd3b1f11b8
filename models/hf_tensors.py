"""Tensor-by-tensor mapping between our decoders' weights and transformers' Llama-style ones.

Our side is megatron's sharded state dict in its global (layout-independent) form: per-layer
tensors are stacked on a leading layer axis (routed experts' on layer and expert axes), QKV rows
are interleaved per query group (``[q heads of group 0, k0, v0, q heads of group 1, ...]``), every
SwiGLU input projection is ``[gate; up]`` and the vocabulary is padded to
``model.vocab_pad_multiple``. Each function handles one slice of one tensor, so conversions never
hold more than that in memory. Families differ only in where transformers keeps the MoE parts
(:class:`MoeNames`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_train.config import ModelConfig
from megatron_train.errors import ConversionError
from megatron_train.models.family import Getter, Index, Tensor

_LAYER = "decoder.layers."
_QKV = ("linear_qkv.weight", "linear_qkv.bias")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_EXPERTS = _LAYER + "mlp.experts.experts."


@dataclass(frozen=True)
class MoeNames:
    """Where a family's transformers checkpoint keeps a mixture-of-experts layer's tensors,
    relative to ``model.layers.<i>.``."""

    block: str
    """The MoE block (``mlp.`` for Qwen3-MoE, ``block_sparse_moe.`` for Mixtral)."""
    gate: str
    """An expert's gate projection (``gate_proj``, ``w1``)."""
    up: str
    """An expert's up projection (``up_proj``, ``w3``)."""
    down: str
    """An expert's down projection (``down_proj``, ``w2``)."""


def tensors(m: ModelConfig) -> list[Tensor]:
    """Every tensor a GPTModel with these options saves, in checkpoint order."""
    hidden, ffn, vocab = m.hidden_size, m.ffn_hidden_size, m.padded_vocab_size
    q_dim = m.num_attention_heads * m.head_dim
    qkv_rows = q_dim + 2 * m.query_groups * m.head_dim
    found = [
        Tensor("embedding.word_embeddings.weight", (vocab, hidden), "first"),
        Tensor(_LAYER + "self_attention.linear_qkv.layer_norm_weight", (hidden,), "layers"),
        Tensor(_LAYER + "self_attention.linear_qkv.weight", (qkv_rows, hidden), "layers"),
    ]  # fmt: skip
    if m.qkv_bias:
        found.append(Tensor(_LAYER + "self_attention.linear_qkv.bias", (qkv_rows,), "layers"))
    found.append(Tensor(_LAYER + "self_attention.linear_proj.weight", (hidden, q_dim), "layers"))
    if m.qk_norm:
        found += [
            Tensor(_LAYER + f"self_attention.{x}_layernorm.weight", (m.head_dim,), "layers") for x in "qk"
        ]
    if m.num_experts is None:
        found += [
            Tensor(_LAYER + "mlp.linear_fc1.layer_norm_weight", (hidden,), "layers"),
            Tensor(_LAYER + "mlp.linear_fc1.weight", (2 * ffn, hidden), "layers"),
            Tensor(_LAYER + "mlp.linear_fc2.weight", (hidden, ffn), "layers"),
        ]
    else:
        experts, expert_ffn = m.num_experts, m.expert_ffn_hidden_size
        found += [
            Tensor(_LAYER + "pre_mlp_layernorm.weight", (hidden,), "layers"),
            Tensor(_LAYER + "mlp.router.weight", (experts, hidden), "layers"),
        ]
        if m.moe_router_expert_bias:
            found.append(Tensor(_LAYER + "mlp.router.expert_bias", (experts,), "layers"))
        found += [
            Tensor(_EXPERTS + "linear_fc1.weight", (2 * expert_ffn, hidden), "layers", experts),
            Tensor(_EXPERTS + "linear_fc2.weight", (hidden, expert_ffn), "layers", experts),
        ]
        if m.moe_shared_expert_ffn_hidden_size:
            shared = m.moe_shared_expert_ffn_hidden_size
            found += [
                Tensor(_LAYER + "mlp.shared_experts.linear_fc1.weight", (2 * shared, hidden), "layers"),
                Tensor(_LAYER + "mlp.shared_experts.linear_fc2.weight", (hidden, shared), "layers"),
            ]
    found.append(Tensor("decoder.final_layernorm.weight", (hidden,), "last"))
    if not m.tie_embeddings:
        found.append(Tensor("output_layer.weight", (vocab, hidden), "last"))
    return found


@dataclass(frozen=True)
class HfMapping:
    """One family's mapping (its MoE names, if it has MoE models); the methods are the Family's
    ``hf_names``, ``to_megatron`` and ``to_hf``."""

    moe: MoeNames | None = None

    def hf_names(self, key: str, index: Index) -> list[str]:
        """The transformers tensors our tensor ``key`` (one slice of it) is made of."""
        p = f"model.layers.{index[0]}." if index else ""
        names = {
            "embedding.word_embeddings.weight": ["model.embed_tokens.weight"],
            "decoder.final_layernorm.weight": ["model.norm.weight"],
            "output_layer.weight": ["lm_head.weight"],
            _LAYER + "self_attention.linear_qkv.layer_norm_weight": [p + "input_layernorm.weight"],
            _LAYER + "self_attention.linear_qkv.weight": [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
            _LAYER + "self_attention.linear_qkv.bias": [p + f"self_attn.{x}_proj.bias" for x in "qkv"],
            _LAYER + "self_attention.linear_proj.weight": [p + "self_attn.o_proj.weight"],
            _LAYER + "self_attention.q_layernorm.weight": [p + "self_attn.q_norm.weight"],
            _LAYER + "self_attention.k_layernorm.weight": [p + "self_attn.k_norm.weight"],
            _LAYER + "mlp.linear_fc1.layer_norm_weight": [p + "post_attention_layernorm.weight"],
            _LAYER + "mlp.linear_fc1.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
            _LAYER + "mlp.linear_fc2.weight": [p + "mlp.down_proj.weight"],
            _LAYER + "pre_mlp_layernorm.weight": [p + "post_attention_layernorm.weight"],
        }
        if self.moe is not None:
            block = p + self.moe.block
            names[_LAYER + "mlp.router.weight"] = [block + "gate.weight"]
            if len(index) == 2:
                e = f"{block}experts.{index[1]}."
                names[_EXPERTS + "linear_fc1.weight"] = [
                    e + f"{self.moe.gate}.weight",
                    e + f"{self.moe.up}.weight",
                ]
                names[_EXPERTS + "linear_fc2.weight"] = [e + f"{self.moe.down}.weight"]
        if key not in names:
            raise ConversionError(f"{key} has no transformers equivalent in this model family")
        return names[key]

    def to_megatron(self, m: ModelConfig, key: str, index: Index, get: Getter) -> torch.Tensor:
        """Our tensor ``key`` (one slice of it) from transformers' tensors."""
        names = self.hf_names(key, index)
        if key.endswith(_QKV):
            q, k, v = (get(n) for n in names)
            trailing = q.shape[1:]
            grouped = [t.reshape(m.query_groups, -1, *trailing) for t in (q, k, v)]
            return torch.cat(grouped, dim=1).reshape(-1, *trailing)
        if key.endswith("linear_fc1.weight"):
            return torch.cat([get(n) for n in names], dim=0)
        tensor = get(names[0])
        if key in _VOCAB and m.padded_vocab_size != m.vocab_size:
            padded = tensor.new_zeros(m.padded_vocab_size, *tensor.shape[1:])
            padded[: m.vocab_size] = tensor
            return padded
        return tensor

    def to_hf(self, m: ModelConfig, key: str, index: Index, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """transformers' tensors for our tensor ``key`` (one slice of it)."""
        names = self.hf_names(key, index)
        if key.endswith(_QKV):
            trailing = tensor.shape[1:]
            q_rows_per_group = m.num_attention_heads // m.query_groups * m.head_dim
            parts = tensor.reshape(m.query_groups, -1, *trailing).split(
                [q_rows_per_group, m.head_dim, m.head_dim], dim=1
            )
            return {n: p.reshape(-1, *trailing) for n, p in zip(names, parts)}
        if key.endswith("linear_fc1.weight"):
            return dict(zip(names, tensor.chunk(2, dim=0)))
        if key in _VOCAB:
            tensor = tensor[: m.vocab_size]
        return {names[0]: tensor}
