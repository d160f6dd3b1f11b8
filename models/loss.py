"""Cross-entropy over a vocabulary split across tensor-parallel ranks, in passes that read the
logits as they are (bf16 in mixed precision) and never write an fp32 copy of them.

megatron-core 0.16.1's vocab-parallel loss (``tensor_parallel.cross_entropy``) converts a
micro-batch's logits to fp32 and keeps that copy, as the softmax, for the backward; its fused variant
(``fusions/fused_cross_entropy.py``) compiles the same steps one by one, each writing a new fp32
buffer. For a 128k vocabulary and 8k tokens a copy is 4 GiB, and on one H200 that loss took 17.5 ms
a micro-batch (12.8 ms fused and compiled), about a tenth of the benchmark's step. Here the forward
reads the logits twice (the maximum, then the sum of exponentials with the target's logit) and the
backward once, each read a compiled reduction or elementwise kernel that upcasts as it goes; what
is kept for the backward is the logits themselves and two fp32 numbers a token. The arithmetic is
megatron's: the same maximum shift and the same ``log(sum exp) - target logit``, reduced over the
tensor-parallel group in the same two all-reduces.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.utils import VocabUtility


def _logits_max(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().amax(dim=-1)


def _hits(logits: torch.Tensor, target: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """Where each token's target sits in this rank's slice of the vocabulary (nowhere when another
    rank holds it): a comparison Inductor fuses, where gathering the target logit would not be."""
    ids = torch.arange(logits.size(-1), device=logits.device) + vocab_start
    return ids == target.unsqueeze(-1)


def _sum_exp_and_target(
    logits: torch.Tensor, target: torch.Tensor, logits_max: torch.Tensor, vocab_start: int
) -> torch.Tensor:
    shifted = logits.float() - logits_max.unsqueeze(-1)
    sum_exp = shifted.exp().sum(dim=-1)
    target_logit = torch.where(_hits(logits, target, vocab_start), shifted, 0.0).sum(dim=-1)
    return torch.stack((sum_exp, target_logit))


def _logits_grad(
    logits: torch.Tensor,
    target: torch.Tensor,
    logits_max: torch.Tensor,
    sum_exp: torch.Tensor,
    grad_loss: torch.Tensor,
    vocab_start: int,
) -> torch.Tensor:
    softmax = (logits.float() - logits_max.unsqueeze(-1)).exp() / sum_exp.unsqueeze(-1)
    grad = (softmax - _hits(logits, target, vocab_start).float()) * grad_loss.unsqueeze(-1)
    return grad.to(logits.dtype)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    # One graph per function and shape: a rank's vocabulary start is a constant of its graphs.
    return torch.compile(fn, dynamic=False, fullgraph=True)


class _OnePassCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        split = group.size() > 1
        vocab_start, _ = VocabUtility.vocab_range_from_per_partition_vocab_size(
            logits.size(-1), group.rank(), group.size()
        )
        logits_max = _compiled(_logits_max)(logits)
        if split:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        sums = _compiled(_sum_exp_and_target)(logits, target, logits_max, vocab_start)
        if split:
            dist.all_reduce(sums, group=group)
        sum_exp, target_logit = sums
        ctx.save_for_backward(logits, target, logits_max, sum_exp)
        ctx.vocab_start = vocab_start
        return sum_exp.log() - target_logit

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, target, logits_max, sum_exp = ctx.saved_tensors
        grad = _compiled(_logits_grad)(
            logits, target, logits_max, sum_exp, grad_loss.contiguous(), ctx.vocab_start
        )
        return grad, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """Each token's cross-entropy (fp32, ``[s, b]``) from this rank's vocabulary slice of the
    logits (``[s, b, vocab / TP]``) and the target ids (``[s, b]``); ``group`` is the
    tensor-parallel group, whose ranks hold the slices in rank order."""
    return _OnePassCrossEntropy.apply(logits, target, group)
