"""Starting a new run from other weights: ``checkpoint.init_from``, a Hugging Face model directory
or a megatron-train checkpoint, used while the run's save dir has nothing to resume from.
Optimizer, schedule and step start fresh."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from megatron_train.checkpoint import files
from megatron_train.checkpoint.state import load_weights, read_common, weight_setting_changes
from megatron_train.config import ExperimentConfig, to_dict
from megatron_train.errors import CheckpointError
from megatron_train.hf.convert import load_hf_weights
from megatron_train.hf.model_dir import is_hf_model_dir


def _locate_on_main(init_from: Path) -> tuple[str | None, str | None]:
    try:
        path = init_from if is_hf_model_dir(init_from) else files.resolve_explicit(init_from)
    except CheckpointError as err:
        return None, f"checkpoint.init_from: {err}"
    return str(path), None


def locate(cfg: ExperimentConfig, is_main: bool, log: Callable[[str], None]) -> Path | None:
    """The weights ``checkpoint.init_from`` names (found on rank 0, agreed by all), or None."""
    if not cfg.checkpoint.init_from:
        return None
    found = [_locate_on_main(Path(cfg.checkpoint.init_from)) if is_main else None]
    torch.distributed.broadcast_object_list(found, src=0)
    path, error = found[0]
    if error:
        raise CheckpointError(error)
    log(f"starting from checkpoint.init_from={path}")
    return Path(path)


def load(path: Path, cfg: ExperimentConfig, model: list, optimizer, log: Callable[[str], None]) -> None:
    """Set the model's weights from ``path`` (any layout, either kind)."""
    if is_hf_model_dir(path):
        load_hf_weights(model, path, cfg.model, log)
    else:
        load_weights(path, model, weight_setting_changes(read_common(path)["config"], to_dict(cfg)))
    # The optimizer's fp32 main copies were taken from the initial weights (bf16 models).
    optimizer.reload_model_params()
    log(f"fine-tuning from the weights of {path} (optimizer and step start fresh)")
