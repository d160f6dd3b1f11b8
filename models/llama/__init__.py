"""The Llama family: Llama 2 / 3 / 3.1, Mistral and Qwen2 decoders as megatron-core GPTModels."""

from megatron_train.config import ModelConfig
from megatron_train.errors import ConfigError
from megatron_train.models import counts, decoder
from megatron_train.models.family import Family
from megatron_train.models.hf_tensors import HfMapping, tensors
from megatron_train.models.llama import hf_config
from megatron_train.models.llama.presets import PRESETS


def check(m: ModelConfig) -> None:
    """Llama-family models are dense and have no QK-norm."""
    if m.num_experts is not None:
        raise ConfigError(
            "model.num_experts",
            "the llama family has no mixture-of-experts models",
            "use model.family=qwen3 (Qwen3-MoE) or mixtral, or remove model.num_experts",
        )
    if m.qk_norm:
        raise ConfigError("model.qk_norm", "the llama family has no QK-norm", "use model.family=qwen3")


_MAPPING = HfMapping()

FAMILY = Family(
    name="llama",
    presets=PRESETS,
    hf_architectures=tuple(hf_config.ARCHITECTURES),
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
