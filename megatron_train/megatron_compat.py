"""Every megatron-core private name and version-specific behaviour megatron-train relies on.

Written against megatron-core 0.16.1 (pyproject pins ``>=0.16.1,<0.17``). Each entry says what
it works around; ``tests/test_megatron_compat.py`` fails when an upgrade removes a name used
here or fixes the behaviour worked around, which is when its entry should change. The CUDA ->
CPU redirection (``cpu_compat``) reaches megatron's private names only through this module. One
entry lives apart, in ``eager_fusions``: it must act before megatron.core is first imported, which
this module does at its top.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from megatron.core import optimizer as mcore_optimizers
from megatron.core import package_info
from megatron.core import utils as mcore_utils
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.common import TorchCommonSaveStrategy
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer import optimizer as mcore_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.tensor_parallel import layers as mcore_layers
from megatron.core.tensor_parallel import random as mcore_random
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.moe import moe_utils, token_dispatcher
from megatron.core.transformer.moe.router import TopKRouter
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from megatron_train.optional_imports import absent

TESTED = SpecifierSet(">=0.16.1,<0.17")
"""The megatron-core versions this module was checked against (pyproject pins the same)."""


DATASET_INDEX_LOGGER = "megatron.core.datasets.gpt_dataset"
DATASET_INDEX_MESSAGE = re.compile(r"(Build and save|Load) the GPTDataset (train|valid|test) indices")
"""While building a blend, megatron's GPTDataset logs one of these lines (at INFO, on rank 0) per
dataset and split, as it starts building its sample index or reading it from the cache. It has
no other signal of progress."""

ASYNC_WRITER_LOGGER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
ASYNC_WRITER_FAILURE = re.compile(r"^Local process \d+ encountered an error: ")
"""When a checkpoint's writer process fails (a full disk), megatron logs this line before raising
the same error, which our save reports in its own words."""
ASYNC_WRITER_GONE = "results_queue should not be empty"
"""0.16: what a rank's save finalisation raises when its writer process ended without reporting a
result, having been killed (the out-of-memory killer's SIGKILL, say) or having crashed."""


def is_tested_version() -> bool:
    """Whether the installed megatron-core is in :data:`TESTED`."""
    return Version(package_info.__version__) in TESTED


if not is_tested_version():
    warnings.warn(
        f"megatron-core {package_info.__version__} is outside the tested range {TESTED}; "
        "megatron_train/megatron_compat.py lists what may break",
        stacklevel=1,
    )


def distributed_optimizers(optimizer: Any) -> list[DistributedOptimizer]:
    """The DistributedOptimizers inside megatron's (possibly chained) optimizer."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [opt for opt in inner if isinstance(opt, DistributedOptimizer)]


def use_write_results_queue(queue: Any) -> None:
    """Make megatron's checkpoint writer (``FileSystemWriterAsync``, which synchronous saves use
    too) report through ``queue``.

    0.16: ``filesystem_async`` creates its results queue lazily on the first save (a Manager
    with default signal handling, so the stop signal that asks for a save kills it) and keeps it
    in the private module global ``_results_queue``; its writer calls only ``put`` and the
    training process only ``get_nowait``.
    """
    filesystem_async._results_queue = queue


def last_async_call_exitcode(queue: AsyncCallsQueue) -> int | None:
    """The exit code of the writer process of the newest call on ``queue``; None while it runs.

    0.16: see :func:`fork_last_async_call_again`.
    """
    _, caller, _ = queue.async_calls[-1]
    return caller.process.exitcode


def fork_last_async_call_again(queue: AsyncCallsQueue) -> None:
    """Kill the writer process of the newest call on ``queue`` and fork a new one for it.

    0.16: ``AsyncCallsQueue.async_calls`` holds ``(idx, caller, request)`` per call; a
    ``TemporalAsyncCaller`` keeps the process it forked in ``process``, and its
    ``schedule_async_call`` forks for a request as the queue passes it (its index, no finalizers).
    """
    idx, caller, request = queue.async_calls[-1]
    caller.process.kill()
    caller.process.join()
    caller.schedule_async_call(request._replace(call_idx=idx, finalize_fns=[]))


def init_optimizer_state(opt: DistributedOptimizer) -> None:
    """Give a fresh distributed optimizer its Adam state, so a checkpoint can be loaded into it.

    0.16: with torch's Adam (no apex / TE) megatron reads the step count from the state, which
    exists only after a step; its private ``_init_optimizer_states_with_dummy_values`` takes a
    zero-gradient step. The LR is zeroed around it so weight decay leaves the weights alone.
    """
    lrs = [group["lr"] for group in opt.optimizer.param_groups]
    for group in opt.optimizer.param_groups:
        group["lr"] = 0.0
    opt._init_optimizer_states_with_dummy_values()
    for group, lr in zip(opt.optimizer.param_groups, lrs):
        group["lr"] = lr


@contextlib.contextmanager
def keeping_torch_adam_step(optimizer: Any) -> Iterator[None]:
    """Load a distributed optimizer state into torch's Adam (no apex / TE).

    0.16: megatron restores Adam's per-parameter ``step`` from the param groups, then its private
    ``_set_main_param_and_optimizer_states`` copies every state entry from the loaded tensors.
    A ``fully_reshardable`` state lacks ``step`` (KeyError); a ``dp_reshardable`` one carries the
    step the fresh optimizer had when the load was requested, which would overwrite the restored
    one (Adam's bias correction then restarts). Either way the step already in place is handed
    back as its own source. On exit every parameter gets its own ``step`` tensor: the same path
    leaves one shared tensor, which torch's Adam would then increment once per parameter.
    """
    patched = distributed_optimizers(optimizer)
    for opt in patched:
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, opt=opt, original=original):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
            step = opt.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
            original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for param_state in opt.optimizer.state.values():
            if torch.is_tensor(param_state.get("step")):
                param_state["step"] = param_state["step"].clone()


def mark_tensor_parallel_weights(model_chunks: list[torch.nn.Module]) -> None:
    """Tag the weights megatron's parallel layers split over TP ranks.

    0.16: the layers set ``tensor_model_parallel`` on their weights only inside megatron's own
    weight init, which we turn off (``perform_initialization=False``); untagged, the gradient
    norm (and so clipping) counts every split weight on TP rank 0 alone and is too small at TP > 1.
    """
    split_dims = ((ColumnParallelLinear, 0), (VocabParallelEmbedding, 0), (RowParallelLinear, 1))
    for chunk in model_chunks:
        for module in chunk.modules():
            weight = getattr(module, "weight", None)
            if weight is None or getattr(weight, "tensor_model_parallel", False):
                continue
            for layer_type, dim in split_dims:
                if isinstance(module, layer_type):
                    set_tensor_model_parallel_attributes(weight, True, dim, 1)
                    break


def write_checkpoint_extras(common: dict, ckpt_dir: Path) -> None:
    """Write what megatron's torch_dist format keeps beside the tensor files: ``common.pt`` (the
    non-tensor state) and ``metadata.json`` (the format). 0.16: their writers live in
    ``dist_checkpointing.core`` and ``strategies.common``."""
    TorchCommonSaveStrategy("torch", 1).save_common(common, ckpt_dir)
    save_config(CheckpointingConfig(sharded_backend="torch_dist"), str(ckpt_dir))


_original_checkpoint_init = mcore_random.CheckpointWithoutOutput.__init__


def _checkpoint_init_without_te(self, fp8=False) -> None:
    _original_checkpoint_init(self, None if fp8 is False else fp8)


def recompute_without_transformer_engine() -> None:
    """Let selective recompute of norms (and MoE activations) run without Transformer Engine.

    0.16.1: ``CheckpointWithoutOutput(fp8=False)``, as the transformer layer and MoE experts build
    it, sets ``self.fp8 = fp8 is not None``, i.e. True, and then calls TE's FP8 state manager,
    which is undefined without TE (NameError). Without TE there is no FP8, so False becomes None.
    With TE installed nothing changes (TE answers whether FP8 is on). Idempotent.
    """
    if not mcore_random.HAVE_TE:
        mcore_random.CheckpointWithoutOutput.__init__ = _checkpoint_init_without_te


def redirect_cuda_rng_state(get: Callable[..., torch.Tensor], set_: Callable[..., None]) -> None:
    """Make megatron's RNG tracker read and write the generator ``get`` / ``set_`` stand for.

    0.16: the tracker's fork calls the private ``_get_cuda_rng_state`` / ``_set_cuda_rng_state``
    of ``tensor_parallel.random`` directly, not ``torch.cuda``'s functions. Its fork also logs a
    warning whenever the CPU generator moved inside it, which on a GPU means some op drew from
    the wrong generator; redirected, the CPU generator is the forked one, so every dropout inside a
    fork (attention dropout: once a layer and micro-batch) moves it as intended: that warning goes.
    """
    mcore_random._get_cuda_rng_state = get
    mcore_random._set_cuda_rng_state = set_
    logging.getLogger(mcore_random.__name__).addFilter(
        lambda record: record.getMessage() != "CPU RNG state changed within GPU RNG context"
    )


def optimizer_without_cuda_kernels() -> None:
    """Make megatron's optimizer use torch's Adam and its own per-tensor ops on a CPU machine.

    0.16.1: ``megatron.core.optimizer`` picks Transformer Engine's (else apex's) fused Adam and SGD,
    and ``clip_grads`` and ``optimizer`` bind their fused ``multi_tensor_applier`` / ``_l2norm`` /
    ``_scale``, whenever TE imports, GPU or not: a CPU run where TE is installed (a CPU node in an
    NGC image) fails in CUDA at its first step. These are what megatron binds when neither TE nor
    apex is installed; where neither is, nothing changes. Idempotent.
    """
    mcore_optimizers.Adam, mcore_optimizers.SGD = torch.optim.AdamW, torch.optim.SGD
    mcore_optimizers.USING_PYTORCH_OPTIMIZER = True
    clip_grads.multi_tensor_applier = mcore_utils.local_multi_tensor_applier
    clip_grads.l2_norm_impl = mcore_utils.local_multi_tensor_l2_norm
    clip_grads.multi_tensor_scale_impl = mcore_utils.local_multi_tensor_scale
    mcore_optimizer.multi_tensor_applier = mcore_utils.local_multi_tensor_applier
    mcore_optimizer.multi_tensor_scale_impl = mcore_utils.local_multi_tensor_scale


def compiled_layers_without_warnings() -> None:
    """Keep each compiled transformer layer one graph at TP1.

    0.16.1: ``RowParallelLinear.forward`` passes ``tp_group=None`` to its linear function, and
    ``get_tensor_model_parallel_group_if_none`` then warns on rank 0 at every call. torch.compile
    cannot trace ``warnings.warn`` and splits the layer there, so compiled code drops warnings
    (torch releases without this switch keep the split). Idempotent.
    """
    ignored = getattr(torch._dynamo.config, "ignore_logging_functions", None)
    if ignored is not None:
        ignored.add(warnings.warn)


_TOKENIZER_LIBRARIES = "megatron.core.tokenizers.text.libraries"
# The two of them that import transformers (module: where from, the name), each setting its
# HAVE_TRANSFORMERS by whether it could.
_TRANSFORMERS_USERS = {
    "huggingface_tokenizer": ("transformers", "AutoTokenizer"),
    "chat_template": ("transformers.utils.chat_template_utils", "_compile_jinja_template"),
}


def tokenizer_libraries_without_transformers() -> None:
    """Import megatron-core's tokenizer libraries without transformers, for a SentencePiece
    tokenizer: 0.16.1's ``tokenizers.text.libraries`` package imports its Hugging Face wrapper with
    the rest, whose ``import transformers`` took 1.1 s of every rank's start-up on the dev machine.
    The wrapper and its chat-template helper then record that transformers is missing, which
    :func:`tokenizer_libraries_with_transformers` undoes. A no-op once either is imported."""
    if _TOKENIZER_LIBRARIES not in sys.modules:
        with absent("transformers"):
            importlib.import_module(_TOKENIZER_LIBRARIES)


def tokenizer_libraries_with_transformers() -> None:
    """Give megatron-core's Hugging Face tokenizer wrapper the transformers names its own import
    sets, where :func:`tokenizer_libraries_without_transformers` left them out. Idempotent."""
    for name, (source, attribute) in _TRANSFORMERS_USERS.items():
        module = sys.modules.get(f"{_TOKENIZER_LIBRARIES}.{name}")
        if module is not None and not module.HAVE_TRANSFORMERS:
            setattr(module, attribute, getattr(importlib.import_module(source), attribute))
            module.HAVE_TRANSFORMERS = True


_TRACED_LINEAR = mcore_layers.linear_with_grad_accumulation_and_async_allreduce


def linears_outside_compiled_graphs(on: bool) -> None:
    """Run megatron's linear function outside torch.compile's graphs (``on``), or inside them.

    0.16.1: with gradient accumulation fusion, ``LinearWithGradAccumulationAndAsyncCommunication``
    keeps the weight's ``main_grad`` on its autograd context for its backward to add the weight
    gradient into. Dynamo cannot trace that side effect: it tries to, gives up and splits the
    graph there anyway. Excluding the function splits it there directly: the GEMMs run as in eager
    mode, what lies between them (norms, RoPE, SwiGLU, residual adds) compiled. The linears'
    ``_forward_impl`` look the function up in their module at each call. Idempotent.
    """
    mcore_layers.linear_with_grad_accumulation_and_async_allreduce = (
        torch.compiler.disable(_TRACED_LINEAR) if on else _TRACED_LINEAR
    )


def moe_router_without_transformer_engine() -> None:
    """Let megatron's MoE router run without Transformer Engine.

    0.16.1: ``moe_utils`` imports ``te_general_gemm`` only when TE imports, yet the router's
    gating GEMM tests ``te_general_gemm is not None`` unconditionally (NameError without TE).
    Defining it as None selects the plain ``torch.mm`` path it already has. Idempotent.
    """
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


_original_move_to_cpu = moe_utils.maybe_move_tensor_to_cpu


def _move_to_cpu_as_asked(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    moved = _original_move_to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)
    if as_numpy and torch.is_tensor(moved):
        return moved.numpy()
    return moved


def moe_split_sizes_on_cpu() -> None:
    """Give the alltoall token dispatcher's split sizes the form gloo accepts on CPU.

    0.16.1: ``maybe_move_tensor_to_cpu(t, as_numpy=True)`` converts to numpy only a CUDA tensor;
    a CPU tensor comes back as a tensor, which ``all_to_all_single`` refuses as split sizes. On
    GPU the sizes are already numpy; this makes CPU tensors follow the same path. Idempotent.
    """
    token_dispatcher.maybe_move_tensor_to_cpu = _move_to_cpu_as_asked


_original_attach_aux_loss = TopKRouter.attach_and_log_load_balancing_loss


def _attach_aux_loss_per_sequence(self, activation, aux_loss_coeff, aux_loss, aux_loss_name, reduce_group,
                                  reduce_group_has_dp=False, valid_token_count=None):  # fmt: skip
    holders = (
        self.tp_group.size() if self.config.sequence_parallel else 1
    ) * self.config.context_parallel_size
    if self.calculate_per_token_loss and holders > 1:
        tokens = activation.shape[0] if valid_token_count is None else valid_token_count
        valid_token_count = tokens * holders
    return _original_attach_aux_loss(
        self,
        activation,
        aux_loss_coeff,
        aux_loss,
        aux_loss_name,
        reduce_group,
        reduce_group_has_dp,
        valid_token_count,
    )


def moe_aux_loss_over_split_sequences() -> None:
    """Give the load-balancing loss its full gradient when a sequence's tokens are split over
    ranks: over TP ranks by sequence parallelism, over CP ranks by context parallelism.

    0.16.1: with ``calculate_per_token_loss`` each rank multiplies its part of the aux loss by the
    tokens it holds, to cancel ``finalize_model_grads`` dividing by the language-model loss's token
    count. A rank holding 1/n of a sequence's tokens computes only its part of the sequence's aux
    loss, so the parts sum to the sequence's loss times its local tokens: the gradient comes out n
    times too small (measured: TP2 + SP with coefficient 2c trains exactly like one rank with c;
    CP2's gradient norm is off by 7e-4 relative at c = 0.01). megatron's schedules scale by the CP
    size for the per-micro-batch loss but not here. The sequence's whole token count is used
    instead. Idempotent.
    """
    TopKRouter.attach_and_log_load_balancing_loss = _attach_aux_loss_per_sequence


def _accumulate_weight_gradient(
    total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor
) -> None:
    """``main_grad += grad_output^T @ total_input``, the product summed in main_grad's precision."""
    if main_grad.is_cuda and total_input.dtype != main_grad.dtype:
        # One cuBLAS call: bf16 operands, fp32 accumulation, added onto the fp32 gradient in place.
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)
    else:
        # The same dtype throughout (``.to`` is then no copy), or the CPU's upcast operands.
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


def _accumulates_correctly(device: str = "cuda") -> bool:
    """Whether bf16 products accumulate into an fp32 gradient here, and add up (on a GPU: whether
    this torch has addmm's in-place bf16 x bf16 -> fp32 form)."""
    gen = torch.Generator(device=device).manual_seed(0)
    x, dy = (torch.randn(256, n, device=device, generator=gen).bfloat16() for n in (64, 96))
    grad = torch.randn(96, 64, device=device, generator=gen)
    # In float64: no TF32 setting (NVIDIA_TF32_OVERRIDE in NGC images) reaches the reference.
    expected = grad.double() + dy.double().t() @ x.double()
    try:
        _accumulate_weight_gradient(x, dy, grad)
    except (RuntimeError, TypeError):
        return False
    return torch.allclose(grad.double(), expected, rtol=1e-4, atol=1e-4)


def weight_gradient_accumulation_in_torch() -> bool:
    """Let megatron's own linears accumulate weight gradients straight into ``main_grad`` without
    apex; returns whether they now can (``gradient_accumulation_fusion`` may be set).

    0.16.1: ``tensor_parallel.layers`` binds apex's ``fused_weight_gradient_mlp_cuda`` (its
    ``wgrad_gemm_accum_fp32`` / ``_fp16``: ``main_grad += grad_output^T @ input`` in one GEMM) as a
    module global when apex imports, and refuses ``gradient_accumulation_fusion`` otherwise. These
    are the same two functions made of ``torch.addmm``; on a GPU its ``out_dtype`` form accumulates
    bf16 products into the fp32 gradient, which a small product checks once (a torch without that
    form, or one that adds wrongly, leaves the fusion off). Without the fusion, each micro-batch
    writes a bf16 weight gradient that megatron's gradient hook then adds to ``main_grad``: one
    more pass over every gradient. With apex on a GPU nothing changes. Idempotent.
    """
    bound = getattr(mcore_layers, "fused_weight_gradient_mlp_cuda", None)
    if isinstance(bound, SimpleNamespace) or (bound is not None and torch.cuda.is_available()):
        return True
    # apex's kernels are CUDA's only: a CPU process uses these even where apex is installed.
    if torch.cuda.is_available() and not _accumulates_correctly():
        return False
    mcore_layers.fused_weight_gradient_mlp_cuda = SimpleNamespace(
        wgrad_gemm_accum_fp32=_accumulate_weight_gradient, wgrad_gemm_accum_fp16=_accumulate_weight_gradient
    )
    mcore_layers._grad_accum_fusion_available = True
    return True


_UNFUSED_ROPE = rope_utils._apply_rotary_pos_emb_bshd


@functools.cache
def _compiled_rope() -> Callable[..., torch.Tensor]:
    # One compiled function for the process: each shape (queries, keys) compiles once.
    return torch.compile(_UNFUSED_ROPE, dynamic=False)


def compile_rotary_embedding(on: bool) -> None:
    """Run the local spec's rotary embedding compiled (``on``) or as megatron-core wrote it.

    0.16.1: megatron-core fuses RoPE only through Transformer Engine (``apply_rope_fusion``). Its
    own ``rope_utils._apply_rotary_pos_emb_bshd``, which ``apply_rotary_pos_emb`` looks up at each
    call, launches about ten small kernels for each of a layer's queries and keys: cos and sin of
    the table and their casts, the rotation's chunk, negation and concatenation, the products, and
    a final concatenation that copies the whole tensor. Compiled, Inductor fuses them (forward and
    backward). Setting it back to megatron's function keeps one process's runs independent.
    """
    rope_utils._apply_rotary_pos_emb_bshd = _compiled_rope() if on else _UNFUSED_ROPE
