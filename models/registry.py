"""The model families, looked up by ``model.family``, by preset name or by a Hugging Face
config.json. Adding a family: a package in ``models/`` that builds a Family, listed here."""

from __future__ import annotations

import json

from megatron_train.config import ModelConfig
from megatron_train.errors import ConfigError, ConversionError, shown
from megatron_train.models import llama, mixtral, qwen3
from megatron_train.models.family import Family

FAMILIES: dict[str, Family] = {family.name: family for family in (llama.FAMILY, qwen3.FAMILY, mixtral.FAMILY)}


def family_of(m: ModelConfig) -> Family:
    """The family ``model.family`` names."""
    if m.family not in FAMILIES:
        raise ConfigError(
            "model.family", f"unknown family {shown(m.family)}", f"use one of {sorted(FAMILIES)}"
        )
    return FAMILIES[m.family]


def preset(name: str) -> tuple[Family, dict]:
    """The family a preset belongs to and the ``model.*`` values it sets."""
    for family in FAMILIES.values():
        if name in family.presets:
            return family, dict(family.presets[name])
    names = sorted(p for family in FAMILIES.values() for p in family.presets)
    raise ConfigError("model.preset", f"unknown preset {shown(name)}", f"use one of {names}")


def for_hf(hf: dict) -> Family:
    """The family that reads a Hugging Face config.json (its one ``architectures`` entry)."""
    archs = hf.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        example = json.dumps([archs]) if isinstance(archs, str) else 'such as ["LlamaForCausalLM"]'
        raise ConversionError(
            f"config.json architectures={shown(archs)}: expected a list of the one class that saved it, "
            f"{example}; correct config.json, or download the model again"
        )
    for family in FAMILIES.values():
        if len(archs) == 1 and archs[0] in family.hf_architectures:
            _check_model_type(hf, archs[0])
            return family
    supported = [a for family in FAMILIES.values() for a in family.hf_architectures]
    raise ConversionError(
        f"unsupported architecture {shown(archs or hf.get('model_type'))}; supported: {', '.join(supported)}"
    )


def _check_model_type(hf: dict, architecture: str) -> None:
    """transformers' AutoModelForCausalLM builds the class of ``model_type``; ``architectures``
    only names the class that saved the file. Where the two differ (an edited config.json), the
    family read here would not be the model transformers builds."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as CLASSES

    model_type = hf.get("model_type")
    if isinstance(model_type, str) and CLASSES.get(model_type) not in (None, architecture):
        raise ConversionError(
            f"config.json names the architecture {architecture} but model_type {model_type!r}, from which "
            f"transformers builds {CLASSES[model_type]}: the two describe different models; correct one of "
            "them in config.json, or download the model again"
        )
