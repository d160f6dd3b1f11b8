"""Whether the local spec's attention with a document mask gives finite gradients where
pytorch#196678 makes cuDNN's give NaN (torch 2.11+ on H100/H200): a mask tensor, a key length
of 128k + 64, and rows whose logsumexp is below ln(FLT_MAX), built as that issue's reproducer
builds them, through ``SDPAttention`` (megatron_train.models.layers) in bf16, with two query
heads sharing one key and value head (grouped-query attention, as Llama's).

    python benchmarks/masked_attention_grad.py [--device cpu]

A row per key length and kernel choice: ``auto`` is what training runs (which avoids cuDNN at
the affected lengths), ``cudnn`` forces cuDNN beside it, on CUDA only, to show whether this
torch has the bug. Exit code 1 when ``auto`` gives a non-finite query gradient."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_train import cli  # noqa: E402  (and the CPU redirect megatron's layers need without CUDA)
from megatron_train.errors import ConfigError, Failure  # noqa: E402

HEAD_DIM = 64
HEADS, GROUPS = 2, 1
LENGTHS = (704, 768)
"""One length the bug needs (704 = 5 x 128 + 64) and one it spares."""


def non_finite_query_grads(length: int, backend: str, device: str) -> tuple[int, int]:
    """Non-finite elements of the query gradient, and all of them, for one forward + backward."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_train.models.layers import SDPAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_query_groups=GROUPS,
        attention_dropout=0.0, use_cpu_initialization=True, bf16=True, params_dtype=torch.bfloat16,
        cuda_graph_scope=[],
    )  # fmt: skip
    attention = SDPAttention(config, 1, AttnMaskType.causal, "self", backend=backend)
    torch.manual_seed(0)
    on = dict(device=device, dtype=torch.bfloat16)
    # megatron's layout, [seq, batch, heads, dim]; every logit about -120, as in the issue.
    q, k = (torch.randn(length, 1, heads, HEAD_DIM, **on) * 0.1 for heads in (HEADS, GROUPS))
    v = torch.randn(length, 1, GROUPS, HEAD_DIM, **on)
    q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(HEAD_DIM)
    for t in (q, k, v):
        t.requires_grad_()
    # megatron's convention: True may not attend (a causal document mask of one document).
    mask = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)[None, None]
    out = attention(q, k, v, mask)
    out.backward(torch.randn_like(out))
    return int((~torch.isfinite(q.grad)).sum()), q.grad.numel()


def main() -> None:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", "cuda, and torch sees no GPU here", "pass --device cpu")
    backends = ("auto", "cudnn") if args.device == "cuda" else ("auto",)
    print(f"{'key length':>10} {'kernel':<8} {'non-finite query grads':>24}")
    broken = False
    for length in LENGTHS:
        for backend in backends:
            bad, total = non_finite_query_grads(length, backend, args.device)
            broken |= backend == "auto" and bad > 0
            print(f"{length:>10} {backend:<8} {bad:>12,} of {total:,}")
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}")
    if broken:
        raise Failure("the document-mask path gave a non-finite query gradient (see the auto rows)")


if __name__ == "__main__":
    sys.exit(cli.run(main))
