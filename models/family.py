"""What the framework asks of a model family: one :class:`Family` per package in ``models/``.

Everything that knows a family's tensor names, formulas or Hugging Face mapping sits behind
these callables, so training, conversion, preflight and metrics stay family-agnostic.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_train.config import ExperimentConfig, ModelConfig

Getter = Callable[[str], torch.Tensor]
"""Reads one Hugging Face tensor by name."""


Index = tuple[int, ...]
"""Which slice of a stacked tensor: ``()`` for a whole tensor, ``(layer,)`` for one layer of a
per-layer tensor, ``(layer, expert)`` for one routed expert of one layer."""


@dataclass(frozen=True)
class Tensor:
    """One of the model's global tensors as megatron's sharded state dict names it.

    ``shape`` is one slice: of one layer for per-layer tensors (stacked on a leading layer axis
    in a checkpoint), of one expert of one layer for routed experts' tensors (stacked on layer
    and expert axes), the whole tensor otherwise; ``place`` is the pipeline stage that holds it.
    """

    key: str
    shape: tuple[int, ...]
    place: Literal["first", "layers", "last"]
    experts: int = 0
    """The routed experts it is stacked over; 0 for every tensor outside the experts."""

    @property
    def per_layer(self) -> bool:
        """Stacked over layers."""
        return self.place == "layers"

    def index_shape(self, num_layers: int) -> tuple[int, ...]:
        """The leading axes a checkpoint stacks the slices on: (), (layers,) or (layers, experts)."""
        if not self.per_layer:
            return ()
        return (num_layers, self.experts) if self.experts else (num_layers,)

    def indices(self, num_layers: int) -> list[Index]:
        """Every slice's index, in checkpoint order."""
        return list(itertools.product(*(range(n) for n in self.index_shape(num_layers))))

    def global_shape(self, num_layers: int) -> tuple[int, ...]:
        """The checkpoint's shape of the tensor."""
        return (*self.index_shape(num_layers), *self.shape)


@dataclass(frozen=True)
class ParameterCount:
    """Parameters by where they live: the first stage, each layer, the last stage."""

    first: int
    per_layer: int
    last: int
    per_layer_experts: int = 0
    """The part of ``per_layer`` held by routed experts (split over expert-parallel ranks)."""

    def total(self, num_layers: int) -> int:
        """The whole model's parameter count."""
        return self.first + num_layers * self.per_layer + self.last


@dataclass(frozen=True)
class Family:
    """A model family: presets, its megatron-core model, sizes and the Hugging Face mapping."""

    name: str
    """The value of ``model.family``."""
    presets: Mapping[str, Mapping[str, Any]]
    """Preset name -> ``model.*`` values."""
    hf_architectures: tuple[str, ...]
    """The config.json ``architectures`` entries this family reads."""
    check: Callable[[ModelConfig], None]
    """Raises ConfigError, naming the key, for an option this family's models do not have."""
    transformer_config: Callable[[ExperimentConfig, torch.dtype, bool], TransformerConfig]
    """megatron-core's TransformerConfig (the bool: Transformer Engine layers)."""
    build_model_chunks: Callable[[ExperimentConfig, TransformerConfig, bool], list[torch.nn.Module]]
    """One megatron-core model per virtual pipeline stage held by this rank."""
    initial_value: Callable[[ModelConfig, str, tuple[int, ...], torch.Generator], torch.Tensor]
    """A global tensor's initial value, drawn from the generator given."""
    tensors: Callable[[ModelConfig], list[Tensor]]
    """Every tensor a checkpoint of the model holds, in checkpoint order."""
    flops_per_token: Callable[[ModelConfig, int], float]
    """Training FLOPs per token at a sequence length (Megatron-LM's convention)."""
    hf_model_options: Callable[[dict], dict]
    """``model.*`` options for a config.json (ConversionError naming what is unsupported)."""
    hf_caveats: Callable[[dict], list[str]]
    """Differences from transformers worth a note but not a refusal."""
    hf_configs: Callable[[ModelConfig, torch.dtype, dict], list[dict]]
    """config.json candidates for a model trained here, most wanted first (the dict: bos / eos /
    pad token ids); an export takes the first in whose directory transformers reads the run's
    tokenizer as it is."""
    hf_zero_tensors: Callable[[dict, ModelConfig], dict[str, tuple[int, ...]]]
    """The transformers tensors, with their shapes, that a config.json's architecture has and our
    model lacks, so zero in every model we hold: an export writes zeros, an import refuses others."""
    hf_names: Callable[[str, Index], list[str]]
    """The transformers tensors one slice of one of our tensors is made of."""
    to_megatron: Callable[[ModelConfig, str, Index, Getter], torch.Tensor]
    """One slice of our tensor from transformers' tensors."""
    to_hf: Callable[[ModelConfig, str, Index, torch.Tensor], dict[str, torch.Tensor]]
    """transformers' tensors for one slice of our tensor."""

    def parameters(self, m: ModelConfig) -> ParameterCount:
        """Parameter counts by stage, from :attr:`tensors` (tied embeddings counted once)."""
        totals = {"first": 0, "layers": 0, "last": 0, "experts": 0}
        for tensor in self.tensors(m):
            # Python's integers: a torch.Size of a mistyped size overflows its int64.
            numel = math.prod(tensor.shape) * max(tensor.experts, 1)
            totals[tensor.place] += numel
            totals["experts"] += numel if tensor.experts else 0
        return ParameterCount(
            first=totals["first"],
            per_layer=totals["layers"],
            last=totals["last"],
            per_layer_experts=totals["experts"],
        )
