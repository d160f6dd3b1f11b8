"""The Qwen3 family: Qwen3 (dense) and Qwen3-MoE decoders, both with QK-norm, as megatron-core
GPTModels (the MoE ones through megatron-core's MoELayer)."""

from megatron_train.config import ModelConfig
from megatron_train.errors import ConfigError
from megatron_train.models.decoder import decoder_family
from megatron_train.models.hf_tensors import MoeNames
from megatron_train.models.qwen3 import hf_config
from megatron_train.models.qwen3.presets import PRESETS


def check(m: ModelConfig) -> None:
    """Qwen3 models normalise queries and keys and have no QKV biases."""
    if not m.qk_norm:
        raise ConfigError("model.qk_norm", "is false, but every Qwen3 model has QK-norm", "set it to true")
    if m.qkv_bias:
        raise ConfigError("model.qkv_bias", "Qwen3 models have no QKV biases", "set it to false")


FAMILY = decoder_family(
    "qwen3",
    PRESETS,
    check,
    hf_config,
    MoeNames(block="mlp.", gate="gate_proj", up="up_proj", down="down_proj"),
)
