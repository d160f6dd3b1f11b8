"""Tensor-by-tensor mapping between transformers' Llama/Mistral/Qwen2 weights and GPTModel's.

Our side is megatron's sharded state dict in its global (layout-independent) form: per-layer
tensors are stacked on a leading layer axis, QKV rows are interleaved per query group
(``[q heads of group 0, k0, v0, q heads of group 1, ...]``), the SwiGLU input projection is
``[gate; up]`` and the vocabulary is padded to ``model.vocab_pad_multiple``. Each function
handles one layer of one tensor, so conversions never hold more than that in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_train.config import ModelConfig, padded_vocab_size

Getter = Callable[[str], torch.Tensor]


@dataclass(frozen=True)
class Dims:
    """The sizes the mapping needs, from our ``model.*`` options."""

    num_layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    padded_vocab: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def from_model(cls, m: ModelConfig) -> Dims:
        return cls(
            num_layers=m.num_layers,
            hidden=m.hidden_size,
            ffn=m.ffn_hidden_size,
            heads=m.num_attention_heads,
            groups=m.num_query_groups or m.num_attention_heads,
            head_dim=m.kv_channels or m.hidden_size // m.num_attention_heads,
            vocab=m.vocab_size,
            padded_vocab=padded_vocab_size(m),
            tied=m.tie_embeddings,
            qkv_bias=m.qkv_bias,
        )


@dataclass(frozen=True)
class Tensor:
    """One of GPTModel's global tensors: its key, shape of one layer's slice (or the whole tensor
    when not per-layer) and whether it is stacked over layers."""

    key: str
    shape: tuple[int, ...]
    per_layer: bool

    def global_shape(self, num_layers: int) -> tuple[int, ...]:
        return (num_layers, *self.shape) if self.per_layer else self.shape


_LAYER = "decoder.layers."
_QKV = ("linear_qkv.weight", "linear_qkv.bias")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def megatron_tensors(d: Dims) -> list[Tensor]:
    """Every tensor a GPTModel with these dimensions saves, in checkpoint order."""
    qkv_rows = (d.heads + 2 * d.groups) * d.head_dim
    tensors = [
        Tensor("embedding.word_embeddings.weight", (d.padded_vocab, d.hidden), False),
        Tensor(_LAYER + "self_attention.linear_qkv.layer_norm_weight", (d.hidden,), True),
        Tensor(_LAYER + "self_attention.linear_qkv.weight", (qkv_rows, d.hidden), True),
        Tensor(_LAYER + "self_attention.linear_proj.weight", (d.hidden, d.heads * d.head_dim), True),
        Tensor(_LAYER + "mlp.linear_fc1.layer_norm_weight", (d.hidden,), True),
        Tensor(_LAYER + "mlp.linear_fc1.weight", (2 * d.ffn, d.hidden), True),
        Tensor(_LAYER + "mlp.linear_fc2.weight", (d.hidden, d.ffn), True),
        Tensor("decoder.final_layernorm.weight", (d.hidden,), False),
    ]
    if d.qkv_bias:
        tensors.insert(3, Tensor(_LAYER + "self_attention.linear_qkv.bias", (qkv_rows,), True))
    if not d.tied:
        tensors.append(Tensor("output_layer.weight", (d.padded_vocab, d.hidden), False))
    return tensors


def _hf_names(key: str, layer: int | None) -> list[str]:
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


def to_megatron(d: Dims, key: str, layer: int | None, get: Getter) -> torch.Tensor:
    """Our tensor ``key`` (one layer of it when per-layer) from transformers' tensors."""
    names = _hf_names(key, layer)
    if key.endswith(_QKV):
        q, k, v = (get(n) for n in names)
        trailing = q.shape[1:]
        grouped = [t.reshape(d.groups, -1, *trailing) for t in (q, k, v)]
        return torch.cat(grouped, dim=1).reshape(-1, *trailing)
    if key.endswith("linear_fc1.weight"):
        return torch.cat([get(n) for n in names], dim=0)
    tensor = get(names[0])
    if key in _VOCAB and d.padded_vocab != d.vocab:
        padded = tensor.new_zeros(d.padded_vocab, *tensor.shape[1:])
        padded[: d.vocab] = tensor
        return padded
    return tensor


def to_hf(d: Dims, key: str, layer: int | None, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' tensors for our tensor ``key`` (one layer of it when per-layer)."""
    names = _hf_names(key, layer)
    if key.endswith(_QKV):
        trailing = tensor.shape[1:]
        q_rows_per_group = d.heads // d.groups * d.head_dim
        parts = tensor.reshape(d.groups, -1, *trailing).split(
            [q_rows_per_group, d.head_dim, d.head_dim], dim=1
        )
        return {n: p.reshape(-1, *trailing) for n, p in zip(names, parts)}
    if key.endswith("linear_fc1.weight"):
        return dict(zip(names, tensor.split(d.ffn, dim=0)))
    if key in _VOCAB:
        tensor = tensor[: d.vocab]
    return {names[0]: tensor}


def export_plan(d: Dims) -> list[tuple[str, int | None, list[str]]]:
    """(our key, layer, the transformers names it becomes), grouped by layer as transformers saves."""
    tensors = megatron_tensors(d)
    whole = [t.key for t in tensors if not t.per_layer]  # the embedding first, then the output end
    layered = [t.key for t in tensors if t.per_layer]
    slots = [(whole[0], None)] + [(key, layer) for layer in range(d.num_layers) for key in layered]
    slots += [(key, None) for key in whole[1:]]
    return [(key, layer, _hf_names(key, layer)) for key, layer in slots]


def hf_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    """Every transformers tensor's shape, from :func:`to_hf` on meta tensors (no memory, no I/O)."""
    shapes = {t.key: t.shape for t in megatron_tensors(d)}
    return {
        name: tuple(tensor.shape)
        for key, layer, _ in export_plan(d)
        for name, tensor in to_hf(d, key, layer, torch.empty(shapes[key], device="meta")).items()
    }
