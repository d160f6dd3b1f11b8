"""Sample text from a megatron-train checkpoint, as a sanity check (no KV cache: short outputs only).

    python tools/generate.py --ckpt runs/demo/checkpoints --prompt "def main(" --max-new-tokens 40
    torchrun --nproc-per-node 4 tools/generate.py --ckpt ckpt/llama --tp 2 --pp 2 --top-p 0.9 --prompt "Hi"

Greedy by default; ``--top-p`` samples from the smallest set of tokens whose probability reaches p
(at ``--temperature``, seeded by ``--seed``). Runs at any TP x PP that fills the launched ranks.
Exit codes: 0 done, 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from megatron_train import cli
from megatron_train.config import ConfigError


def next_token(logits: torch.Tensor, top_p: float | None, temperature: float, gen: torch.Generator) -> int:
    """Greedy (``top_p`` None) or nucleus sampling from one position's logits."""
    if top_p is None:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    # Keep each token whose preceding mass is below p: the smallest set reaching p.
    keep = sorted_probs.cumsum(0) - sorted_probs < top_p
    sorted_probs = sorted_probs * keep
    choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=gen)
    return int(order[choice])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ckpt", type=Path, required=True, help="checkpoint (iter_* dir or save dir)")
    parser.add_argument("--prompt", default="", help="text to continue")
    parser.add_argument("--prompt-ids", help="comma-separated token ids instead of --prompt")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--top-p", type=float, help="nucleus sampling threshold (default: greedy)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    parser.add_argument("--tokenizer", help="tokenizer path (default: the checkpoint config's)")
    args = parser.parse_args(argv)

    return cli.run(lambda: generate(args))


def generate(args: argparse.Namespace) -> None:
    from megatron_train import inference, runtime
    from megatron_train.tokenizer import load_tokenizer

    path, cfg = inference.checkpoint_config(args.ckpt, args.tp, args.pp)
    tokenizer = None
    if not args.prompt_ids:
        tok_path = args.tokenizer or cfg.data.tokenizer.path
        if not tok_path or not Path(tok_path).exists():
            raise ConfigError("--tokenizer", f"{tok_path!r} does not exist", "pass the tokenizer's path")
        tokenizer = load_tokenizer(cfg.data.tokenizer.type, tok_path)
    rt = runtime.initialize(cfg, runtime.launch_env())
    model = inference.load_for_inference(path, cfg, rt)
    if args.prompt_ids:
        ids = [int(i) for i in args.prompt_ids.split(",")]
    else:
        ids = list(tokenizer.tokenize(args.prompt)) or [tokenizer.bos if tokenizer.bos is not None else 0]
    gen = torch.Generator().manual_seed(args.seed)
    prompt_len = len(ids)
    for _ in range(args.max_new_tokens):
        tokens = torch.tensor([ids], device=rt.device)
        last = inference.logits(model, tokens, cfg.model.vocab_size)[0, -1].cpu()
        choice = torch.tensor([next_token(last, args.top_p, args.temperature, gen)], device=rt.device)
        torch.distributed.broadcast(choice, src=0)  # every rank continues with rank 0's token
        ids.append(int(choice))
    if rt.is_main:
        print("ids:", ",".join(str(i) for i in ids[prompt_len:]))
        if tokenizer is not None:
            print(tokenizer.detokenize(ids))


if __name__ == "__main__":
    sys.exit(main())
