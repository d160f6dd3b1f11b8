"""Run under torchrun: per-token losses of one packed sample through the training model's batch
path (``data.document_mask``, ``data.reset_position_ids``, the context-parallel split) at CP =
the launched ranks, and, on one rank, of each of its documents alone and of the sample without
the mask. Saved on rank 0.

torchrun --nproc-per-node N tests/helpers/documents_worker.py --config C --out o.pt OVERRIDE...
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from megatron.core import parallel_state

from megatron_train import runtime
from megatron_train.batch import BatchPreparer
from megatron_train.init import initialize_weights
from megatron_train.model import build_chunks, use_transformer_engine
from megatron_train.models.registry import family_of
from megatron_train.resolve import resolve
from megatron_train.tokenizer import load_tokenizer

DOCUMENT_LENGTHS = (21, 6, 25, 12)  # each ends with EOD; 64 tokens in all


def per_token_losses(model, prepare: BatchPreparer, tokens: torch.Tensor) -> torch.Tensor:
    """``[seq - 1]`` losses of predicting each next token, over the whole sequence on every rank."""
    sample = {
        "tokens": tokens[:-1].unsqueeze(0),
        "labels": tokens[1:].unsqueeze(0),
        "loss_mask": torch.ones(1, tokens.numel() - 1),
        "position_ids": torch.arange(tokens.numel() - 1).unsqueeze(0),
    }
    batch = prepare(sample)
    losses = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    context = parallel_state.get_context_parallel_world_size()
    if context == 1:
        return losses[0]
    # Each rank holds chunks i and 2CP-1-i of 2CP; put them back in sequence order.
    parts = [torch.empty_like(losses) for _ in range(context)]
    torch.distributed.all_gather(parts, losses, group=parallel_state.get_context_parallel_group())
    chunks = [None] * (2 * context)
    for rank, part in enumerate(parts):
        first, second = part[0].chunk(2)
        chunks[rank], chunks[2 * context - 1 - rank] = first, second
    return torch.cat(chunks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    env = runtime.launch_env()
    cfg = resolve(args.config, [*args.overrides, f"parallel.context={env.world_size}"], env.world_size)
    rt = runtime.initialize(cfg, env)
    [model] = build_chunks(cfg, rt)
    initialize_weights([model], family_of(cfg.model), cfg.model, cfg.train.seed)
    model.eval()
    eod = load_tokenizer(cfg.data.tokenizer.type, cfg.data.tokenizer.path).eod
    generator = torch.Generator().manual_seed(0)
    documents = []
    for length in DOCUMENT_LENGTHS:
        text = torch.randint(0, cfg.model.vocab_size - 1, (length - 1,), generator=generator)
        text += (text >= eod).long()  # raw text never holds EOD
        documents.append(torch.cat([text, torch.tensor([eod])]))
    packed = torch.cat(documents + [torch.tensor([eod])])  # + the label of the last EOD
    prepare = BatchPreparer.for_config(cfg, rt.device, use_transformer_engine(cfg))
    with torch.no_grad():
        results = {"packed": per_token_losses(model, prepare, packed.to(rt.device))}
        if env.world_size == 1:
            plain = BatchPreparer(rt.device)
            results["alone"] = [per_token_losses(model, plain, doc.to(rt.device)) for doc in documents]
            results["unmasked"] = per_token_losses(model, plain, packed.to(rt.device))
    if rt.is_main:
        results["lengths"] = [doc.numel() for doc in documents]
        torch.save(results, args.out)
    runtime.shutdown()


if __name__ == "__main__":
    main()
