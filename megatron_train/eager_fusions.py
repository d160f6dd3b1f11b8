"""Without a GPU, megatron-core's small fused functions run eagerly rather than through torch.compile.

``megatron.core.jit`` binds ``jit_fuser = torch.compile`` when megatron.core is first imported, and
a dozen functions are decorated with it then (more inside constructors later). On a machine without
a GPU that costs every process about 1.4 s of start-up importing Inductor, and the few such functions
a CPU run calls (the MoE router's expert bias, the experts' probability-weighted activation) each
compile C++ kernels in every rank. So on such a machine megatron.core's own import sees an identity
for ``torch.compile``, which ``megatron.core.jit`` keeps as its ``jit_fuser``; torch.compile itself
is restored as soon as that import ends. Nothing here imports torch or megatron until megatron.core
is imported.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

_PACKAGE = "megatron.core"


def _eager(model: Callable | None = None, **_: Any) -> Any:
    """``torch.compile``'s two forms, ``compile(fn)`` and ``compile(**options)(fn)``, compiling nothing."""
    return model if model is not None else (lambda fn: fn)


class _MegatronCoreWithoutCompile(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: ModuleType | None = None) -> Any:
        if name != _PACKAGE:
            return None
        sys.meta_path.remove(self)
        spec = None
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        if spec is not None and spec.loader is not None:
            load = spec.loader.exec_module

            def exec_module(module: ModuleType) -> None:
                import torch

                compile_ = torch.compile
                torch.compile = _eager
                try:
                    load(module)
                finally:
                    torch.compile = compile_

            spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Make megatron.core's first import in this process keep its fusions eager (call only where
    there is no GPU; a no-op once megatron.core is imported)."""
    if _PACKAGE not in sys.modules:
        sys.meta_path.insert(0, _MegatronCoreWithoutCompile())
