"""The Mixtral family: Mixtral 8x7B-style mixture-of-experts decoders as megatron-core GPTModels
through megatron-core's MoELayer."""

from megatron_train.config import ModelConfig
from megatron_train.errors import ConfigError
from megatron_train.models.decoder import decoder_family
from megatron_train.models.hf_tensors import MoeNames
from megatron_train.models.mixtral import hf_config
from megatron_train.models.mixtral.presets import PRESETS


def check(m: ModelConfig) -> None:
    """Mixtral models are mixtures of experts with plain attention (no QK-norm, no biases), whose
    top-k router weights sum to one."""
    if m.num_experts is None:
        raise ConfigError("model.num_experts", "every Mixtral model is a mixture of experts", "set it")
    for key in ("qk_norm", "qkv_bias", "moe_router_pre_softmax"):
        if getattr(m, key):
            raise ConfigError(f"model.{key}", "Mixtral models do not have it", "set it to false")


FAMILY = decoder_family(
    "mixtral", PRESETS, check, hf_config, MoeNames(block="block_sparse_moe.", gate="w1", up="w3", down="w2")
)
