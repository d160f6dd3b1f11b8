"""One cuDNN in the process: Transformer Engine is pointed at the cuDNN torch itself loads.

A pip-installed CUDA torch loads the cuDNN of its ``nvidia-cudnn-cu*`` requirement. Transformer
Engine, which megatron-core imports at its own import wherever TE is installed, loads cuDNN
itself and prefers any other copy to that pip one: ``CUDNN_HOME``, ``CUDNN_PATH``, ``CUDA_HOME``,
``CUDA_PATH``, /usr/local/cuda, then the linker's search path (its ``common/__init__.py``). On an
image that also has a system cuDNN of another version, the process then holds parts of both (on the
lent H200, TE 2.11 imported after torch had used its cuDNN: ``OSError:
/lib/x86_64-linux-gnu/libcudnn_cnn.so.9: undefined symbol: ..., version libcudnn_graph.so.9``).
TE reads ``CUDNN_PATH`` before its other places, so setting it to torch's copy leaves one.
An image whose torch is built against the system cuDNN (NGC's) has no such requirement, and a
``CUDNN_HOME`` or ``CUDNN_PATH`` the user set is theirs: both are left as they are.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path


def torch_cudnn_folder() -> Path | None:
    """The root (``lib/``, ``include/``) of the cuDNN of torch's own ``nvidia-cudnn-*``
    requirement, where that package is installed; None otherwise. A root, as ``CUDNN_PATH`` is
    for TE's and torch's extension builds; TE's loader searches below it."""
    try:
        requirements = importlib.metadata.requires("torch") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for requirement in requirements:
        name = re.match(r"[A-Za-z0-9._-]+", requirement)[0]
        if not re.sub(r"[._]", "-", name.lower()).startswith("nvidia-cudnn"):
            continue
        try:
            files = importlib.metadata.files(name) or []
        except importlib.metadata.PackageNotFoundError:
            return None
        for file in files:
            if re.fullmatch(r"libcudnn\.so(\.\d+)*", file.name):
                path = Path(file.locate())
                return path.parent.parent if path.is_file() else None
    return None


def share_torch_cudnn() -> None:
    """Set ``CUDNN_PATH`` to torch's cuDNN, unless the user chose one, before anything
    imports Transformer Engine; child processes (ranks, tools) inherit it."""
    if os.environ.get("CUDNN_HOME") or os.environ.get("CUDNN_PATH"):
        return
    folder = torch_cudnn_folder()
    if folder is not None:
        os.environ["CUDNN_PATH"] = str(folder)
