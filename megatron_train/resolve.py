"""Config resolution, in one place: a YAML file and ``key.sub=value`` overrides, the model family's
preset or a Hugging Face model's architecture, the typed schema, validation and the tokenizer's
vocabulary. Training, preflight, the tools and the benchmarks all start here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from megatron_train.config import ExperimentConfig, ModelConfig, ParallelConfig, ProfileConfig
from megatron_train.config_checks import validate_for_training, validate_options
from megatron_train.config_loading import apply_overrides, check_paths_written_out, from_dict, read_yaml
from megatron_train.errors import ConfigError, ConversionError, shown
from megatron_train.hf.model_dir import is_hf_model_dir, read_hf_config
from megatron_train.inputs import check_inputs
from megatron_train.models import registry
from megatron_train.models.hf_config import HF_FIELDS


def resolve(path: str | Path, overrides: Sequence[str], world_size: int) -> ExperimentConfig:
    """The complete, validated config a job of ``world_size`` ranks trains with."""
    cfg = load_config(path, overrides)
    vocab = validate(cfg, world_size)
    if cfg.model.vocab_size is None:
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))
    if cfg.model.vocab_size < vocab:
        init_from = cfg.checkpoint.init_from
        if init_from is not None and is_hf_model_dir(Path(init_from)):
            # The vocabulary is that model's (its config.json): the tokenizer is the one to change.
            raise ConfigError(
                "data.tokenizer.path",
                f"names a tokenizer of {vocab} tokens, more than the {cfg.model.vocab_size} of the "
                f"Hugging Face model in checkpoint.init_from",
                f"train with that model's own tokenizer: data.tokenizer.type=huggingface "
                f"data.tokenizer.path={init_from}",
            )
        raise ConfigError(
            "model.vocab_size",
            f"{cfg.model.vocab_size} is smaller than the tokenizer's {vocab} tokens",
            "remove model.vocab_size to take it from the tokenizer",
        )
    return cfg


def validate(cfg: ExperimentConfig, world_size: int) -> int:
    """Options, then the files they name; returns the tokenizer's vocabulary size."""
    validate_options(cfg, world_size)
    validate_for_training(cfg)
    return check_inputs(cfg)


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """A YAML file with overrides, preset and architecture applied (not validated)."""
    return build_config(read_yaml(path), overrides)


def build_config(raw: dict, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """The typed config from plain data and overrides, preset and architecture applied."""
    raw = apply_overrides(raw, list(overrides))
    _apply_preset(raw)
    _apply_hf_architecture(raw)
    cfg = from_dict(ExperimentConfig, raw)
    check_paths_written_out(cfg)
    registry.family_of(cfg.model).check(cfg.model)
    return cfg


def hf_model_options(hf: dict) -> dict:
    """Our ``model.*`` options for a Hugging Face config.json, checked as a model of their own on
    one rank: a value no model of ours takes (a size of 0, heads that do not divide into its
    key-value heads) is a ConversionError naming config.json's field, not a ``model.*`` key the
    user never wrote."""
    options = registry.for_hf(hf).hf_model_options(hf)
    model = ModelConfig(**options)
    cfg = ExperimentConfig(model=model)
    cfg.data.seq_length = min(cfg.data.seq_length, model.max_position_embeddings)
    try:
        validate_options(cfg, 1)
    except ConfigError as err:
        if not err.key.startswith("model."):
            raise
        name = err.key.removeprefix("model.")
        # The range a field takes ("a value >= 1") or the check's own advice.
        needs = err.fix.removeprefix(f"set {err.key} to ")
        raise ConversionError(
            f"config.json {HF_FIELDS.get(name, name)}: {err.problem} (megatron-train's {err.key}: {needs}); "
            "it describes no model this framework can build: correct config.json, or download the model "
            "again"
        ) from None
    return options


def _fits_layout(cfg: ExperimentConfig, world_size: int) -> None:
    """``validate_options`` at the TP / PP a tool's ``--tp`` / ``--pp`` asked for: what fails only
    there is the layout's, and the error names those flags rather than config keys the tool's user
    never wrote."""
    validate_options(dataclasses.replace(cfg, parallel=ParallelConfig()), 1)
    try:
        validate_options(cfg, world_size)
    except ConfigError as err:
        p = cfg.parallel
        raise ConfigError(
            "--tp / --pp",
            f"TP{p.tensor} x PP{p.pipeline} does not fit this model: {err.problem}",
            "choose a --tp that divides the heads and query groups, and a --pp that divides the layers",
        ) from None


def imported_config(hf: dict, tensor: int, pipeline: int, vocab_pad_multiple: int) -> ExperimentConfig:
    """Our config for a Hugging Face config.json at a TP / PP layout (ConfigError if impossible)."""
    model = ModelConfig(**hf_model_options(hf), vocab_pad_multiple=vocab_pad_multiple)
    cfg = ExperimentConfig(model=model, parallel=ParallelConfig(tensor=tensor, pipeline=pipeline))
    cfg.data.seq_length = min(cfg.data.seq_length, model.max_position_embeddings)
    try:
        _fits_layout(cfg, tensor * pipeline)
    except ConfigError as err:
        if err.key != "model.vocab_pad_multiple":
            raise
        # The tool's flag, not a config key its user never wrote.
        flag = "--vocab-pad-multiple"
        raise ConfigError(flag, err.problem, err.fix.replace(err.key, flag)) from None
    return cfg


def at_layout(saved: dict, tensor: int, pipeline: int, expert: int = 1) -> ExperimentConfig:
    """A checkpoint's saved config moved to a TP x PP x EP layout (no VPP), for inference on
    ``tensor * pipeline * expert`` ranks (expert ranks come from data-parallel ones)."""
    cfg = from_dict(ExperimentConfig, saved)
    parallel = dataclasses.replace(
        cfg.parallel, tensor=tensor, pipeline=pipeline, virtual_pipeline=None, context=1,
        sequence_parallel=tensor > 1 and expert > 1, expert=expert, expert_tensor=None,
    )  # fmt: skip
    # Its training ran on other ranks; inference profiles no training steps, and leaves RoPE
    # uncompiled: without a KV cache each new token is a new sequence length, a new compile.
    # Kernels and layer implementation were the training machine's choice (a GPU config demands
    # TE and may name cuDNN attention): inference takes what the machine it runs on has, with
    # the same weights.
    model = dataclasses.replace(
        cfg.model, rope_fusion=False, attention_backend="auto", transformer_impl="auto"
    )
    cfg = dataclasses.replace(cfg, model=model, parallel=parallel, profile=ProfileConfig())
    _fits_layout(cfg, tensor * pipeline * expert)
    return cfg


def _apply_preset(raw: dict) -> None:
    model = raw.get("model")
    if not isinstance(model, dict) or model.get("preset") is None:
        return
    name = model["preset"]
    if not isinstance(name, str):
        raise ConfigError("model.preset", f"expected a preset name, got {shown(name)}", "write a preset name")
    family, values = registry.preset(name)
    chosen = model.get("family", family.name)
    if not isinstance(chosen, str) or chosen not in registry.FAMILIES:
        raise ConfigError(
            "model.family",
            f"unknown family {shown(model['family'])}",
            f"use preset {name!r}'s family {family.name!r}, or remove model.family",
        )
    if chosen != family.name:
        raise ConfigError(
            "model.family",
            f"is {shown(model['family'])} but preset {name!r} belongs to {family.name!r}",
            "remove model.family or choose a preset of that family",
        )
    if values.get("num_experts") is not None and "num_experts" in model and model["num_experts"] is None:
        # Otherwise the preset's moe_* values would be blamed, though the user never wrote them.
        dense = sorted(p for p, v in family.presets.items() if v.get("num_experts") is None)
        fix = "set num_experts to 2 or more" + (
            f", or choose a dense preset ({', '.join(dense)})" if dense else ""
        )
        raise ConfigError(
            "model.num_experts",
            f"is null, but preset {name!r} is a mixture of experts and sets its moe_* options",
            fix,
        )
    raw["model"] = {"family": family.name, **values, **model}


def _apply_hf_architecture(raw: dict) -> None:
    """A Hugging Face model in ``checkpoint.init_from`` fixes the architecture (its config.json)."""
    checkpoint = raw.get("checkpoint")
    init_from = checkpoint.get("init_from") if isinstance(checkpoint, dict) else None
    if not isinstance(init_from, str) or not is_hf_model_dir(Path(init_from)):
        return
    try:
        options = hf_model_options(read_hf_config(Path(init_from)))
    except ConversionError as err:
        raise ConfigError(
            "checkpoint.init_from", str(err), "start from a model of a supported family"
        ) from err
    model = raw.setdefault("model", {})
    if not isinstance(model, dict):
        return
    if model.get("preset") is not None:
        raise ConfigError(
            "model.preset", "conflicts with the Hugging Face model in checkpoint.init_from", "remove it"
        )
    # The longest sequence is no weight of these RoPE models: a run may train on longer ones than
    # the Hugging Face model was made for (a longer context, say). Dropout is a training choice.
    kept = {"max_position_embeddings", "attention_dropout"} & model.keys()
    for key, value in options.items():
        if key in model and key not in kept and model[key] != value:
            raise ConfigError(
                f"model.{key}",
                f"is {shown(model[key])} but {init_from}/config.json has {shown(value)}",
                f"remove model.{key}: the Hugging Face model sets it",
            )
    model.update({key: value for key, value in options.items() if key not in kept})
