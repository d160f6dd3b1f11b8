"""The Llama family: Llama 2 / 3 / 3.1, Mistral and Qwen2 decoders as megatron-core GPTModels."""

from megatron_train.models.family import Family
from megatron_train.models.llama import counts, hf_config, hf_tensors, model
from megatron_train.models.llama.presets import PRESETS

FAMILY = Family(
    name="llama",
    presets=PRESETS,
    hf_architectures=tuple(hf_config.ARCHITECTURES),
    transformer_config=model.transformer_config,
    build_model_chunks=model.build_model_chunks,
    initial_value=model.initial_value,
    tensors=hf_tensors.tensors,
    flops_per_token=counts.flops_per_token,
    hf_model_options=hf_config.model_options,
    hf_caveats=hf_config.caveats,
    hf_config=hf_config.hf_config,
    hf_names=hf_tensors.hf_names,
    to_megatron=hf_tensors.to_megatron,
    to_hf=hf_tensors.to_hf,
)
