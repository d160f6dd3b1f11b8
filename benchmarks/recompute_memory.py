"""Activation memory per recompute mode: what autograd keeps for backward after one forward pass.

    python benchmarks/recompute_memory.py [--preset small] [--seq 2048] [--mbs 1] [k=v ...]

One rank (CPU fp32, or the GPU in bf16), the real model from the config. For each mode it runs one
micro-batch forward with the loss and sums the storage of every tensor autograd saved for
backward, weights excluded, measured once the forward has finished (so outputs that recompute
discards count as zero). On a GPU it also prints the peak memory the forward added.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_train import cli  # noqa: E402

MODES = {
    "none": [],
    "selective core_attn": ["model.recompute=selective", "model.recompute_modules=[core_attn]"],
    "selective core_attn,mlp,layernorm": [
        "model.recompute=selective",
        "model.recompute_modules=[core_attn,mlp,layernorm]",
    ],
    "full block, half the layers": ["model.recompute=full", "model.recompute_method=block"],
    "full uniform, 1 layer": ["model.recompute=full", "model.recompute_method=uniform"],
}


def saved_activation_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the tensors autograd holds for backward after a forward of ``tokens``."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    positions = torch.arange(tokens.size(1), device=tokens.device).unsqueeze(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(tokens, positions, attention_mask=None, labels=tokens).float().sum()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    del loss
    return sum(size for ptr, size in storages.items() if ptr and ptr not in weights)


def main() -> int:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq", type=cli.positive_int, default=2048)
    parser.add_argument("--mbs", type=cli.positive_int, default=1)
    parser.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    args = parser.parse_args()
    return cli.run(lambda: measure(args))


def measure(args) -> None:
    from megatron_train import runtime
    from megatron_train.model import build_model
    from megatron_train.resolve import build_config

    base = {"model": {"preset": args.preset, "vocab_size": 32000, "max_position_embeddings": args.seq},
            "data": {"seq_length": args.seq}, "train": {"micro_batch_size": args.mbs}}  # fmt: skip
    cfg = build_config(base, args.overrides)
    rt = runtime.initialize(cfg, runtime.LaunchEnv(rank=0, world_size=1, local_rank=0))
    layers = cfg.model.num_layers
    print(f"{args.preset}: {layers} layers, hidden {cfg.model.hidden_size}, seq {args.seq}, micro batch "
          f"{args.mbs}, {rt.device.type} {str(rt.dtype).removeprefix('torch.')}")  # fmt: skip
    tokens = torch.randint(0, 32000, (args.mbs, args.seq), device=rt.device)
    reference = None
    for name, overrides in MODES.items():
        extra = [f"model.recompute_num_layers={layers // 2}"] if "block" in name else []
        mode_cfg = build_config(base, [*args.overrides, *overrides, *extra])
        model = build_model(mode_cfg, rt)[0]
        model.train()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        kept = saved_activation_bytes(model, tokens)
        peak = ""
        if torch.cuda.is_available():
            peak = f" | forward peak +{(torch.cuda.max_memory_allocated() - before) / 2**20:,.0f} MiB"
        reference = reference or kept
        share = f"{100 * kept / reference:5.1f}% of none"
        print(f"{name:36s} saved for backward {kept / 2**20:9,.1f} MiB ({share}){peak}", flush=True)
        del model
    runtime.shutdown()


if __name__ == "__main__":
    sys.exit(main())
