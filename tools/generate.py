"""Sample text from a megatron-train checkpoint, as a sanity check (no KV cache: short outputs only).

    python tools/generate.py --ckpt runs/demo/checkpoints --prompt "def main(" --max-new-tokens 40
    python -m megatron_train.torchrun --nproc-per-node 4 tools/generate.py --ckpt ckpt/llama \\
        --tp 2 --pp 2 --top-p 0.9 --prompt "Hi"

Greedy by default; ``--top-p`` samples from the smallest set of tokens whose probability reaches p
(at ``--temperature``, default 1, seeded by ``--seed``, default 0); either without ``--top-p`` is
refused, as greedy decoding would ignore it. Runs at any TP x PP that fills the launched ranks.
Exit codes: 0 done, 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Before torch: the package's import makes a Ctrl-C during torch's own import (seconds) one line,
# and a Python without the project's environment one line too (use_checkout.py).
import use_checkout  # noqa: F401

# isort: split
import torch

from megatron_train import cli
from megatron_train.config import ConfigError


def next_token(logits: torch.Tensor, top_p: float | None, temperature: float, gen: torch.Generator) -> int:
    """Greedy (``top_p`` None) or nucleus sampling from one position's logits."""
    if top_p is None:
        return int(logits.argmax())
    # Shifted so the largest is 0 before dividing: a tiny temperature then sends the others to
    # -inf (probability 0) rather than every logit to +-inf, whose softmax is nan.
    shifted = logits.double() - logits.max().double()
    probs = torch.softmax(shifted / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    # Keep each token whose preceding mass is below p: the smallest set reaching p.
    keep = sorted_probs.cumsum(0) - sorted_probs < top_p
    sorted_probs = sorted_probs * keep
    choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=gen)
    return int(order[choice])


def prompt_ids(text: str, vocab_size: int) -> list[int]:
    """``--prompt-ids``: comma-separated token ids, each inside the model's vocabulary."""
    try:
        ids = [int(i) for i in text.split(",")]
    except ValueError:
        raise ConfigError(
            "--prompt-ids", f"{text!r} is not a list of integers", "write ids like 1,42,7"
        ) from None
    if not all(0 <= i < vocab_size for i in ids):
        raise ConfigError(
            "--prompt-ids", f"{text!r} has ids outside the vocabulary", f"use ids from 0 to {vocab_size - 1}"
        )
    return ids


def check_length(prompt: int, new: int, positions: int, prompt_key: str) -> None:
    """The prompt and the new tokens fit the model's positions (as Megatron-LM's generation
    requires); the loop recomputes the whole sequence per token, so more would also take hours."""
    if prompt >= positions:
        raise ConfigError(
            prompt_key,
            f"the prompt is {prompt} tokens: the model's max_position_embeddings={positions} leaves no room "
            "for a new one",
            f"shorten it to at most {positions - 1} tokens",
        )
    if prompt + new > positions:
        raise ConfigError(
            "--max-new-tokens",
            f"{new} new tokens after the prompt's {prompt} exceed the model's "
            f"max_position_embeddings={positions}",
            f"ask for at most {positions - prompt}",
        )


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--ckpt", type=cli.path, required=True, help="checkpoint (iter_* dir, save dir or run dir)"
    )
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default="", help="text to continue (empty: from the BOS token)")
    prompt.add_argument("--prompt-ids", help="comma-separated token ids instead of --prompt")
    parser.add_argument("--max-new-tokens", type=cli.positive_int, default=32)
    parser.add_argument("--top-p", type=cli.probability, help="nucleus sampling threshold (default: greedy)")
    parser.add_argument("--temperature", type=cli.positive_float, help="with --top-p (default 1)")
    parser.add_argument("--seed", type=cli.seed, help="with --top-p (default 0)")
    parser.add_argument("--tp", type=cli.positive_int, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=cli.positive_int, default=1, help="pipeline-parallel size")
    parser.add_argument(
        "--tokenizer", type=cli.non_empty, help="tokenizer path (default: the checkpoint config's)"
    )
    parser.add_argument(
        "--tokenizer-type",
        choices=["sentencepiece", "huggingface"],
        help="what --tokenizer is (default: the checkpoint config's tokenizer type)",
    )
    args = parser.parse_args(argv)
    return cli.run(lambda: generate(args))


def _note(text: str) -> None:
    if cli.first_rank():
        print(f"note: {text}", file=sys.stderr)


def generate(args: argparse.Namespace) -> None:
    from megatron_train import inference, runtime
    from megatron_train.checkpoint import files
    from megatron_train.errors import missing
    from megatron_train.inputs import checked_tokenizer

    if args.top_p is None and (args.temperature is not None or args.seed is not None):
        flag = "--temperature" if args.temperature is not None else "--seed"
        raise ConfigError(
            flag,
            "applies only when sampling with --top-p; greedy decoding would ignore it",
            f"add --top-p (1 samples from the whole distribution) or drop {flag}",
        )
    path, cfg = inference.checkpoint_config(args.ckpt, args.tp, args.pp, being_saved=_note)
    tokenizer = None
    if args.prompt_ids is not None:
        ids = prompt_ids(args.prompt_ids, cfg.model.vocab_size)
    else:
        tok_path = args.tokenizer or cfg.data.tokenizer.path
        kind = args.tokenizer_type or cfg.data.tokenizer.type
        if args.tokenizer is None and tok_path is not None and not Path(tok_path).exists():
            # A relative path in the run's config is relative to where training ran.
            raise ConfigError(
                "--tokenizer",
                f"the run's tokenizer {tok_path!r} (data.tokenizer.path in the checkpoint's config) "
                f"{missing(tok_path)}",
                "pass --tokenizer with where it is now, or run from where training ran",
            )
        tokenizer = checked_tokenizer(kind, tok_path, key="--tokenizer", type_key="--tokenizer-type")
        if tokenizer.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                "--tokenizer",
                f"{tok_path} has {tokenizer.vocab_size} tokens, more than the model's "
                f"{cfg.model.vocab_size}: it is not the tokenizer the model was trained with",
                "pass the run's tokenizer",
            )
        ids = list(tokenizer.tokenize(args.prompt)) or [tokenizer.bos if tokenizer.bos is not None else 0]
    prompt_key = "--prompt" if args.prompt_ids is None else "--prompt-ids"
    check_length(len(ids), args.max_new_tokens, cfg.model.max_position_embeddings, prompt_key)
    env = runtime.launch_env()
    if args.tp * args.pp != env.world_size:
        raise ConfigError(
            "--tp",
            f"--tp x --pp = {args.tp} x {args.pp} does not fill the {env.world_size} launched rank(s)",
            "launch tp x pp ranks (torchrun --nproc-per-node) or change --tp / --pp",
        )
    rt = runtime.initialize(cfg, env)
    # Each rank found the newest checkpoint itself; a run that saved meanwhile may have given
    # the later ones a newer one than rank 0's, whose weights every rank loads.
    chosen = [str(path)]
    torch.distributed.broadcast_object_list(chosen, src=0)
    if chosen[0] != str(path):
        path = files.held_for_reading(Path(chosen[0]))
    model = inference.load_for_inference(path, cfg, rt)
    gen = torch.Generator().manual_seed(args.seed or 0)
    prompt_len = len(ids)
    for _ in range(args.max_new_tokens):
        tokens = torch.tensor([ids], device=rt.device)
        last = inference.logits(model, tokens, cfg.model.vocab_size)[0, -1].cpu()
        choice = torch.tensor([next_token(last, args.top_p, args.temperature or 1.0, gen)], device=rt.device)
        torch.distributed.broadcast(choice, src=0)  # every rank continues with rank 0's token
        ids.append(int(choice))
    if rt.is_main:
        print("ids:", ",".join(str(i) for i in ids[prompt_len:]))
        if tokenizer is not None:
            print(tokenizer.detokenize(ids))


if __name__ == "__main__":
    cli.exit_process(main())
