"""The CPU-compatibility layer, checked in a fresh interpreter (it patches torch globally)."""

from __future__ import annotations

import textwrap

from tests.conftest import run_tool

SCRIPT = textwrap.dedent(
    """
    import torch
    from megatron_train import cpu_compat
    cpu_compat.enable(); cpu_compat.enable()  # idempotent
    assert cpu_compat.is_enabled()

    # Device redirection: "cuda", torch.device("cuda") and ordinals all land on the CPU.
    assert torch.empty(3, device="cuda").device.type == "cpu"
    assert torch.zeros(2, device=torch.device("cuda", 0)).device.type == "cpu"
    assert torch.ones(2, device=torch.cuda.current_device()).device.type == "cpu"
    assert torch.ones(2).to("cuda").device.type == "cpu"
    t = torch.ones(2)
    assert t.cuda() is t

    # The distributed optimizer's dtype check; explicit conversions still work.
    assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    assert torch.ones(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(1).type(torch.float64).dtype == torch.float64

    # Streams and events are no-ops that megatron can call.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        pass
    e = torch.cuda.Event(); e.record(); e.wait(); torch.cuda.synchronize()

    # "CUDA" RNG state is the CPU generator's, so megatron's RNG tracker forks real randomness.
    state = torch.cuda.get_rng_state()
    a = torch.rand(4)
    torch.cuda.set_rng_state(state)
    assert torch.equal(a, torch.rand(4))

    from megatron.core import tensor_parallel
    tensor_parallel.model_parallel_cuda_manual_seed(123, tp_rank=0, ep_rank=0, etp_rank=0)
    before = torch.get_rng_state()
    with tensor_parallel.get_cuda_rng_tracker().fork():
        inside = torch.rand(4)
    assert torch.equal(before, torch.get_rng_state()), "fork restores the default stream"
    with tensor_parallel.get_cuda_rng_tracker().fork():
        again = torch.rand(4)
    assert not torch.equal(inside, again), "the tracked stream advances"

    # Recompute runs torch.autograd.backward inside the backward pass (megatron's
    # CheckpointFunction); the redirect must hold there too, where collectives allocate on "cuda".
    class AllocatesInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2 + torch.zeros(grad.shape, device=torch.cuda.current_device())

    x = torch.ones(3, requires_grad=True)
    y = tensor_parallel.checkpoint(AllocatesInBackward.apply, False, x)
    from megatron.core.pipeline_parallel.schedules import custom_backward
    custom_backward(y.sum(), None)
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    print("OK")
    """
)


def test_cpu_compat_adaptations():
    result = run_tool("-c", SCRIPT, check=False)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]
    # The forks above draw from the CPU generator, the one redirected: megatron's warning that
    # it moved is a false alarm here (once a layer and micro-batch with attention dropout).
    assert "RNG state changed" not in result.stderr, result.stderr[-3000:]


EAGER_FUSIONS = textwrap.dedent(
    """
    import sys
    import megatron_train.train
    import torch
    from megatron.core import jit
    from megatron.core.fusions.fused_bias_swiglu import swiglu

    # megatron's fusions stay plain functions, Inductor is never loaded, torch.compile is torch's.
    assert jit.jit_fuser is not torch.compile and jit.jit_fuser(swiglu) is swiglu
    assert not hasattr(swiglu, "_torchdynamo_orig_callable"), swiglu
    assert "torch._inductor.compile_fx" not in sys.modules
    assert torch.compile.__module__ == "torch"
    x = torch.randn(4, 6)
    a, b = x.chunk(2, -1)
    assert torch.equal(swiglu(x), torch.nn.functional.silu(a) * b)
    print("OK")
    """
)


def test_without_a_gpu_megatron_fusions_run_eagerly_and_inductor_is_not_loaded():
    result = run_tool("-c", EAGER_FUSIONS, check=False)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]
