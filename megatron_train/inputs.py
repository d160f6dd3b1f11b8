"""The files a config names, checked before any of them is used: indexed datasets (header,
version, dtype and sizes against the ``.bin``; every ``.idx`` entry of one the data cache has not
met), every split of every dataset (one sample at
least), the tokenizer (loadable as its stated type, and its vocabulary fits the data) and the
output directories (creatable). Each problem is a ConfigError naming the key; nothing is
written."""

from __future__ import annotations

import glob
import math
import os
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import DType
from megatron.core.datasets.utils import normalize
from megatron.core.tokenizers.base_tokenizer import MegatronTokenizerBase

from megatron_train import data_cache
from megatron_train.checkpoint.files import TRACKER
from megatron_train.config import (
    DataConfig,
    ExperimentConfig,
    checkpoint_dir,
    data_cache_dir,
    data_prefixes,
    run_folders,
    split_blends,
)
from megatron_train.errors import ConfigError, missing, not_a_file
from megatron_train.host_memory import physical_memory
from megatron_train.outputs import check_output_file, check_own_dir, check_run_dir
from megatron_train.text_encoding import tokenizer_loading
from megatron_train.token_writer import INDEX_HEADER
from megatron_train.tokenizer import load_tokenizer

# magic (9 bytes), version (u64), dtype code (u8), sequence count (u64), document count (u64)
_HEADER = struct.Struct("<9sQBQQ")
_SPLITS = ("train", "valid", "test")
# What megatron-core's dataset indices take, in bytes: the document index is kept as int32 (one
# entry per document and pass) after numpy.mgrid built it as two int64 grids; the sample index
# holds two int64 per sample and the shuffle index one, at most; a blend adds an int16 and an
# int64 per sample.
_DOCUMENT_INDEX_BYTES, _MGRID_BYTES = 4, 16
_SAMPLE_INDEX_BYTES, _BLEND_INDEX_BYTES = 24, 10
# A weighted blend asks each of its datasets for this share more samples than its weight gives.
_BLEND_SURPLUS = GPTDatasetConfig.mid_level_dataset_surplus
_REPREPROCESS = "preprocess the data again with tools/preprocess_data.py or fix the prefix"
_RETOKENIZE = "preprocess it with this tokenizer, or set data.tokenizer to the one it was made with"
_ID_SAMPLE_BYTES = 16 * 1024
# Entries of an .idx checked at a time: 16 Mi of them hold 192 MiB of lengths and offsets.
_ENTRIES_PER_READ = 1 << 24


def check_indexed_dataset(prefix: str, key: str = "data.blend", entries: bool = False) -> np.dtype:
    """The token dtype of the indexed dataset at ``prefix`` once its ``.idx`` header and its
    sizes agree with each other and with the ``.bin`` (reading a few bytes, whatever the size)
    and, with ``entries``, every entry of the ``.idx`` with the others (reading it all);
    problems are ConfigErrors at ``key``."""
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    stem = prefix[: -len(".bin")]
    if prefix.endswith((".bin", ".idx")) and Path(stem + ".idx").is_file():
        raise ConfigError(key, f"{prefix} is a file of a dataset, not its prefix", f"drop the suffix: {stem}")
    if Path(prefix).is_dir():
        example = next((str(p.with_suffix("")) for p in sorted(Path(prefix).glob("*.idx"))), None)
        fix = (
            f"name each dataset in it by prefix (e.g. {example}), or join them with tools/merge_datasets.py"
            if example
            else "name a dataset by its prefix: PREFIX for PREFIX.bin and PREFIX.idx"
        )
        raise ConfigError(key, f"{prefix} is a folder, not a dataset prefix", fix)
    if glob.has_magic(prefix) and not bin_.exists():
        # tools/preprocess_data.py --input takes patterns; a blend names each dataset itself.
        found = sorted(str(Path(p).with_suffix("")) for p in glob.glob(prefix + ".idx"))
        listed = f"[{', '.join(found[:3])}{', ...' if len(found) > 3 else ''}]"
        fix = f"list the datasets by prefix: {listed if found else 'PREFIX for PREFIX.bin and PREFIX.idx'}"
        if found and key.startswith("data."):
            fix += ", or join them with tools/merge_datasets.py"
        raise ConfigError(key, f"{prefix} is a pattern, which is not expanded here", fix)
    if Path(prefix).is_file() and not bin_.exists():
        raise ConfigError(
            key,
            f"{prefix} is a file, not a dataset prefix (PREFIX for PREFIX.bin and PREFIX.idx)",
            f"turn text into a dataset with tools/preprocess_data.py --input {prefix} --output-prefix PREFIX "
            "and name that PREFIX",
        )
    for path in (bin_, idx):
        if (problem := not_a_file(path)) is not None:
            raise ConfigError(key, f"{path} {problem}", _REPREPROCESS)
    with open(idx, "rb") as f:
        head = f.read(_HEADER.size)
    if len(head) < _HEADER.size or not head.startswith(INDEX_HEADER):
        raise ConfigError(key, f"{idx} is not a megatron index (no MMIDIDX header)", _REPREPROCESS)
    _, version, code, sequences, documents = _HEADER.unpack(head)
    if version != 1:
        raise ConfigError(key, f"{idx} has index version {version}; megatron reads version 1", _REPREPROCESS)
    try:
        dtype = np.dtype(DType.dtype_from_code(code))
    except ValueError:
        raise ConfigError(key, f"{idx} names unknown token dtype code {code}", _REPREPROCESS) from None
    size, expected = idx.stat().st_size, _HEADER.size + sequences * 12 + documents * 8
    if size != expected or sequences == 0:
        raise ConfigError(
            key,
            f"{idx} has {size} bytes where its header ({sequences} sequences, {documents} documents) "
            f"implies {expected}: truncated, empty or damaged",
            _REPREPROCESS,
        )
    lengths, pointers = _lengths_and_pointers(idx, sequences)
    indexed = int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize
    if bin_.stat().st_size != indexed:
        raise ConfigError(
            key,
            f"{bin_} has {bin_.stat().st_size} bytes but {idx} indexes {indexed}: truncated, or the "
            ".bin and .idx come from different runs",
            _REPREPROCESS,
        )
    if entries:
        _check_index_entries(idx, sequences, documents, dtype.itemsize, key)
    return dtype


def _check_index_entries(idx: Path, sequences: int, documents: int, itemsize: int, key: str) -> None:
    """Each sequence's length is >= 0 and it starts where the one before it ends, and the document
    boundaries climb from 0 to the sequence count. megatron-core reads them unchecked: a damaged
    entry was a ValueError or an AssertionError in its index build, or training on other bytes."""
    lengths, pointers = _lengths_and_pointers(idx, sequences)
    boundaries = np.memmap(idx, np.int64, "r", offset=_HEADER.size + 12 * sequences, shape=(documents,))

    def damaged(what: str) -> ConfigError:
        return ConfigError(key, f"{idx} is damaged: {what}", _REPREPROCESS)

    start = 0  # where the next sequence starts in the .bin
    for lo in range(0, sequences, _ENTRIES_PER_READ):
        length = np.asarray(lengths[lo : lo + _ENTRIES_PER_READ], np.int64)
        pointer = np.asarray(pointers[lo : lo + _ENTRIES_PER_READ])
        if (bad := np.flatnonzero(length < 0)).size:
            raise damaged(f"sequence {lo + int(bad[0]):,} has length {int(length[bad[0]]):,}")
        ends = pointer + length * itemsize
        expected = np.concatenate(([start], ends[:-1]))
        if (bad := np.flatnonzero(pointer != expected)).size:
            i = int(bad[0])
            raise damaged(
                f"sequence {lo + i:,} starts at byte {int(pointer[i]):,}, not {int(expected[i]):,} where the "
                "one before it ends"
            )
        start = int(ends[-1])
    last = 0
    for lo in range(0, documents, _ENTRIES_PER_READ):
        bound = np.asarray(boundaries[lo : lo + _ENTRIES_PER_READ])
        if (bad := np.flatnonzero((np.diff(bound, prepend=last) < 0) | (bound > sequences))).size:
            i = int(bad[0])
            raise damaged(
                f"document boundary {lo + i:,} is sequence {int(bound[i]):,}, outside 0..{sequences:,} or "
                "before the one before it"
            )
        last = int(bound[-1])
    if documents == 0 or boundaries[0] != 0 or last != sequences:
        raise damaged(f"its document boundaries do not run from sequence 0 to the last, {sequences:,}")


def largest_sampled_id(prefix: str, dtype: np.dtype) -> int:
    """The largest token id in three slices of the checked dataset's ``.bin`` (its start, middle
    and end, ``_ID_SAMPLE_BYTES`` each): a dataset tokenized with a larger vocabulary than the
    run's shows ids beyond it in any slice, and every rank reads this little whatever the size."""
    if not np.issubdtype(dtype, np.integer) or os.path.getsize(prefix + ".bin") == 0:
        return 0
    tokens = np.memmap(prefix + ".bin", dtype, "r")
    width = _ID_SAMPLE_BYTES // dtype.itemsize
    starts = {0, max(tokens.size // 2 - width // 2, 0), max(tokens.size - width, 0)}
    return max(int(tokens[start : start + width].max()) for start in starts)


def _lengths_and_pointers(idx: Path, sequences: int) -> tuple[np.ndarray, np.ndarray]:
    # Mapped, not read: a sum over a large dataset's lengths would read all of them.
    lengths = np.memmap(idx, np.int32, "r", offset=_HEADER.size, shape=(sequences,))
    pointers = np.memmap(idx, np.int64, "r", offset=_HEADER.size + 4 * sequences, shape=(sequences,))
    return lengths, pointers


class SplitSize(NamedTuple):
    """One split of an indexed dataset as megatron's builder cuts it."""

    sequences: int
    tokens: int


def split_sizes(prefix: str, split: str) -> list[SplitSize | None]:
    """The sequences and tokens in each split (train, valid, test) of the checked indexed dataset
    at ``prefix``, cut as megatron's builder cuts it: by sequence, each boundary rounded. None for
    a split with no share."""
    idx = Path(prefix + ".idx")
    with open(idx, "rb") as f:
        _, _, code, sequences, _ = _HEADER.unpack(f.read(_HEADER.size))
    itemsize = np.dtype(DType.dtype_from_code(code)).itemsize
    lengths, pointers = _lengths_and_pointers(idx, sequences)
    sizes: list[SplitSize | None] = []
    for bounds in convert_split_vector_to_split_matrix(parse_and_normalize_split(split)):
        if bounds is None:
            sizes.append(None)
            continue
        begin, end = (int(round(b * float(sequences))) for b in bounds)
        if end <= begin:
            sizes.append(SplitSize(0, 0))
            continue
        # The sequences lie in order in the .bin: two pointers give the tokens between them.
        tokens = (int(pointers[end - 1]) - int(pointers[begin])) // itemsize + int(lengths[end - 1])
        sizes.append(SplitSize(end - begin, tokens))
    return sizes


def dataset_split_sizes(cfg: ExperimentConfig, prefixes: list[str]) -> dict[str, list[SplitSize | None]]:
    """Each dataset's :func:`split_sizes` as this run reads it: cut by ``data.split``, or, with
    ``data.valid_blend``, whole for each split whose blend (:func:`split_blends`) names it."""
    d = cfg.data
    if d.valid_blend is None:
        return {prefix: split_sizes(prefix, d.split) for prefix in prefixes}
    sizes: dict[str, list[SplitSize | None]] = {prefix: [None, None, None] for prefix in prefixes}
    for index, blend in enumerate(split_blends(cfg)):
        for prefix in blend[0] if blend else []:
            sizes[prefix][index] = split_sizes(prefix, "1,0,0")[0]
    return sizes


def check_splits_hold_a_sample(sizes: dict[str, list[SplitSize | None]], d: DataConfig) -> None:
    """Every split with a share (``sizes``: :func:`dataset_split_sizes`), of every dataset, holds
    one sample (``data.seq_length`` + 1 tokens). megatron-core would stop on an assertion for an
    unweighted blend, and loop forever over an empty split of a weighted one."""
    short = [
        (prefix, name, size.tokens)
        for prefix, splits in sizes.items()
        for name, size in zip(_SPLITS, splits, strict=True)
        if size is not None and size.tokens < d.seq_length + 1
    ]
    if not short:
        return
    prefix, name, tokens = short[0]
    more = f" (and {len(short) - 1} more dataset splits)" if len(short) > 1 else ""
    sample = f"fewer than one sample of data.seq_length + 1 = {d.seq_length + 1}{more}"
    if d.valid_blend is None:
        raise ConfigError(
            "data.blend",
            f"the {name} split of {prefix} (data.split={d.split}) holds {tokens} tokens, {sample}",
            "merge small datasets with tools/merge_datasets.py, leave this one out, or give that split "
            "no share in data.split",
        )
    key = "data.valid_blend" if name == "valid" else "data.blend"
    raise ConfigError(
        key,
        f"{prefix} holds {tokens} tokens, {sample}",
        f"merge small datasets with tools/merge_datasets.py or leave this one out of {key}",
    )


def requested_samples(cfg: ExperimentConfig, consumed_samples: int = 0, steps_done: int = 0) -> list[int]:
    """The samples a run asks of its blend, per split (train, valid, test): every step's, and one
    evaluation's (each evaluation reads the same ones). A run resumed after ``steps_done`` steps
    that read ``consumed_samples`` asks for those and its remaining steps' (a resume that lowers
    ``train.global_batch_size`` reads more than ``train.steps`` of the new batches)."""
    t = cfg.train
    valid = t.eval_steps * t.global_batch_size if t.eval_interval > 0 else 0
    return [consumed_samples + (t.steps - steps_done) * t.global_batch_size, valid, 0]


def epochs(samples: int, seq_length: int, tokens: int) -> int:
    """The passes megatron's GPTDataset makes over a split of ``tokens`` tokens to cut ``samples``
    samples (each needs one token beyond its sequence)."""
    return max(1, -(-(samples * seq_length + 1) // tokens))


def check_index_memory(
    cfg: ExperimentConfig,
    sizes: dict[str, list[SplitSize | None]],
    consumed_samples: int = 0,
    steps_done: int = 0,
) -> None:
    """The dataset indices megatron-core builds in memory for this run (``sizes``: each dataset's
    :func:`dataset_split_sizes`; ``consumed_samples`` and ``steps_done`` as in
    :func:`requested_samples`) fit this machine's memory.

    A run far longer than its data (``train.steps`` by mistake in the billions) otherwise stops in
    numpy's allocation after a long loop, or loops for hours counting epochs one at a time.
    """
    largest = (0, "", "", 0, 0)
    resident = transient = 0
    requested = requested_samples(cfg, consumed_samples, steps_done)
    for split_index, (samples, blend) in enumerate(zip(requested, split_blends(cfg), strict=True)):
        if blend is None:
            continue
        prefixes, weights = blend
        if samples and len(prefixes) > 1:
            resident += samples * _BLEND_INDEX_BYTES
        # Shares first, as megatron-core's builder takes them: a weight near the largest float
        # times the samples would overflow.
        shares = None if weights is None else normalize(weights)
        for i, prefix in enumerate(prefixes):
            size = sizes[prefix][split_index]
            if size is None or samples == 0:
                continue
            if shares is None and len(prefixes) > 1:
                wanted = 0  # an unweighted blend makes one pass over each dataset
            elif shares is None:
                wanted = samples
            else:
                wanted = math.ceil(math.ceil(samples * shares[i]) * (1 + _BLEND_SURPLUS))
            passes = epochs(wanted, cfg.data.seq_length, size.tokens)
            documents = passes * size.sequences
            resident += documents * _DOCUMENT_INDEX_BYTES + wanted * _SAMPLE_INDEX_BYTES
            transient = max(transient, documents * _MGRID_BYTES)
            if documents > largest[0]:
                largest = (documents, prefix, _SPLITS[split_index], passes, size.tokens)
    needed, available = resident + transient, physical_memory()
    if needed > available:
        _, prefix, name, passes, tokens = largest
        key = "train.steps" if name == "train" else "train.eval_steps"
        steps = cfg.train.steps if name == "train" else cfg.train.eval_steps
        asked = f"{steps:,} steps of {cfg.train.global_batch_size} samples"
        if name == "train" and steps_done:
            asked = (
                f"resumed after {steps_done:,} steps that read {consumed_samples:,} samples, "
                f"{steps - steps_done:,} more steps of {cfg.train.global_batch_size}"
            )
        raise ConfigError(
            key,
            f"{asked} need {passes:,} passes over the "
            f"{name} split of {prefix} ({tokens:,} tokens), whose dataset indices megatron-core builds "
            f"in memory: {needed / 2**30:,.1f} GiB, more than this machine's {available / 2**30:,.1f} GiB",
            f"lower {key} or train.global_batch_size, or give the run more data",
        )


def check_resumed_index_memory(cfg: ExperimentConfig, consumed_samples: int, steps_done: int) -> None:
    """:func:`check_index_memory` for a run resumed after ``steps_done`` steps, when it asks more
    of its data than the start-up check counted (its ``train.global_batch_size`` is lower than the
    checkpoint's)."""
    if requested_samples(cfg, consumed_samples, steps_done)[0] <= requested_samples(cfg)[0]:
        return
    sizes = dataset_split_sizes(cfg, list(data_prefixes(cfg.data)))
    check_index_memory(cfg, sizes, consumed_samples, steps_done)


def checked_tokenizer(
    kind: str, path: str | None, key: str = "data.tokenizer.path", type_key: str = "data.tokenizer.type"
) -> MegatronTokenizerBase:
    """The tokenizer at ``path``, loaded as ``kind``; anything that is not one is a ConfigError at
    ``key`` (whose fix may name ``type_key``, the option giving the type)."""
    if path is None:
        raise ConfigError(key, "no tokenizer given", f"set {key} to the tokenizer's path")
    with tokenizer_loading(kind, path, key, type_key=type_key):
        tokenizer = load_tokenizer(kind, path)
        tokenizer.vocab_size  # noqa: B018 - some loaders fail only here
    return tokenizer


def check_inputs(cfg: ExperimentConfig) -> int:
    """Every file the config names, checked; returns the tokenizer's vocabulary size."""
    c = cfg.checkpoint
    if c.init_from and not Path(c.init_from).exists():
        raise ConfigError(
            "checkpoint.init_from",
            f"{c.init_from!r} {missing(c.init_from)}",
            "point it at a checkpoint or a Hugging Face model directory",
        )
    if c.init_from and not Path(c.init_from).is_dir():
        raise ConfigError(
            "checkpoint.init_from",
            f"{c.init_from!r} is a file"
            if Path(c.init_from).is_file()
            else f"{c.init_from!r} is not a directory",
            "point it at a checkpoint directory or a Hugging Face model directory",
        )
    if not cfg.data.blend:
        raise ConfigError("data.blend", "no training data given", "list dataset prefixes")
    keys = data_prefixes(cfg.data)
    # A dataset read through the data cache for the first time has every .idx entry checked (as
    # megatron-core's first index build reads them all anyway); later starts read a few bytes.
    seen = data_cache.built_from(data_cache_dir(cfg))
    dtypes = {prefix: check_indexed_dataset(prefix, key, prefix not in seen) for prefix, key in keys.items()}
    sizes = dataset_split_sizes(cfg, list(dtypes))
    check_splits_hold_a_sample(sizes, cfg.data)
    check_index_memory(cfg, sizes)
    tokenizer = checked_tokenizer(cfg.data.tokenizer.type, cfg.data.tokenizer.path)
    vocab = tokenizer.vocab_size
    if cfg.data.document_mask and tokenizer.eod is None:
        raise ConfigError(
            "data.document_mask",
            f"needs documents to end with an end-of-document token, but {cfg.data.tokenizer.path} has none",
            "use a tokenizer with an EOS token (and preprocess with it) or set data.document_mask=false",
        )
    for prefix, dtype in dtypes.items():
        if np.issubdtype(dtype, np.integer) and vocab - 1 > np.iinfo(dtype).max:
            raise ConfigError(
                keys[prefix],
                f"{prefix} stores tokens as {dtype}, too small for the tokenizer's {vocab} tokens: it was "
                "tokenized with another tokenizer",
                _RETOKENIZE,
            )
        largest = largest_sampled_id(prefix, dtype)
        if largest >= vocab:
            raise ConfigError(
                keys[prefix],
                f"{prefix} holds token id {largest}, beyond the tokenizer's {vocab} tokens: it was "
                "tokenized with another tokenizer",
                _RETOKENIZE,
            )
    check_run_dir("logging.run_dir", Path(cfg.logging.run_dir))
    folders = {
        **run_folders(cfg),
        "checkpoint.save_dir": checkpoint_dir(cfg),
        "data.cache_dir": data_cache_dir(cfg),
    }
    for key, folder in folders.items():
        check_own_dir(key, folder)
    # The files a start rewrites in them: a directory there failed the first save, or the start.
    for key, written in (
        ("checkpoint.save_dir", checkpoint_dir(cfg) / TRACKER),
        ("data.cache_dir", data_cache_dir(cfg) / data_cache.RECORD),
        ("data.cache_dir", data_cache_dir(cfg) / data_cache.LOCK),
    ):
        check_output_file(key, written)
    data_cache.check_unchanged(data_cache_dir(cfg), keys)
    data_cache.check_no_folders(data_cache_dir(cfg))
    return vocab
