"""Forward passes outside training: a checkpoint's model at any TP / PP / EP, logits on every rank.

The model is the training model (same specs, same megatron pipeline schedule in forward-only
mode), built without DDP or optimizer and loaded from any complete checkpoint, imported ones
included.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_train.checkpoint import files
from megatron_train.checkpoint.state import load_weights, read_common
from megatron_train.config import ExperimentConfig
from megatron_train.model import build_chunks
from megatron_train.resolve import at_layout
from megatron_train.runtime import Runtime


def checkpoint_config(
    path: Path, tensor: int, pipeline: int, expert: int = 1, being_saved: Callable[[str], None] | None = None
) -> tuple[Path, ExperimentConfig]:
    """The complete checkpoint ``path`` names (a save dir's newest; see ``resolve_explicit`` for
    ``being_saved``), and the config it was written with moved to a TP x PP x EP layout (no VPP)."""
    path = files.resolve_explicit(Path(path), being_saved=being_saved)
    return path, at_layout(read_common(path)["config"], tensor, pipeline, expert)


def load_for_inference(path: Path, cfg: ExperimentConfig, rt: Runtime) -> list[torch.nn.Module]:
    """This rank's model chunk with the weights of checkpoint ``path`` (from
    :func:`checkpoint_config`), in eval mode."""
    chunks = build_chunks(cfg, rt)
    # The config is the checkpoint's own: no setting of it differs.
    load_weights(path, chunks, [])
    for chunk in chunks:
        chunk.eval()
    return chunks


def _forward_step(tokens: torch.Tensor, data_iterator, model):
    positions = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0).expand_as(tokens)
    output = model(tokens, positions, attention_mask=None)
    return output, _gather_vocab


def _gather_vocab(output: torch.Tensor, non_loss_data: bool = True) -> torch.Tensor:
    return tensor_parallel.gather_from_tensor_model_parallel_region(output)


@torch.no_grad()
def logits(model: list[torch.nn.Module], tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[batch, seq, vocab_size]`` float32 logits for ``tokens`` (the same on every rank)."""
    batch, seq = tokens.shape
    out = get_forward_backward_func()(
        forward_step_func=partial(_forward_step, tokens),
        data_iterator=iter([None]),
        model=model[0],
        num_microbatches=1,
        seq_length=seq,
        micro_batch_size=batch,
        forward_only=True,
        collect_non_loss_data=True,
    )
    padded_vocab = model[0].vocab_size
    result = torch.empty(batch, seq, padded_vocab, dtype=torch.float32, device=tokens.device)
    if parallel_state.is_pipeline_last_stage():
        result.copy_(out[0].float())
    torch.distributed.broadcast(
        result,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return result[..., :vocab_size]
