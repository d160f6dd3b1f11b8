"""Tensor-by-tensor mapping between transformers' Llama/Mistral/Qwen2 weights and GPTModel's.

Our side is megatron's sharded state dict in its global (layout-independent) form: per-layer
tensors are stacked on a leading layer axis, QKV rows are interleaved per query group
(``[q heads of group 0, k0, v0, q heads of group 1, ...]``), the SwiGLU input projection is
``[gate; up]`` and the vocabulary is padded to ``model.vocab_pad_multiple``. Each function
handles one layer of one tensor, so conversions never hold more than that in memory.
"""

from __future__ import annotations

import torch

from megatron_train.config import ModelConfig
from megatron_train.models.family import Getter, Tensor

_LAYER = "decoder.layers."
_QKV = ("linear_qkv.weight", "linear_qkv.bias")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def tensors(m: ModelConfig) -> list[Tensor]:
    """Every tensor a GPTModel with these options saves, in checkpoint order."""
    hidden, ffn, vocab = m.hidden_size, m.ffn_hidden_size, m.padded_vocab_size
    q_dim = m.num_attention_heads * m.head_dim
    qkv_rows = q_dim + 2 * m.query_groups * m.head_dim
    found = [
        Tensor("embedding.word_embeddings.weight", (vocab, hidden), "first"),
        Tensor(_LAYER + "self_attention.linear_qkv.layer_norm_weight", (hidden,), "layers"),
        Tensor(_LAYER + "self_attention.linear_qkv.weight", (qkv_rows, hidden), "layers"),
        Tensor(_LAYER + "self_attention.linear_proj.weight", (hidden, q_dim), "layers"),
        Tensor(_LAYER + "mlp.linear_fc1.layer_norm_weight", (hidden,), "layers"),
        Tensor(_LAYER + "mlp.linear_fc1.weight", (2 * ffn, hidden), "layers"),
        Tensor(_LAYER + "mlp.linear_fc2.weight", (hidden, ffn), "layers"),
        Tensor("decoder.final_layernorm.weight", (hidden,), "last"),
    ]  # fmt: skip
    if m.qkv_bias:
        found.insert(3, Tensor(_LAYER + "self_attention.linear_qkv.bias", (qkv_rows,), "layers"))
    if not m.tie_embeddings:
        found.append(Tensor("output_layer.weight", (vocab, hidden), "last"))
    return found


def hf_names(key: str, layer: int | None) -> list[str]:
    """The transformers tensors our tensor ``key`` (one layer of it) is made of."""
    p = f"model.layers.{layer}."
    return {
        "embedding.word_embeddings.weight": ["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": ["model.norm.weight"],
        "output_layer.weight": ["lm_head.weight"],
        _LAYER + "self_attention.linear_qkv.layer_norm_weight": [p + "input_layernorm.weight"],
        _LAYER + "self_attention.linear_qkv.weight": [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
        _LAYER + "self_attention.linear_qkv.bias": [p + f"self_attn.{x}_proj.bias" for x in "qkv"],
        _LAYER + "self_attention.linear_proj.weight": [p + "self_attn.o_proj.weight"],
        _LAYER + "mlp.linear_fc1.layer_norm_weight": [p + "post_attention_layernorm.weight"],
        _LAYER + "mlp.linear_fc1.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
        _LAYER + "mlp.linear_fc2.weight": [p + "mlp.down_proj.weight"],
    }[key]


def to_megatron(m: ModelConfig, key: str, layer: int | None, get: Getter) -> torch.Tensor:
    """Our tensor ``key`` (one layer of it when per-layer) from transformers' tensors."""
    names = hf_names(key, layer)
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


def to_hf(m: ModelConfig, key: str, layer: int | None, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' tensors for our tensor ``key`` (one layer of it when per-layer)."""
    names = hf_names(key, layer)
    if key.endswith(_QKV):
        trailing = tensor.shape[1:]
        q_rows_per_group = m.num_attention_heads // m.query_groups * m.head_dim
        parts = tensor.reshape(m.query_groups, -1, *trailing).split(
            [q_rows_per_group, m.head_dim, m.head_dim], dim=1
        )
        return {n: p.reshape(-1, *trailing) for n, p in zip(names, parts)}
    if key.endswith("linear_fc1.weight"):
        return dict(zip(names, tensor.split(m.ffn_hidden_size, dim=0)))
    if key in _VOCAB:
        tensor = tensor[: m.vocab_size]
    return {names[0]: tensor}
