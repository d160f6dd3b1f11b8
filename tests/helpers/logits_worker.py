"""Run under torchrun: our logits for each checkpoint at the launched TP x PP x EP, saved on rank 0.

torchrun --nproc-per-node N tests/helpers/logits_worker.py --tp T --pp P [--ep E] \
    --tokens t.pt --out o.pt CKPT...
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from megatron_train import inference, runtime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, required=True)
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--tokens", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("checkpoints", nargs="+", type=Path)
    args = parser.parse_args()
    env = runtime.launch_env()
    _, first = inference.checkpoint_config(args.checkpoints[0], args.tp, args.pp, args.ep)
    rt = runtime.initialize(first, env)
    tokens = torch.load(args.tokens)
    results = {}
    for path in args.checkpoints:
        resolved, cfg = inference.checkpoint_config(path, args.tp, args.pp, args.ep)
        model = inference.load_for_inference(resolved, cfg, rt)
        results[str(path)] = inference.logits(model, tokens.to(rt.device), cfg.model.vocab_size)
    if rt.is_main:
        torch.save(results, args.out)
    runtime.shutdown()


if __name__ == "__main__":
    main()
