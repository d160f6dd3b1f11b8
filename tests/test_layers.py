"""The local spec's own layers (megatron_train.models.layers): under torch.compile, and the SDPA
kernels they may ask for."""

from __future__ import annotations

import textwrap

import pytest

from tests.conftest import run_tool

DYNAMIC_ATTENTION = textwrap.dedent(
    """
    import torch
    import megatron_train  # the CPU redirect
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_train.models.layers import SDPAttention

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               attention_dropout=0.0, use_cpu_initialization=True)
    attention = SDPAttention(config, 1, AttnMaskType.causal, "self")
    # [seq, batch, heads, dim]: four query heads in two groups.
    q, k, v = torch.randn(8, 2, 4, 8), torch.randn(8, 2, 2, 8), torch.randn(8, 2, 2, 8)
    compiled = torch.compile(attention, dynamic=True, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, None), attention(q, k, v, None))
    print("OK")
    """
)


def test_grouped_query_attention_compiles_whole_with_dynamic_shapes():
    """With every size symbolic, the grouped-query flag is still a plain bool (from the config):
    one taken from the tensors' head counts is a symbolic bool, which SDPA refuses."""
    result = run_tool("-c", DYNAMIC_ATTENTION, check=False)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]


def _sdpa_runs(backend: str, dropout: float) -> bool:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # The device and dtype the check decides for: a GPU's in bf16 (precision auto), else the CPU's.
    on = dict(device="cuda", dtype=torch.bfloat16) if torch.cuda.is_available() else {}
    q, k, v = (torch.randn(1, heads, 8, 16, **on) for heads in (4, 2, 2))
    try:
        with sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}[backend]):
            F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, enable_gqa=True)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("backend", ["flash", "math"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_an_attention_kernel_is_refused_on_this_machine_exactly_where_pytorch_has_none(backend, dropout):
    """The config check speaks for SDPA's kernel selection, which would fail only in the first
    forward step: it must refuse what PyTorch cannot run here, and nothing it can."""
    from megatron_train.config import ExperimentConfig
    from megatron_train.errors import ConfigError
    from megatron_train.model import check_attention_backend

    cfg = ExperimentConfig()
    cfg.model.attention_backend, cfg.model.attention_dropout = backend, dropout
    try:
        check_attention_backend(cfg)
        refused = False
    except ConfigError:
        refused = True
    assert refused == (not _sdpa_runs(backend, dropout))


@pytest.mark.parametrize(
    ("key_length", "on_cuda", "avoids_cudnn"),
    [(704, True, True), (64, True, True), (4160, True, True), (768, True, False), (4096, True, False),
     (700, True, False), (704, False, False)],
)  # fmt: skip
def test_a_mask_at_the_key_lengths_of_pytorch_196678_keeps_cudnn_out(key_length, on_cuda, avoids_cudnn):
    """cuDNN's backward with a mask tensor returns NaN query gradients at key lengths of 128k + 64
    (torch 2.11+); elsewhere, and on the CPU, which has no cuDNN kernel, PyTorch chooses."""
    from torch.nn.attention import SDPBackend

    from megatron_train.models.layers import masked_attention_backends

    backends = masked_attention_backends(key_length, on_cuda)
    if avoids_cudnn:
        assert backends == [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    else:
        assert backends is None


GROUPED_MASKED_ATTENTION = textwrap.dedent(
    """
    import torch
    from torch.nn.attention import SDPBackend
    import megatron_train  # the CPU redirect
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron_train.models import layers

    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               attention_dropout=0.0, use_cpu_initialization=True, cuda_graph_scope=[])
    attention = layers.SDPAttention(config, 1, AttnMaskType.causal, "self")
    torch.manual_seed(0)
    # [seq, batch, heads, dim], two documents of 3 and 5 tokens; True may not attend.
    inputs = [torch.randn(8, 2, heads, 8, requires_grad=True) for heads in (4, 2, 2)]
    mask = torch.ones(8, 8, dtype=torch.bool).triu(1)
    mask[3:, :3] = True
    mask = mask[None, None]

    def run():
        out = attention(*inputs, mask)
        grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
        return out, grads

    chosen, chosen_grads = run()
    # As on CUDA at a key length of 128k + 64 (this CPU has no memory-efficient kernel: math runs).
    layers.masked_attention_backends = lambda n, cuda: [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    kept_out, kept_grads = run()
    torch.testing.assert_close(kept_out, chosen)
    for a, b in zip(kept_grads, chosen_grads):
        torch.testing.assert_close(a, b)
    print("OK")
    """
)


def test_grouped_attention_kept_off_cudnn_repeats_its_key_heads_and_gives_the_same_result():
    """Where pytorch#196678 keeps cuDNN out, grouped-query attention repeats its key and value
    heads (the memory-efficient kernel takes no enable_gqa beside a mask): outputs and the
    gradients of queries, keys and values are those of the grouped call."""
    result = run_tool("-c", GROUPED_MASKED_ATTENTION, check=False)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-3000:]
