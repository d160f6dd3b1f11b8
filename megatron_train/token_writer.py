"""Token documents written in megatron-core's indexed dataset format (``.bin`` and ``.idx``) with
numpy alone.

Preprocessing is bound by the tokenizer; importing torch and megatron-core for their
IndexedDatasetBuilder would cost a small job more than its writing. The format's constants are
megatron-core's, checked against it by the tests; every document is one sequence, as in
megatron's builder.
"""

from __future__ import annotations

import itertools
import struct
from array import array
from pathlib import Path
from typing import BinaryIO

import numpy as np

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# megatron-core's DType codes for the token types preprocessing writes.
DTYPE_CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest token type megatron's preprocessing would pick for this vocabulary."""
    return np.dtype(np.uint16 if vocab_size < 65_500 else np.int32)


class TokenWriter:
    """Appends documents to a ``.bin`` file and writes the matching ``.idx`` at the end."""

    def __init__(self, bin_file: BinaryIO, dtype: np.dtype) -> None:
        self._bin, self.dtype = bin_file, np.dtype(dtype)
        self._lengths = array("q")

    def add(self, documents: list[list[int]]) -> int:
        """Append ``documents`` (token ids each); returns the number of tokens written."""
        lengths = [len(d) for d in documents]
        count = sum(lengths)
        tokens = np.fromiter(itertools.chain.from_iterable(documents), self.dtype, count=count)
        self._bin.write(tokens.tobytes())
        self._lengths.extend(lengths)
        return count

    def write_index(self, idx_path: Path) -> None:
        """The ``.idx`` for every document added so far."""
        lengths = np.frombuffer(self._lengths, dtype=np.int64)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1] * self.dtype.itemsize, out=pointers[1:])
        with open(idx_path, "wb") as f:
            f.write(INDEX_HEADER)
            f.write(struct.pack("<QB", INDEX_VERSION, DTYPE_CODES[self.dtype]))
            f.write(struct.pack("<QQ", len(lengths), len(lengths) + 1))
            f.write(lengths.astype(np.int32).tobytes())
            f.write(pointers.tobytes())
            # document i is sequence i: the boundaries are 0, 1, ..., n
            f.write(np.arange(len(lengths) + 1, dtype=np.int64).tobytes())
