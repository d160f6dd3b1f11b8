"""Our numpy writer of megatron's indexed dataset format against megatron-core's own builder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

from megatron_train.errors import ConfigError
from megatron_train.outputs import dataset_files, discard_partial_dataset
from megatron_train.token_writer import DTYPE_CODES, TokenWriter, token_dtype


def test_the_dtype_codes_are_megatrons():
    """The header's bytes are checked by the byte-identical files below."""
    assert DTYPE_CODES == {np.dtype(t): DType.code_from_dtype(t) for t in (np.uint16, np.int32)}


@pytest.mark.parametrize("vocab_size", [4096, 128_256])
def test_the_files_are_byte_identical_to_megatrons_builder(tmp_path, vocab_size):
    dtype = token_dtype(vocab_size)
    rng = np.random.default_rng(0)
    sizes = [rng.integers(1, 300, n) for n in (5, 1, 17)]
    batches = [[rng.integers(0, vocab_size, int(n)).tolist() for n in batch] for batch in sizes]
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=dtype.type)
    with open(tmp_path / "ours.bin", "wb") as f:
        writer = TokenWriter(f, dtype)
        for batch in batches:
            assert writer.add(batch) == sum(map(len, batch))
            for doc in batch:
                builder.add_item(torch.tensor(doc))
                builder.end_document()
        writer.write_index(tmp_path / "ours.idx")
    builder.finalize(str(tmp_path / "ref.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"ref{suffix}").read_bytes()
    read = IndexedDataset(str(tmp_path / "ours"))
    docs = [d for batch in batches for d in batch]
    assert len(read) == len(docs) and read[len(docs) - 1].tolist() == docs[-1]
    assert read.index.dtype == dtype.type


def test_a_dataset_is_written_by_one_process_at_a_time_and_never_over_a_finished_one(tmp_path):
    """The same command started twice wrote both runs' tokens into one temporary file, and the
    second ended in a traceback when the first had renamed it."""
    prefix = tmp_path / "d"
    with dataset_files(prefix, "--output-prefix") as (tmp_bin, tmp_idx):
        tmp_bin.write_bytes(b"first")
        # Another open file of the same path, as another process would have: the lock is per open.
        with pytest.raises(ConfigError, match="being written by another process now"):
            with dataset_files(prefix, "--output-prefix"):
                pass
        assert tmp_bin.read_bytes() == b"first"
        tmp_idx.write_bytes(b"index")
    assert (tmp_path / "d.bin").read_bytes() == b"first"
    with pytest.raises(ConfigError, match="written by another process meanwhile"):
        with dataset_files(prefix, "--output-prefix"):
            pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]


def test_partial_files_are_discarded_unless_another_process_writes_them(tmp_path):
    prefix = tmp_path / "d"
    (tmp_path / "d.bin.tmp").write_bytes(b"left by a killed writer")
    (tmp_path / "d.idx.tmp").write_bytes(b"")
    discard_partial_dataset(prefix)
    assert not list(tmp_path.iterdir())
    with dataset_files(prefix, "--output-dir") as (tmp_bin, tmp_idx):
        tmp_bin.write_bytes(b"being written")
        discard_partial_dataset(prefix)
        assert tmp_bin.read_bytes() == b"being written"
        tmp_idx.write_bytes(b"index")
