"""The Mixtral family: Mixtral 8x7B-style mixture-of-experts decoders as megatron-core GPTModels
through megatron-core's MoELayer."""

from megatron_train.config import ModelConfig
from megatron_train.errors import ConfigError
from megatron_train.models import counts, decoder
from megatron_train.models.family import Family
from megatron_train.models.hf_tensors import HfMapping, MoeNames, tensors
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


_MAPPING = HfMapping(MoeNames(block="block_sparse_moe.", gate="w1", up="w3", down="w2"))

FAMILY = Family(
    name="mixtral",
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
