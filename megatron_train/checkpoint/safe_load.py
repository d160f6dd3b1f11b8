"""Checkpoint loading that cannot run code hidden in a pickle.

A checkpoint directory may come from anywhere. Three things in it are unpickled on load:
``common.pt`` (megatron's torch.load), byte items such as sharded objects (torch DCP's
planner calls ``torch.load(weights_only=False)``) and DCP's ``.metadata`` (plain
``pickle.load``). Inside :func:`safe_unpickling` the first two run with ``weights_only=True``
and the third through an unpickler that only admits DCP's own metadata classes.
"""

from __future__ import annotations

import contextlib
import functools
import io
import pickle
import types
from collections.abc import Iterator

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem

# Module prefixes whose classes DCP's metadata legitimately references.
_METADATA_MODULES = ("torch.distributed.checkpoint.", "torch.distributed._shard.")
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch", "device"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._tensor", "_rebuild_from_type_v2"),
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file references code that loading refuses to run."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = (module, name) in _METADATA_GLOBALS or module.startswith(_METADATA_MODULES)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            allowed = True
        if not allowed:
            raise UnsafeCheckpointError(
                f"checkpoint metadata references {module}.{name}, which is not a checkpoint "
                "metadata class; refusing to load it (the file may be malicious)"
            )
        return super().find_class(module, name)


def _restricted_pickle_module() -> types.ModuleType:
    module = types.ModuleType("restricted_pickle")
    module.load = lambda file, **_: _MetadataUnpickler(file).load()
    module.loads = lambda data, **_: _MetadataUnpickler(io.BytesIO(data)).load()
    module.dump, module.dumps = pickle.dump, pickle.dumps
    return module


def _weights_only_cause(err: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused, without the advice around it to load with
    ``weights_only=False``, which is what this module exists not to do."""
    text = str(err)
    marker = "WeightsUnpickler error:"
    if marker not in text:
        return text
    cause = " ".join(text.split(marker, 1)[1].split("Check the documentation of torch.load", 1)[0].split())
    return f"the weights-only unpickler refused it: {cause}"


@contextlib.contextmanager
def safe_unpickling() -> Iterator[None]:
    """Force weights-only ``torch.load`` and restricted metadata unpickling for the block."""
    original_load, original_pickle = torch.load, dcp_filesystem.pickle

    @functools.wraps(original_load)
    def weights_only_load(*args, **kwargs):
        kwargs["weights_only"] = True
        try:
            return original_load(*args, **kwargs)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(_weights_only_cause(err)) from err

    torch.load, dcp_filesystem.pickle = weights_only_load, _restricted_pickle_module()
    try:
        yield
    finally:
        torch.load, dcp_filesystem.pickle = original_load, original_pickle
