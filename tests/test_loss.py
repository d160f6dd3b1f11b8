"""The local spec's fused cross-entropy (megatron_train.models.loss): the loss and logits gradient
of torch's own cross-entropy over the whole vocabulary, whether one rank holds it or tensor-parallel
ranks hold slices; and runs with it train as runs with megatron-core's loss do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import records, torchrun, write_config

VOCAB, TOKENS, BATCH = 1000, 48, 2


def _reference(logits: torch.Tensor, target: torch.Tensor, weights: torch.Tensor):
    """torch's cross-entropy in fp32 over the whole vocabulary, and its logits gradient."""
    full = logits.detach().float().requires_grad_()
    loss = F.cross_entropy(full.view(-1, VOCAB), target.view(-1), reduction="none").view(TOKENS, BATCH)
    (loss * weights).sum().backward()
    return loss.detach(), full.grad


def _check_on_rank(rank: int, store: str) -> None:
    import torch.distributed as dist

    from megatron_train.models.loss import vocab_parallel_cross_entropy

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    alone = [dist.new_group([r]) for r in range(2)][rank]
    gen = torch.Generator().manual_seed(0)
    # Spread wide enough that the maximum shift matters; a weight of zero is a masked token.
    logits = torch.randn(TOKENS, BATCH, VOCAB, generator=gen) * 8
    target = torch.randint(0, VOCAB, (TOKENS, BATCH), generator=gen)
    weights = torch.rand(TOKENS, BATCH, generator=gen) * (torch.arange(TOKENS) % 5 != 0).unsqueeze(-1)
    half = slice(rank * VOCAB // 2, (rank + 1) * VOCAB // 2)
    for dtype in (torch.float32, torch.bfloat16):
        inputs = logits.to(dtype)
        want_loss, want_grad = _reference(inputs, target, weights)
        for group, held in ((alone, slice(None)), (dist.group.WORLD, half)):
            mine = inputs[:, :, held].clone().requires_grad_()
            loss = vocab_parallel_cross_entropy(mine, target, group)
            (loss * weights).sum().backward()
            where = f"{dtype}, TP={group.size()}, rank {rank}"
            assert loss.dtype == torch.float32 and mine.grad.dtype == dtype, where
            torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-5, msg=where)
            # The gradient is computed in fp32 and rounded once to the logits' dtype.
            expected = want_grad[:, :, held].to(dtype).float()
            tolerance = (
                {"rtol": 1e-5, "atol": 1e-7} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 1e-6}
            )
            torch.testing.assert_close(mine.grad.float(), expected, **tolerance, msg=where)
            assert mine.grad[::5].abs().sum() == 0, where
    dist.destroy_process_group()


def test_loss_and_gradient_are_torchs_cross_entropy_at_tp1_and_tp2(tmp_path):
    torch.multiprocessing.spawn(_check_on_rank, args=(str(tmp_path / "store"),), nprocs=2)


@pytest.mark.slow
@pytest.mark.xdist_group("fused_loss")
def test_runs_with_the_fused_loss_train_as_with_megatrons(tmp_path, corpus):
    """Losses and gradient norms of every step within 1e-5 of megatron-core's loss (fp32 on the CPU),
    at one rank and with the vocabulary split over TP2 x PP2 with sequence parallelism."""
    config = write_config(tmp_path / "cfg.yaml", corpus, tmp_path / "plain", train={"eval_interval": 0})
    runs = {
        "plain": (1, []),
        "fused": (1, ["model.cross_entropy_fusion=true"]),
        "fused-tp2-pp2": (4, ["model.cross_entropy_fusion=true", "parallel.tensor=2", "parallel.pipeline=2",
                              "parallel.sequence_parallel=true"]),
    }  # fmt: skip
    for name, (nproc, overrides) in runs.items():
        result = torchrun(nproc, config, f"logging.run_dir={tmp_path / name}", *overrides)
        assert result.returncode == 0, result.stderr[-4000:]
        assert ("fused cross-entropy (compiled passes)" in result.stdout) == (name != "plain"), result.stdout
    by_run = {name: [r for r in records(tmp_path / name) if "loss" in r] for name in runs}
    assert len(by_run["plain"]) == 6
    for name in ("fused", "fused-tp2-pp2"):
        for want, got in zip(by_run["plain"], by_run[name], strict=True):
            for key in ("loss", "grad_norm"):
                assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key]), (name, want["step"], key)
