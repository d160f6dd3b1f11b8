"""Hugging Face model directory <-> megatron-train checkpoint, streaming tensor by tensor.

An imported checkpoint is a normal (weights-only) megatron-train checkpoint: ``<out>/iter_0000000``
with torch_dist files, a completion record, and ``hf/`` holding the original ``config.json``
and tokenizer files, which export copies back unchanged. Both directions write into a temporary
sibling directory and rename it into place, so ``--out`` is either complete or absent.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from megatron_train import json_text
from megatron_train.checkpoint import files
from megatron_train.checkpoint.state import (
    Layout,
    Progress,
    metadata,
    read_common,
    read_sharded,
    read_tensor_metadata,
    record_fields,
)
from megatron_train.checkpoint.streaming_save import save_weights
from megatron_train.config import ModelConfig
from megatron_train.config_loading import from_dict
from megatron_train.errors import ConversionError, missing, reason, shown
from megatron_train.hf.model_dir import hf_dtype, read_hf_config, with_architecture
from megatron_train.hf.plan import export_plan, hf_shapes
from megatron_train.hf.safetensors_io import DTYPES, INDEX, HFWeights, write_weights
from megatron_train.init import fill_weights
from megatron_train.models.family import Family, Index
from megatron_train.models.hf_config import UNSUPPORTED
from megatron_train.models.registry import family_of
from megatron_train.outputs import check_name_room, check_output_dir, made_dir, publish
from megatron_train.resolve import imported_config

SIDE_DIR = "hf"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack")


@contextmanager
def _staging(out: Path) -> Iterator[Path]:
    """A temporary directory beside ``out`` that becomes ``out`` only if the body succeeds."""
    out = Path(out)
    if os.path.lexists(out):  # a link that leads nowhere, too: the rename would replace it
        raise ConversionError(f"{out} already exists; choose another output directory or remove it")
    check_name_room("--out", out)
    check_output_dir("--out", out.parent)
    with made_dir(out.parent):
        tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            yield tmp
            publish([(tmp, out)], "--out")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _side_files(hf_dir: Path) -> list[Path]:
    """config.json, tokenizer and generation files: everything but the weights."""
    return sorted(
        p for p in Path(hf_dir).iterdir()
        if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES) and p.name != INDEX
    )  # fmt: skip


def _check_dtype(hf: dict, weights: HFWeights) -> torch.dtype:
    found = weights.dtypes()
    names = {v: k for k, v in DTYPES.items()}
    if len(found) != 1 or next(iter(found)) not in names:
        raise ConversionError(
            f"the weights have dtype(s) {sorted(found)}; expected one of {sorted(names)} throughout: save "
            "the model again in one of them"
        )
    dtype = names[next(iter(found))]
    declared = hf_dtype(hf)
    if declared is not None and declared != dtype:
        raise ConversionError(
            f"config.json declares dtype {str(declared).removeprefix('torch.')} but the safetensors hold "
            f"{str(dtype).removeprefix('torch.')}; fix config.json's dtype / torch_dtype"
        )
    return dtype


def _check_transformers_reads(hf_dir: Path) -> None:
    """transformers reads the config.json too: a field of the wrong type that the import itself
    does not use (a token id given as a string) would fail every load of the result, the
    tokenizer's included."""
    import transformers

    # Its warnings on a config it reads (a field it would set otherwise) are not this check's.
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        transformers.AutoConfig.from_pretrained(str(hf_dir))
    except Exception as err:
        # Whatever it raises on a local file is the file's fault: a strict field's TypeError (which
        # names the field, its value and the types it takes), its RoPE validation's KeyError, ...
        cause = err.__cause__ or err
        text = cause.args[0] if isinstance(cause, KeyError) and cause.args else cause
        why = " ".join(str(text).split()).split(". Errors:")[0]
        raise ConversionError(
            f"transformers cannot read {Path(hf_dir) / 'config.json'} ({why}); correct config.json, or "
            "download the model again"
        ) from None
    finally:
        transformers.logging.set_verbosity(verbosity)


def _check_tokenizer(hf_dir: Path, vocab_size: int) -> bool:
    """Whether tokenizer files are present; their vocabulary must fit the embedding."""
    if not any((Path(hf_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer.model")):
        return False
    import transformers

    try:
        tokens = len(transformers.AutoTokenizer.from_pretrained(str(hf_dir)))
    except Exception as err:  # tokenizers, sentencepiece and transformers raise many kinds
        raise ConversionError(
            f"the tokenizer files in {hf_dir} do not load in transformers ({reason(err)}); download the "
            "model's tokenizer files again"
        ) from err
    if tokens > vocab_size:
        raise ConversionError(
            f"the tokenizer in {hf_dir} has {tokens} tokens but config.json's vocab_size is {vocab_size}; "
            "the weights and tokenizer belong to different models; put the model's own tokenizer files "
            "beside it"
        )
    return True


def _check_outside(out: Path, source: Path, what: str) -> None:
    if Path(out).absolute().resolve().is_relative_to(Path(source).absolute().resolve()):
        raise ConversionError(f"--out {out} is inside {what} {source}; choose a folder outside it")


def _check_weights(
    weights: HFWeights, hf: dict, family: Family, m: ModelConfig, log: Callable[[str], None]
) -> None:
    """The stored tensors hold the model config.json describes, those our model lacks all zero; the
    ones it does not take are named, as transformers names the weights it leaves out of a model."""
    weights.check_counts(m.num_layers, m.num_experts)
    zeros = family.hf_zero_tensors(hf, m)
    expected = {**hf_shapes(family, m), **zeros}
    weights.check_shapes(expected)
    for name in zeros:
        if weights.get(name).count_nonzero():
            raise ConversionError(
                f"tensor {name!r} in {weights.dir} is not zero, and megatron-core's GPTModel has no such "
                f"weight (config.json's architecture has it): {UNSUPPORTED}"
            )
    unused = weights.unused(expected)
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        log(
            f"note: {len(unused)} tensor(s) in {weights.dir} are not part of the model its config.json "
            f"describes and are left out, as transformers leaves them out: {', '.join(unused[:3])}{more}"
        )


def import_hf(hf_dir: Path, out: Path, tensor: int = 1, pipeline: int = 1, vocab_pad_multiple: int = 128,
              log: Callable[[str], None] = print) -> Path:  # fmt: skip
    """Convert a Hugging Face model directory into a checkpoint under ``out``; returns its path."""
    hf_dir = Path(hf_dir)
    hf = read_hf_config(hf_dir)
    # Inside it, the checkpoint would become part of the model directory (and be uploaded with it).
    _check_outside(out, hf_dir, "the Hugging Face directory")
    cfg = imported_config(hf, tensor, pipeline, vocab_pad_multiple)
    _check_transformers_reads(hf_dir)
    m, family = cfg.model, family_of(cfg.model)
    weights = HFWeights(hf_dir)
    _check_weights(weights, hf, family, m, log)
    dtype = _check_dtype(hf, weights)
    if _check_tokenizer(hf_dir, m.vocab_size):
        cfg.data.tokenizer.type = "huggingface"
    for caveat in family.hf_caveats(hf):
        log(f"note: {caveat}")
    with _staging(out) as tmp:
        ckpt = files.iteration_dir(tmp, 0)
        final_ckpt = files.iteration_dir(Path(out), 0)
        if cfg.data.tokenizer.type == "huggingface":
            cfg.data.tokenizer.path = str(final_ckpt / SIDE_DIR)
        layout = Layout(tensor, pipeline, virtual_pipeline=1, data=1, world_size=tensor * pipeline)
        common = {
            **metadata(cfg, layout),
            "progress": asdict(Progress(iteration=0, consumed_samples=0)),
            "weights_only": True,
        }
        save_weights(
            ckpt, family.tensors(m), m.num_layers, dtype,
            lambda key, index: family.to_megatron(m, key, index, weights.get), common,
        )  # fmt: skip
        (ckpt / SIDE_DIR).mkdir()
        for path in _side_files(hf_dir):
            shutil.copy2(path, ckpt / SIDE_DIR / path.name)
        files.write_completion_record(ckpt, 0, checksums=True, extra=record_fields(common))
        files.update_tracker(tmp, 0)
    log(
        f"imported {hf['architectures'][0]} ({m.num_layers} layers, hidden {m.hidden_size}, "
        f"vocab {m.vocab_size} padded to {m.padded_vocab_size}, {str(dtype).removeprefix('torch.')}) "
        f"-> {final_ckpt}"
    )
    return final_ckpt


def load_hf_weights(model: list, hf_dir: Path, m: ModelConfig, log: Callable[[str], None]) -> None:
    """Set the model's weights (any TP / PP, DDP-wrapped) from a Hugging Face directory, reading
    one layer of one tensor at a time; ``m`` must be the architecture of its config.json."""
    weights = HFWeights(Path(hf_dir))
    family = family_of(m)
    _check_weights(weights, read_hf_config(Path(hf_dir)), family, m, log)

    def value(key: str, index: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
        return family.to_megatron(m, key, index, weights.get)

    fill_weights(model, value)


class _CheckpointTensors:
    """One slice of one tensor at a time from a checkpoint, converted to transformers' tensors, and
    the ``zeros`` that config.json's architecture has where our model has nothing."""

    def __init__(self, path: Path, family: Family, m: ModelConfig, zeros: dict[str, tuple[int, ...]]) -> None:
        self.path, self.family, self.m, self.zeros = path, family, m, zeros
        self.saved = read_tensor_metadata(path)
        self.names = {name: (key, index) for key, index, names in export_plan(family, m) for name in names}
        self._pending: dict[str, torch.Tensor] = {}

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor to write (transformers reads them by name, in any order)."""
        return {**hf_shapes(self.family, self.m), **self.zeros}

    def _read(self, key: str, index: Index) -> torch.Tensor:
        if key not in self.saved:  # its config implies the tensor: a damaged .metadata left it out
            raise files.changed_in_place(self.path) or files.corrupt(
                f"{self.path} holds no tensor {key}, which its config implies: the checkpoint is corrupt",
                self.path,
            )
        meta = self.saved[key]
        shape, axes = tuple(meta.global_shape), len(index)
        data = torch.empty((*[1] * axes, *shape[axes:]), dtype=meta.dtype)
        offsets = [(axis, at, shape[axis]) for axis, at in enumerate(index)]
        request = ShardedTensor.from_rank_offsets(key, data, *offsets, replica_id=0)
        return read_sharded({"t": request}, self.path, partial=True)["t"][(0,) * axes]

    def __call__(self, name: str) -> torch.Tensor:
        if name in self.zeros:
            return torch.zeros(self.zeros[name])
        if name not in self._pending:
            key, index = self.names[name]
            self._pending = self.family.to_hf(self.m, key, index, self._read(key, index))
        return self._pending.pop(name)


def _imported_config(side: Path, family: Family) -> dict:
    """An imported model's config.json, kept in its checkpoint; a ConversionError where it no
    longer reads as the import read it."""
    path = side / "config.json"
    try:
        hf = json_text.loads(path.read_text())
    except (OSError, ValueError) as err:  # UnicodeDecodeError and JSONDecodeError among them
        problem = f"is unreadable ({reason(err)})"
    else:
        if not isinstance(hf, dict):
            problem = "is unreadable (not a JSON object)"
        elif isinstance(named := with_architecture(hf).get("architectures"), list) and (
            named and named[0] in family.hf_architectures
        ):
            return hf
        else:
            problem = f"names architectures={shown(named)}, not a {family.name} model"
    raise ConversionError(
        f"{path} {problem}: the checkpoint was changed since it was imported; import the model again"
    )


def _hf_side(
    path: Path, common: dict, m: ModelConfig, dtype: torch.dtype | None, tokenizer: Path | None, out: Path
) -> tuple[torch.dtype, dict]:
    """Write config.json and tokenizer files into ``out``; returns the weights' dtype and the
    config.json written."""
    side = path / SIDE_DIR
    if side.is_dir():
        for f in sorted(side.iterdir()):
            shutil.copy2(f, out / f.name)
        hf = _imported_config(side, family_of(m))
        return dtype or hf_dtype(hf) or torch.float32, hf
    dtype = dtype or torch.bfloat16
    saved = _export_tokenizer(common["config"]["data"]["tokenizer"], tokenizer, out)
    if len(saved) > m.vocab_size:
        raise ConversionError(
            f"the tokenizer has {len(saved)} tokens but the model's vocabulary is {m.vocab_size}: "
            "it is not the run's; pass --tokenizer with the one the run trained with"
        )
    # transformers' defaults (bos 1, eos 2) are not our tokenizer's: generation must stop at its eos.
    special = {f"{t}_token_id": getattr(saved, f"{t}_token_id") for t in ("bos", "eos", "pad")}
    for config in family_of(m).hf_configs(m, dtype, special):
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        problem = _auto_tokenizer_problem(out, saved, config["architectures"][0])
        if problem is None:
            return dtype, config
    raise ConversionError(problem)


# Code, indentation, digits and letters outside ASCII: where tokenizers' pipelines differ.
_PROBE = "def main(x):\n    return  x + 1  # héllo wörld 2024 日本"


def _auto_tokenizer_problem(out: Path, saved, architecture: str) -> str | None:
    """Why transformers' AutoTokenizer, as every user of the export loads it, does not read back
    the tokenizer saved (None where it does): for some model types it builds its own class whatever
    tokenizer_config.json names (for every Qwen2 model, Qwen2's byte-level BPE), which splits text
    otherwise."""
    import transformers

    try:
        loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    except Exception as err:  # tokenizers, sentencepiece and transformers raise many kinds
        loaded, why = None, f"fails to load the run's tokenizer ({reason(err)})"
    if loaded is not None:
        theirs, ours = (t(_PROBE, add_special_tokens=False)["input_ids"] for t in (loaded, saved))
        if len(loaded) == len(saved) and theirs == ours:
            return None
        why = (
            f"loads the run's tokenizer as {type(loaded).__name__}, which splits text otherwise "
            f"({_PROBE[:12]!r} gives {theirs[:6]} instead of {ours[:6]})"
            if theirs != ours
            else f"loads the run's tokenizer as {type(loaded).__name__}, with {len(loaded)} tokens "
            f"instead of {len(saved)}"
        )
    return (
        f"in a {architecture} directory, transformers' AutoTokenizer {why}: the model is not exported, as "
        "its users would tokenize text otherwise than it trained on; keep it as a megatron-train "
        "checkpoint (tools/generate.py samples from it)"
    )


def _export_tokenizer(tokenizer: dict, path: Path | None, out: Path):
    """Save the run's tokenizer (``path`` overrides the one its config names) in transformers'
    format into ``out``; returns it."""
    import transformers

    if path is not None and not path.exists():
        raise ConversionError(f"--tokenizer {str(path)!r} {missing(path)}; pass the run's tokenizer")
    path = path or Path(tokenizer["path"])
    if not path.exists():
        raise ConversionError(
            f"the run's tokenizer {str(path)!r} (data.tokenizer.path in its config) {missing(path)}; "
            "pass --tokenizer with where it is now"
        )
    if not (path.is_file() or path.is_dir()):
        # SentencePiece reads it whole: /dev/zero took 16 GB and two minutes to fail.
        raise ConversionError(
            f"the tokenizer {str(path)!r} is neither a file nor a folder (a device, pipe or socket); "
            "pass --tokenizer with the one the run trained with"
        )
    try:
        if tokenizer["type"] == "huggingface":
            hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        else:
            import sentencepiece

            # transformers converts a SentencePiece model it finds as tokenizer.model in a directory;
            # whether words get a leading "▁" must follow the model's own add_dummy_prefix setting.
            pieces = sentencepiece.SentencePieceProcessor(model_file=str(path)).encode("x", out_type=str)
            shutil.copy2(path, out / "tokenizer.model")
            hf_tokenizer = transformers.LlamaTokenizer.from_pretrained(
                str(out), add_prefix_space=pieces[0].startswith("\u2581")
            )
    except Exception as err:  # sentencepiece and transformers raise many kinds
        raise ConversionError(
            f"{path} does not load as the run's {tokenizer['type']} tokenizer ({reason(err)}); "
            "pass --tokenizer with the one the run trained with"
        ) from err
    hf_tokenizer.save_pretrained(str(out))
    return hf_tokenizer


def export_hf(ckpt: Path, out: Path, dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 2**30,
              tokenizer: Path | None = None, log: Callable[[str], None] = print) -> Path:  # fmt: skip
    """Write a checkpoint as a transformers model directory ``out``; returns ``out``. ``tokenizer``
    replaces the path a trained run's config names (imported checkpoints carry their own)."""
    path = files.resolve_explicit(Path(ckpt), being_saved=lambda note: log(f"note: {note}"))
    # Inside it, the export would change the checkpoint (an hf/ folder marks an imported one).
    _check_outside(out, path, "the checkpoint")
    common = read_common(path)
    m = from_dict(ModelConfig, common["config"]["model"])
    family = family_of(m)
    with _staging(out) as tmp:
        dtype, hf = _hf_side(path, common, m, dtype, tokenizer, tmp)
        tensors = _CheckpointTensors(path, family, m, family.hf_zero_tensors(hf, m))
        shards = write_weights(tmp, tensors.shapes(), dtype, tensors, max_shard_bytes)
    log(f"exported {path} -> {out} ({shards} shard(s), {str(dtype).removeprefix('torch.')})")
    return Path(out)
