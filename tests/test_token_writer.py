"""Our numpy writer of megatron's indexed dataset format against megatron-core's own builder."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder

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
