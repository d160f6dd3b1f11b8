"""The Llama family: Llama 2 / 3 / 3.1, Mistral and Qwen2 decoders as megatron-core GPTModels."""

from megatron_train.config import ModelConfig
from megatron_train.errors import ConfigError
from megatron_train.models.decoder import decoder_family
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


FAMILY = decoder_family("llama", PRESETS, check, hf_config)
