"""megatron-core's optional wandb imports, skipped: they cost every process half a second.

Three megatron-core 0.16.1 modules that a training process imports (its timers, and the dynamic
inference context and engine that GPTModel's modules pull in) try ``import wandb`` as they load
and fall back to ``wandb = None``. Their wandb use (timer writers, inference metrics) is none of
this framework's, and wandb's import took 0.5 s of the 3.3 s that importing the training loop took
on the dev machine, in every rank of every run. So while those modules load, wandb looks absent
to them, unless it is already imported; it stays importable for our own metrics
(``logging.wandb``). Nothing here imports torch, megatron or wandb.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

_WANDB_OPTIONAL_IN = frozenset(
    {
        "megatron.core.timers",
        "megatron.core.inference.contexts.dynamic_context",
        "megatron.core.inference.engines.dynamic_engine",
    }
)


@contextlib.contextmanager
def absent(package: str) -> Iterator[None]:
    """Inside the block, ``import package`` raises ModuleNotFoundError, unless it was imported
    before; afterwards it imports as usual."""
    if package in sys.modules:
        yield
        return
    sys.modules[package] = None  # what the import system reads as "not found here"
    try:
        yield
    finally:
        if sys.modules.get(package, False) is None:
            del sys.modules[package]


class _WithoutWandb(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: ModuleType | None = None) -> Any:
        if name not in _WANDB_OPTIONAL_IN:
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        if spec is not None and spec.loader is not None:
            load = spec.loader.exec_module

            def exec_module(module: ModuleType) -> None:
                with absent("wandb"):
                    load(module)

            spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Make those modules' first import in this process see no wandb (idempotent)."""
    if not any(isinstance(finder, _WithoutWandb) for finder in sys.meta_path):
        sys.meta_path.insert(0, _WithoutWandb())
