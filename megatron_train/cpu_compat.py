"""Run megatron-core on CPU over gloo.

megatron-core assumes CUDA throughout: it asks for the current CUDA device, allocates with
``device="cuda"``, moves tensors with ``.cuda()``, checks ``Tensor.type()`` strings, keeps a
CUDA RNG tracker and overlaps work on CUDA streams. None of that exists without a GPU, so this
module redirects each of those to its CPU equivalent. It is the only place in megatron-train
that does so, and :func:`enable` refuses to run when CUDA is available.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        # A bare integer is a CUDA ordinal in torch's device parsing.
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _plain_backward(kwargs: dict) -> bool:
    """Whether ``torch.autograd.backward`` was dispatched with explicit gradients and nothing else."""
    return (
        kwargs.get("grad_tensors") is not None
        and not kwargs.get("create_graph")
        and kwargs.get("inputs") is None
    )


class _CpuDeviceMode(TorchFunctionMode):
    """Rewrites CUDA devices to CPU in every torch call that takes one.

    megatron-core passes ``device=torch.cuda.current_device()`` or ``device="cuda"`` to factory
    functions and ``.to()``, and stages host-to-device copies in pinned memory, which needs an
    accelerator; a function mode sees every such call in one place.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.autograd.backward and _plain_backward(kwargs):
            # megatron's activation recompute calls torch.autograd.backward(outputs, grads) from
            # inside the backward pass. Dispatching it here popped this mode, so the recomputed
            # part's backward (and the collectives it allocates for) would run without it: run
            # the engine directly, as megatron's custom_backward does, with the mode pushed back.
            grads = kwargs["grad_tensors"]
            grads = (grads,) if isinstance(grads, torch.Tensor) else tuple(grads)
            with self:
                torch.autograd.Variable._execution_engine.run_backward(
                    tuple(args[0]), grads, bool(kwargs["retain_graph"]), False, (), True, True
                )
            return None
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for ``torch.cuda.Stream``: CPU work is already ordered on one thread."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event: Any = None) -> _NullEvent:
        return event or _NullEvent()


class _NullEvent:
    """Stands in for ``torch.cuda.Event``; megatron only records and waits on it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


def _tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    # Tensors already live on the only device there is.
    return self


_original_tensor_type = torch.Tensor.type


def _tensor_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    # The distributed optimizer accepts parameters only if type() names a CUDA tensor type.
    if not args and not kwargs and self.dtype in _CUDA_TYPE_NAMES:
        return _CUDA_TYPE_NAMES[self.dtype]
    return _original_tensor_type(self, *args, **kwargs)


def _cpu_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


_original_all_gather = torch.distributed.all_gather


def _all_gather_uneven(tensor_list: list, tensor: torch.Tensor, group: Any = None, async_op: bool = False):
    """``all_gather`` into tensors whose first dimensions differ, which gloo refuses.

    megatron's MoE token dispatcher gathers each rank's tokens over expert-TP ranks this way (the
    token counts differ); NCCL accepts it. Rows are padded to the longest, gathered and trimmed.
    """
    trailing = {tuple(t.shape[1:]) for t in tensor_list} | {tuple(tensor.shape[1:])}
    rows = {t.shape[0] for t in tensor_list} | {tensor.shape[0]}
    if len(rows) == 1 or len(trailing) != 1 or async_op:
        return _original_all_gather(tensor_list, tensor, group=group, async_op=async_op)
    longest = max(rows)
    mine = tensor.new_zeros((longest, *tensor.shape[1:]))
    mine[: tensor.shape[0]] = tensor
    padded = [torch.empty_like(mine) for _ in tensor_list]
    _original_all_gather(padded, mine, group=group)
    for out, full in zip(tensor_list, padded):
        out.copy_(full[: out.shape[0]])
    return None


def enable() -> None:
    """Redirect megatron-core's CUDA calls to the CPU. Idempotent; refuses when CUDA exists."""
    global _ENABLED
    if _ENABLED:
        return
    if torch.cuda.is_available():
        raise RuntimeError("cpu_compat.enable() must not be used on a machine with CUDA")

    # megatron-core uses the returned ordinal as a device; the function mode maps it to CPU.
    torch.cuda.current_device = lambda: 0
    torch.cuda.set_device = lambda device: None
    torch.cuda.device_count = lambda: 0
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullEvent
    torch.cuda.current_stream = lambda device=None: _NullStream()
    torch.cuda.default_stream = lambda device=None: _NullStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.set_stream = lambda stream: None
    torch.cuda.max_memory_allocated = lambda device=None: 0
    torch.cuda.memory_allocated = lambda device=None: 0

    # The model-parallel RNG tracker forks and restores "the CUDA generator" around dropout and
    # weight init; on CPU the generator those ops actually draw from is the CPU default one.
    torch.cuda.get_rng_state = _cpu_rng_state
    torch.cuda.set_rng_state = _set_cpu_rng_state
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    # torch.manual_seed calls this after seeding the CPU generator; there is nothing more to seed.
    torch.cuda.manual_seed_all = lambda seed: None
    from megatron_train import megatron_compat

    megatron_compat.redirect_cuda_rng_state(
        lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state(), _set_cpu_rng_state
    )
    megatron_compat.optimizer_without_cuda_kernels()

    torch.distributed.all_gather = _all_gather_uneven
    torch.Tensor.cuda = _tensor_cuda
    torch.Tensor.type = _tensor_type
    _CpuDeviceMode().__enter__()
    # megatron-core's notes on the CPU path (fused kernels unavailable, CUDA settings that do not
    # apply, deprecations on the ShardedTensor it builds here) say nothing a CPU run can act on.
    warnings.filterwarnings("ignore", module="megatron")
    _ENABLED = True


def is_enabled() -> bool:
    """Whether the CPU redirection is active in this process."""
    return _ENABLED
