"""The megatron-core boundary: each workaround in megatron_train/megatron_compat.py is checked
against the installed megatron-core, so an upgrade that moves a private name or fixes what we
work around fails here, naming the entry to revisit."""

from __future__ import annotations

import collections
import inspect
import re
import textwrap
from pathlib import Path

import pytest
from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.tensor_parallel import random as mcore_random
from packaging.specifiers import SpecifierSet

from megatron_train import megatron_compat
from tests.conftest import ROOT, run_tool


def test_installed_megatron_core_is_the_tested_range_pyproject_pins():
    assert megatron_compat.is_tested_version()
    pin = re.search(r'"megatron-core([^"]+)"', (ROOT / "pyproject.toml").read_text())
    assert pin and SpecifierSet(pin.group(1)) == megatron_compat.TESTED


def test_private_names_we_use_still_exist():
    assert hasattr(filesystem_async, "_results_queue")
    assert "_results_queue" in inspect.getsource(filesystem_async._get_write_results_queue)
    assert list(inspect.signature(DistributedOptimizer._set_main_param_and_optimizer_states).parameters) == [
        "self", "model_param", "tensors",
    ]  # fmt: skip
    assert callable(DistributedOptimizer._init_optimizer_states_with_dummy_values)
    if not mcore_random.HAVE_TE:
        # Megatron's own __init__ (this process may have applied the workaround already).
        probe = mcore_random.CheckpointWithoutOutput.__new__(mcore_random.CheckpointWithoutOutput)
        megatron_compat._original_checkpoint_init(probe)
        assert probe.fp8, "megatron fixed CheckpointWithoutOutput's fp8 flag"
        megatron_compat.recompute_without_transformer_engine()
        assert not mcore_random.CheckpointWithoutOutput().fp8
    tracker_fork = inspect.getsource(mcore_random.CudaRNGStatesTracker.fork)
    assert "_get_cuda_rng_state" in tracker_fork and "_set_cuda_rng_state" in tracker_fork
    # fork_last_async_call_again (test_checkpoint hangs a writer to run it).
    assert async_utils._ActiveAsyncRequest._fields == ("idx", "async_caller", "async_request")
    assert isinstance(async_utils.AsyncCallsQueue().async_calls, collections.deque)
    assert "self.process = ctx.Process(" in inspect.getsource(
        async_utils.TemporalAsyncCaller.schedule_async_call
    )
    assert "get_context('fork')" in inspect.getsource(async_utils.TemporalAsyncCaller.schedule_async_call)


def test_dp_reshardable_load_still_copies_the_requested_step_with_autograd_on():
    """What ``state.load_optimizer`` (no_grad) and ``keeping_torch_adam_step`` (the step in place)
    work around; a bitwise resume from a dp_reshardable save (test_checkpoint) shows they work."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    source = inspect.getsource(DistributedOptimizer.load_parameter_state_from_dp_reshardable)
    assert "no_grad" not in source, "megatron now loads dp_reshardable states without autograd"
    assert "step" not in source, "megatron now leaves Adam's step out of dp_reshardable loads"


COMPILED_LAYER_SCRIPT = textwrap.dedent(
    """
    import torch
    from torch._dynamo.utils import counters
    from megatron_train import runtime
    from megatron_train.model import build_model
    from megatron_train.resolve import build_config

    model = {"preset": "tiny", "vocab_size": 256, "compile": True}
    cfg = build_config({"model": model, "train": {"steps": 4}})
    rt = runtime.initialize(cfg, runtime.LaunchEnv(rank=0, world_size=1, local_rank=0))
    [model] = build_model(cfg, rt)
    tokens = torch.randint(0, 256, (2, 32))
    model(tokens, torch.arange(32).expand(2, 32), None).sum()
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"
    assert not counters["graph_break"], dict(counters["graph_break"])
    print("OK")
    """
)


def test_a_compiled_layer_is_one_graph_though_row_parallel_linear_warns_on_every_call():
    """What ``compiled_layers_without_warnings`` works around, and that it works."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    assert "tp_group=None" in inspect.getsource(RowParallelLinear.forward), (
        "megatron's row-parallel linear now passes its tensor-parallel group: no need to drop warnings"
    )
    result = run_tool("-c", COMPILED_LAYER_SCRIPT, check=False)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


def test_moe_workarounds_are_still_needed():
    """What the MoE entries work around; test_moe's expert-parallel layouts (EP2 x TP2 with
    sequence parallelism among them) and test_context_parallel's MoE layout equal one rank only
    with them in place."""
    import torch
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE:
        source = inspect.getsource(moe_utils)
        assert "te_general_gemm is not None" in source and "te_general_gemm = None" not in source, (
            "megatron now defines te_general_gemm without Transformer Engine"
        )
    moved = megatron_compat._original_move_to_cpu(torch.tensor([1, 2]), as_numpy=True)
    assert torch.is_tensor(moved), "megatron now hands CPU split sizes back as numpy"
    attach = inspect.getsource(megatron_compat._original_attach_aux_loss)
    assert (
        "else activation.shape[0]" in attach
        and "tp_group" not in attach
        and "sequence_parallel" not in attach
    ), "megatron now scales the load-balancing loss for split sequences (SP, CP) itself"


SCRIPT = textwrap.dedent(
    """
    import torch
    from megatron_train import megatron_compat, runtime
    from megatron_train.model import build_chunks, build_model
    from megatron_train.optim import build_optimizer
    from megatron_train.resolve import build_config

    cfg = build_config({"model": {"preset": "tiny", "vocab_size": 256}, "train": {"steps": 4}})
    rt = runtime.initialize(cfg, runtime.LaunchEnv(rank=0, world_size=1, local_rank=0))

    # megatron tags split weights only inside its own init, which we turn off.
    chunk = build_chunks(cfg, rt)[0]
    qkv = chunk.decoder.layers[0].self_attention.linear_qkv.weight
    assert not getattr(qkv, "tensor_model_parallel", False), "megatron now tags weights itself"
    megatron_compat.mark_tensor_parallel_weights([chunk])
    assert qkv.tensor_model_parallel and qkv.partition_dim == 0

    model = build_model(cfg, rt)
    optimizer, _ = build_optimizer(cfg, model, rt.dtype)
    [opt] = megatron_compat.distributed_optimizers(optimizer)
    assert not opt.optimizer.state
    weights = [p.detach().clone() for p in model[0].parameters()]
    megatron_compat.init_optimizer_state(opt)
    assert all("step" in s for s in opt.optimizer.state.values())
    unmoved = all(torch.equal(w, p) for w, p in zip(weights, model[0].parameters()))
    assert unmoved, "the dummy step moved weights"

    # A fully reshardable state has no "step"; megatron's own copy still fails on it.
    param = next(iter(opt.model_param_group_index_map))
    group, order = opt.model_param_group_index_map[param]
    main = opt.optimizer.param_groups[group]["params"][order]
    loaded = {"param": main.detach().clone() + 1, **{
        k: v.clone() for k, v in opt.optimizer.state[main].items() if k != "step"}}
    try:
        with torch.no_grad():
            opt._set_main_param_and_optimizer_states(param, loaded)
    except KeyError as err:
        assert "step" in str(err)
    else:
        raise AssertionError("megatron now restores torch Adam states without 'step'")
    with megatron_compat.keeping_torch_adam_step(optimizer), torch.no_grad():
        opt._set_main_param_and_optimizer_states(param, loaded)
    assert torch.equal(main, loaded["param"])
    steps = [s["step"] for s in opt.optimizer.state.values()]
    assert len({id(s) for s in steps}) == len(steps)
    print("OK")
    """
)


def test_workarounds_are_still_needed_and_work_on_real_megatron_objects():
    result = run_tool("-c", SCRIPT, check=False)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


TE_BOUND_SCRIPT = textwrap.dedent(
    """
    import torch
    from megatron.core import optimizer as mcore_optimizers
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    def fused_cuda_op(*args, **kwargs):
        raise RuntimeError("a CUDA kernel on a CPU run")

    class FusedAdam(torch.optim.Optimizer):
        def __init__(self, *args, **kwargs):
            raise RuntimeError("TE's FusedAdam on a CPU run")

    # What megatron binds at import where Transformer Engine imports, GPU or not.
    mcore_optimizers.Adam, mcore_optimizers.USING_PYTORCH_OPTIMIZER = FusedAdam, False
    for module in (clip_grads, mcore_optimizer):
        module.multi_tensor_applier = module.multi_tensor_scale_impl = fused_cuda_op
    clip_grads.l2_norm_impl = fused_cuda_op

    from megatron_train import megatron_compat, runtime
    from megatron_train.model import build_model
    from megatron_train.optim import build_optimizer
    from megatron_train.resolve import build_config

    cfg = build_config({"model": {"preset": "tiny", "vocab_size": 256}, "train": {"steps": 4}})
    rt = runtime.initialize(cfg, runtime.LaunchEnv(rank=0, world_size=1, local_rank=0))
    model = build_model(cfg, rt)
    optimizer, _ = build_optimizer(cfg, model, rt.dtype)
    [opt] = megatron_compat.distributed_optimizers(optimizer)
    assert type(opt.optimizer) is torch.optim.AdamW
    for buffer in model[0].buffers:
        buffer.grad_data.fill_(0.5)
    updated, grad_norm, _ = optimizer.step()
    assert updated and grad_norm > 0, grad_norm
    print("OK")
    """
)


def test_a_cpu_run_steps_with_torch_ops_where_transformer_engine_imports():
    """Where TE imports, megatron's optimizer modules bind its fused CUDA Adam and multi-tensor
    ops, GPU or not; CI has no TE, so that binding is made by hand before the runtime starts. The
    CPU runtime puts back torch's AdamW and megatron's local ops, and a step runs. (On the dev
    machine with TE 2.11 installed, the demo's first step failed in CUDA without this.)"""
    from megatron.core import optimizer as mcore_optimizers
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer

    # megatron still chooses through these module-level names.
    chooser = inspect.getsource(mcore_optimizers._get_megatron_optimizer_based_on_param_groups)
    assert "USING_PYTORCH_OPTIMIZER" in chooser and "adam_cls = Adam" in chooser
    assert "multi_tensor_applier(\n" in inspect.getsource(clip_grads.get_grad_norm_fp32)
    assert "multi_tensor_applier(multi_tensor_scale_impl" in inspect.getsource(mcore_optimizer)
    result = run_tool("-c", TE_BOUND_SCRIPT, check=False)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


STEP_GRADIENTS = textwrap.dedent(
    """
    import torch

    from megatron_train import megatron_compat, runtime
    from megatron_train.model import build_model
    from megatron_train.optim import build_optimizer
    from megatron_train.resolve import build_config
    from megatron_train.step import Stepper

    def step_gradients(micro_batches, before_build=lambda: None, **model_options):
        # One training step of a 2-layer tied model on random tokens: its gradients and its
        # megatron TransformerConfig.
        cfg = build_config({
            "model": {"preset": "tiny", "num_layers": 2, "vocab_size": 256, "tie_embeddings": True,
                      **model_options},
            "data": {"seq_length": 64},
            "train": {"steps": 4, "micro_batch_size": 2, "global_batch_size": 2 * micro_batches},
        })
        rt = runtime.initialize(cfg, runtime.LaunchEnv(rank=0, world_size=1, local_rank=0))
        before_build()
        model = build_model(cfg, rt)
        optimizer, scheduler = build_optimizer(cfg, model, rt.dtype)
        gen = torch.Generator().manual_seed(0)

        def batches():
            while True:
                tokens = torch.randint(0, 256, (2, 65), generator=gen)
                yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, 64),
                       "position_ids": torch.arange(64).expand(2, 64)}

        Stepper(cfg, model, optimizer, scheduler, rt.device).train_step([batches()])
        grads = torch.cat([b.grad_data.clone() for b in model[0].buffers])
        runtime.shutdown()
        assert torch.count_nonzero(grads) > 0.99 * grads.numel()
        return grads, model[0].config
    """
)

FUSED_WGRAD_SCRIPT = STEP_GRADIENTS + textwrap.dedent(
    """
    from megatron.core.tensor_parallel import layers as mcore_layers

    calls = []

    def count_calls():
        assert megatron_compat.weight_gradient_accumulation_in_torch()
        # The stand-in stays bound for the process: count its first function once.
        bound = mcore_layers.fused_weight_gradient_mlp_cuda
        accumulate = bound.uncounted = getattr(bound, "uncounted", bound.wgrad_gemm_accum_fp32)
        bound.wgrad_gemm_accum_fp32 = lambda *args: calls.append(1) or accumulate(*args)

    plain, config = step_gradients(3, gradient_accumulation_fusion=False)
    assert not config.gradient_accumulation_fusion and not calls
    fused, config = step_gradients(3, count_calls, gradient_accumulation_fusion=True)
    assert config.gradient_accumulation_fusion
    # 3 micro-batches x (the output layer + 4 linears in each of the 2 layers).
    assert len(calls) == 3 * (1 + 4 * 2), len(calls)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-7)

    # Compiled layers: without the fusion by default; with it when asked, the linears run
    # outside the compiled graphs, which break there and nowhere else.
    from torch._dynamo.utils import counters

    calls.clear()
    _, config = step_gradients(3, compile=True)
    assert not config.gradient_accumulation_fusion and not calls
    assert mcore_layers.linear_with_grad_accumulation_and_async_allreduce is megatron_compat._TRACED_LINEAR
    counters.clear()
    compiled, config = step_gradients(3, count_calls, compile=True, gradient_accumulation_fusion=True)
    assert config.gradient_accumulation_fusion and len(calls) == 3 * (1 + 4 * 2), len(calls)
    assert counters["stats"]["unique_graphs"] > 0
    breaks = list(counters["graph_break"])
    assert breaks and all("linear_with_grad_accumulation_and_async_allreduce" in b for b in breaks), breaks
    torch.testing.assert_close(compiled, plain, rtol=1e-5, atol=1e-7)
    print("OK")
    """
)


def test_weight_gradients_accumulate_into_main_grad_without_apex():
    """``model.gradient_accumulation_fusion`` through megatron's own path with the torch stand-in
    for apex's kernel: every linear's weight gradient (the tied output layer's too) goes through
    it on each micro-batch, and the step's gradients equal those of the unfused path, compiled
    layers' too (``true`` under model.compile)."""
    from megatron.core.tensor_parallel.layers import LinearWithGradAccumulationAndAsyncCommunication

    backward = inspect.getsource(LinearWithGradAccumulationAndAsyncCommunication.backward)
    assert "fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(" in backward
    assert "zero_out_wgrad" in backward, "megatron changed how shared weights' fused gradients add up"
    # The start-up check a GPU runs on its out_dtype form, here on the CPU's bf16 fallback.
    assert megatron_compat._accumulates_correctly("cpu")
    result = run_tool("-c", FUSED_WGRAD_SCRIPT, check=False)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


COMPILED_ROPE_SCRIPT = STEP_GRADIENTS + textwrap.dedent(
    """
    from megatron.core.models.common.embeddings import rope_utils
    from torch._dynamo.utils import counters

    plain, _ = step_gradients(2, rope_fusion=False)
    assert rope_utils._apply_rotary_pos_emb_bshd is megatron_compat._UNFUSED_ROPE
    assert not counters["stats"]["unique_graphs"], "something compiled without model.rope_fusion"
    fused, _ = step_gradients(2, rope_fusion=True)
    # Queries and keys (4 heads, 2 groups) are two shapes: two graphs, no break in either.
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-7)
    print("OK")
    """
)


def test_rotary_embedding_compiles_into_the_same_gradients():
    """``model.rope_fusion`` on the local spec: megatron still applies RoPE through the module
    global the entry replaces (its fused path is Transformer Engine's), the step compiles it once
    for queries and once for keys, and the step's gradients equal the uncompiled path's."""
    from megatron.core.models.common.embeddings import rope_utils

    dispatch = inspect.getsource(rope_utils.apply_rotary_pos_emb)
    assert "return _apply_rotary_pos_emb_bshd(" in dispatch
    assert "fused_apply_rotary_pos_emb(t, freqs" in dispatch
    assert "transformer_engine" in inspect.getsource(rope_utils).split("fused_apply_rotary_pos_emb")[0]
    result = run_tool("-c", COMPILED_ROPE_SCRIPT, check=False)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


WANDB_SKIPPED_SCRIPT = textwrap.dedent(
    """
    import sys

    import megatron_train.model
    import megatron_train.train
    from megatron.core import timers
    from megatron.core.inference.contexts import dynamic_context
    from megatron.core.inference.engines import dynamic_engine

    assert "wandb" not in sys.modules, "a training process imported wandb"
    assert timers.wandb is dynamic_context.wandb is dynamic_engine.wandb is None
    import wandb

    assert callable(wandb.init)
    print("OK")
    """
)


def test_megatron_cores_optional_wandb_imports_are_skipped_and_wandb_still_imports():
    """megatron-core's modules that try ``import wandb`` as they load are the ones
    optional_imports names; a training process loads them without wandb, which our metrics can
    still import (logging.wandb)."""
    import megatron.core

    from megatron_train import optional_imports

    core = Path(megatron.core.__file__).parent
    trying = {
        "megatron.core." + ".".join(path.relative_to(core).with_suffix("").parts)
        for path in core.rglob("*.py")
        if re.search(r"^try:\n\s+import wandb\b", path.read_text(errors="replace"), re.M)
    }
    assert trying == optional_imports._WANDB_OPTIONAL_IN
    result = run_tool("-c", WANDB_SKIPPED_SCRIPT, check=False)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]


TOKENIZERS_SCRIPT = textwrap.dedent(
    """
    import sys

    from megatron_train.tokenizer import load_tokenizer

    spm = load_tokenizer("sentencepiece", sys.argv[1])
    assert "transformers" not in sys.modules, "a SentencePiece tokenizer imported transformers"
    # The same process then loads a Hugging Face tokenizer, and applies a chat template.
    hf = load_tokenizer("huggingface", sys.argv[2])
    assert hf.tokenize("t1 t2") == [1, 2], hf.tokenize("t1 t2")
    template = "{{ messages[0].content }}"
    chat = hf.apply_chat_template([{"role": "user", "content": "t3"}], chat_template=template)
    assert chat["input_ids"] == [3], chat
    assert spm.detokenize(spm.tokenize("def f(): pass")) == "def f(): pass"
    print("OK")
    """
)


def test_a_sentencepiece_tokenizer_loads_without_transformers_and_a_hugging_face_one_after_it(
    tmp_path, corpus
):
    """megatron-core's tokenizer libraries import transformers for their Hugging Face wrapper (a
    second of each rank's start-up): a SentencePiece tokenizer loads without it, and a Hugging
    Face tokenizer in the same process still works, chat templates included."""
    tokenizers = pytest.importorskip("tokenizers")
    import transformers

    vocab = {f"t{i}": i for i in range(8)}
    word_level = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0"))
    word_level.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=word_level).save_pretrained(tmp_path / "hf")
    result = run_tool("-c", TOKENIZERS_SCRIPT, str(corpus["tokenizer"]), str(tmp_path / "hf"), check=False)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]
