"""The local spec's own layers (megatron_train.models.layers) under torch.compile."""

from __future__ import annotations

import textwrap

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
