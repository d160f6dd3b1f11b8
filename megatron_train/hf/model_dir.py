"""Reading a Hugging Face model directory's ``config.json``, whatever the family."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_train import json_text
from megatron_train.errors import ConversionError, not_a_file, reason, shown

if TYPE_CHECKING:
    import torch


def is_hf_model_dir(path: Path) -> bool:
    """A directory holding a transformers ``config.json`` and safetensors weights."""
    path = Path(path)
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def missing_weights(path: Path) -> str:
    """Why a model directory without safetensors cannot be read, and the fix: only safetensors
    are read, since unpickling a ``pytorch_model*.bin`` can run code."""
    if any(Path(path).glob("pytorch_model*.bin")):
        return (
            "its weights are pytorch_model*.bin only, which are not read (loading them unpickles); "
            "save them as safetensors first: AutoModelForCausalLM.from_pretrained(dir)"
            ".save_pretrained(new_dir) in transformers"
        )
    return "it holds no .safetensors weights; download them (model.safetensors or its shards and index)"


def read_hf_config(hf_dir: Path) -> dict:
    """The parsed ``config.json`` of a Hugging Face model directory."""
    path = Path(hf_dir) / "config.json"
    if (problem := not_a_file(path)) is not None:
        raise ConversionError(f"{path} {problem}: --hf must be a Hugging Face model directory")
    try:
        hf = json_text.loads(path.read_text())
    except OSError as err:
        raise ConversionError(f"{path} cannot be read ({reason(err)}); check its permissions") from err
    except json.JSONDecodeError as err:
        raise ConversionError(f"{path} is not valid JSON ({err}); download the model again") from err
    except UnicodeDecodeError as err:
        raise ConversionError(f"{path} is not UTF-8 text ({err}); download the model again") from err
    except ValueError:
        raise ConversionError(
            f"{path} holds an integer too long to read (over {sys.get_int_max_str_digits()} digits); "
            "download the model again"
        ) from None
    if not isinstance(hf, dict):
        raise ConversionError(
            f"{path} is not a JSON object, so not a transformers config; download the model again"
        )
    hf_dtype(hf)
    return with_architecture(hf)


def with_architecture(hf: dict) -> dict:
    """``hf`` with the ``architectures`` that transformers' AutoModelForCausalLM reads it as: a
    config saved on its own (``LlamaConfig(...).save_pretrained``) names none, and its class is
    then picked by model_type."""
    if not hf.get("architectures") and isinstance(hf.get("model_type"), str):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        architecture = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf["model_type"])
        if architecture is not None:
            hf["architectures"] = [architecture]
    return hf


def hf_dtype(hf: dict) -> torch.dtype | None:
    """The weights' dtype config.json declares (``dtype`` or the older ``torch_dtype``), None when
    it declares none; a ConversionError when it is not a torch dtype's name, which transformers
    cannot read either."""
    import torch  # here: checkpoint.files tells a model directory apart without loading torch

    field = "dtype" if hf.get("dtype") is not None else "torch_dtype"
    name = hf.get(field)
    if name is None:
        return None
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ConversionError(
            f'config.json {field}={shown(name)}: expected the name of a torch dtype, such as "bfloat16"; '
            "correct config.json, or download the model again"
        )
    return dtype
