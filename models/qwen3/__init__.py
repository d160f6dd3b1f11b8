"""The Qwen3 family: Qwen3 (dense) and Qwen3-MoE decoders, both with QK-norm, as megatron-core
GPTModels (the MoE ones through megatron-core's MoELayer)."""

from megatron_train.config import ModelConfig
from megatron_train.errors import ConfigError
from megatron_train.models import counts, decoder
from megatron_train.models.family import Family
from megatron_train.models.hf_tensors import HfMapping, MoeNames, tensors
from megatron_train.models.qwen3 import hf_config
from megatron_train.models.qwen3.presets import PRESETS


def check(m: ModelConfig) -> None:
    """Qwen3 models normalise queries and keys and have no QKV biases."""
    if not m.qk_norm:
        raise ConfigError("model.qk_norm", "is false, but every Qwen3 model has QK-norm", "set it to true")
    if m.qkv_bias:
        raise ConfigError("model.qkv_bias", "Qwen3 models have no QKV biases", "set it to false")


_MAPPING = HfMapping(MoeNames(block="mlp.", gate="gate_proj", up="up_proj", down="down_proj"))

FAMILY = Family(
    name="qwen3",
    presets=PRESETS,
    hf_architectures=hf_config.ARCHITECTURES,
    check=check,
    transformer_config=decoder.transformer_config,
    build_model_chunks=decoder.build_model_chunks,
    initial_value=decoder.initial_value,
    tensors=tensors,
    flops_per_token=counts.flops_per_token,
    hf_model_options=hf_config.model_options,
    hf_caveats=hf_config.caveats,
    hf_config=hf_config.hf_config,
    hf_names=_MAPPING.hf_names,
    to_megatron=_MAPPING.to_megatron,
    to_hf=_MAPPING.to_hf,
)
