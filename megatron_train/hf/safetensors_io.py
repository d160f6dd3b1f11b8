"""Reading and writing Hugging Face safetensors shards one tensor at a time.

Reading goes through ``safetensors.safe_open`` (memory-mapped, one tensor materialised per
call). Writing streams too: ``safetensors.torch.save_file`` would hold a whole shard plus a byte
copy of it, so shards are written as header + tensors in sequence, in the format safetensors
documents (8-byte little-endian header length, JSON header of dtype/shape/offsets, raw data).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import safe_open

from megatron_train import json_text
from megatron_train.errors import ConversionError, check_readable, denied, reason
from megatron_train.hf.model_dir import missing_weights

INDEX = "model.safetensors.index.json"
DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def _open_shard(path: Path):
    check_readable(path)
    try:
        return safe_open(path, "pt")
    except Exception as err:  # safetensors raises its own error type, or OSError
        raise ConversionError(
            f"{path} is not a readable safetensors file ({reason(err)}); download it again"
        ) from err


def _read_index(path: Path) -> dict[str, str]:
    try:
        weight_map = json_text.loads(path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        if denied(err):
            raise
        raise ConversionError(
            f"{path} is not a safetensors index with a weight_map ({err}); download the model again"
        ) from err
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConversionError(
            f"{path}: weight_map is not a mapping of tensor names to shard files; download the model again"
        )
    return weight_map


def _is_file(path: Path) -> bool:
    """``path.is_file()``, False for a name too long for the file system (no file has it); a
    folder this user may not look into is not a missing shard, and the entry point names it."""
    try:
        return path.is_file()
    except OSError as err:
        if denied(err):
            raise
        return False


_NUMBERED = re.compile(r"^(.*\.(?:layers|experts))\.(\d+)\.")
"""A tensor of a numbered layer or expert: ``model.layers.<i>.``, ``....experts.<j>.`` in every
family's naming; the prefix names one layer's experts apart from another's."""


def _numbered_counts(names: Iterable[str]) -> dict[str, int]:
    """How many layers or experts each ``...layers`` / ``...experts`` prefix of these names numbers."""
    counts: dict[str, int] = {}
    for match in filter(None, map(_NUMBERED.match, names)):
        prefix, index = match.groups()
        counts[prefix] = max(counts.get(prefix, 0), int(index) + 1)
    return counts


_NOT_WEIGHTS = re.compile(r"(^|\.)rotary_emb\.inv_freq$|^lm_head\.weight$")
"""Stored by some exports and never loaded by transformers: RoPE's inverse frequencies (a buffer
it computes) and, in a model with tied embeddings, a copy of the output layer."""


class HFWeights:
    """The tensors of a Hugging Face model directory, found through its shard index."""

    def __init__(self, hf_dir: Path) -> None:
        self.dir = Path(hf_dir)
        index = self.dir / INDEX
        if index.is_file():
            weight_map = _read_index(index)
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                raise ConversionError(f"{self.dir}: {missing_weights(self.dir)}")
            if len(shards) != 1:
                raise ConversionError(
                    f"{self.dir} has {len(shards)} .safetensors files and no {INDEX}; "
                    "expected model.safetensors or an index naming the shards: download the model again"
                )
            with _open_shard(shards[0]) as f:
                weight_map = {name: shards[0].name for name in f.keys()}
        missing = sorted({s for s in weight_map.values() if not _is_file(self.dir / s)})
        if missing:
            raise ConversionError(
                f"{self.dir} lacks shard file(s) {', '.join(missing)} named in {INDEX}; download them again"
            )
        self.weight_map: dict[str, str] = weight_map
        self._open: dict[str, object] = {}

    def _file(self, shard: str):
        # One shard stays mapped at a time: its touched pages count towards RSS until unmapped.
        if shard not in self._open:
            self._open.clear()
            self._open[shard] = _open_shard(self.dir / shard)
        return self._open[shard]

    def _file_with(self, name: str):
        if name not in self.weight_map:
            raise ConversionError(
                f"tensor {name!r} is missing from {self.dir} (an incomplete download?); download the "
                "model again"
            )
        return self._file(self.weight_map[name])

    def get(self, name: str) -> torch.Tensor:
        """One tensor, read from its shard."""
        tensor = self._file_with(name).get_tensor(name)
        # Weights that are not finite make every loss NaN from the first step on; the file is
        # damaged (or the model diverged before it was saved), and training from it cannot help.
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ConversionError(
                f"tensor {name!r} in {self.dir} holds NaN or infinite values: the file is damaged; "
                "download the model again"
            )
        return tensor

    def check_counts(self, layers: int, experts: int | None) -> None:
        """config.json describes no more layers, or experts in a layer, than the weights number (names
        only). Run before any shape is planned: a damaged config.json's ten million layers took
        minutes and 12 GB to plan before the first missing tensor was named."""
        stored = _numbered_counts(self.weight_map)
        for kind, described in (("layers", layers), ("experts", experts)):
            held = max((count for prefix, count in stored.items() if prefix.endswith(f".{kind}")), default=0)
            # Experts stored fused, not numbered, are left to the shape check.
            if described is not None and described > held and (held or kind == "layers"):
                raise ConversionError(
                    f"config.json describes {described:,} {kind}, but {self.dir} holds {held:,}: "
                    "the weights and config.json belong to different models (or a download is "
                    "incomplete); download the model again"
                )

    def check_shapes(self, expected: dict[str, tuple[int, ...]]) -> None:
        """Every expected tensor is stored with the expected shape, and no layer or expert beyond
        the expected ones is stored (headers only)."""
        # Other stored names pass (old checkpoints keep RoPE's inv_freq buffers, tied ones may keep
        # lm_head), but a layer or expert past config.json's count means a config cut short: the
        # import would drop them without a word.
        described = _numbered_counts(expected)
        for prefix, count in _numbered_counts(self.weight_map).items():
            if count > (expected_count := described.get(prefix, 0)):
                kind = prefix.rsplit(".", 1)[-1]
                raise ConversionError(
                    f"{self.dir} holds tensors of {prefix}.{count - 1}, beyond the {expected_count} "
                    f"{kind} config.json describes there: the weights and config.json belong to different "
                    "models; download the model again"
                )
        for name, shape in expected.items():
            stored = tuple(self._file_with(name).get_slice(name).get_shape())
            if stored != tuple(shape):
                raise ConversionError(
                    f"tensor {name!r} in {self.dir} has shape {stored} but config.json implies "
                    f"{tuple(shape)}: the weights and config.json belong to different models; download "
                    "the model again"
                )

    def unused(self, expected: Iterable[str]) -> list[str]:
        """Stored tensors outside ``expected``, other than the ones no model loads."""
        expected = set(expected)
        return sorted(n for n in self.weight_map if n not in expected and not _NOT_WEIGHTS.search(n))

    def dtypes(self) -> set[str]:
        """The safetensors dtype names (``BF16``...) of every stored tensor, from the headers."""
        found = set()
        for shard in sorted(set(self.weight_map.values())):
            f = self._file(shard)
            found |= {f.get_slice(name).get_dtype() for name in f.keys()}
        return found


def _plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Tensor names grouped into shards of at most ``max_shard_bytes`` (a larger tensor alone)."""
    shards, current, used = [], [], 0
    for name, size in sizes.items():
        if current and used + size > max_shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current:
        shards.append(current)
    return shards


def _write_shard(
    path: Path, names: list[str], shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
    produce: Callable[[str], torch.Tensor],
) -> None:  # fmt: skip
    """Write one safetensors file, asking ``produce`` for each tensor in turn."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name in names:
        nbytes = itemsize * int(torch.Size(shapes[name]).numel())
        span = [offset, offset + nbytes]
        header[name] = {"dtype": DTYPES[dtype], "shape": list(shapes[name]), "data_offsets": span}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(header_bytes)))
        out.write(header_bytes)
        for name in names:
            tensor = produce(name).to(dtype).contiguous()
            if tuple(tensor.shape) != tuple(shapes[name]):
                raise ValueError(f"{name}: produced shape {tuple(tensor.shape)}, planned {shapes[name]}")
            out.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))


def write_weights(
    out_dir: Path, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
    produce: Callable[[str], torch.Tensor], max_shard_bytes: int,
) -> int:  # fmt: skip
    """Write a model's tensors as transformers does: ``model.safetensors``, or numbered shards of at
    most ``max_shard_bytes`` plus ``model.safetensors.index.json``. Returns the shard count."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = {name: itemsize * torch.Size(shape).numel() for name, shape in shapes.items()}
    shards = _plan_shards(sizes, max_shard_bytes)
    if len(shards) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        weight_map = {name: file for file, names in zip(files, shards) for name in names}
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (Path(out_dir) / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    for file, names in zip(files, shards):
        _write_shard(Path(out_dir) / file, names, shapes, dtype, produce)
    return len(shards)
