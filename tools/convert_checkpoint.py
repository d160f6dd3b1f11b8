"""Convert between Hugging Face model directories and megatron-train checkpoints.

    python tools/convert_checkpoint.py import-hf --hf /models/Llama-3.1-8B --out ckpt/llama31 --tp 2 --pp 2
    python tools/convert_checkpoint.py export-hf --ckpt runs/x/checkpoints --out hf/x [--dtype bfloat16]

Families: Llama 2 / 3 / 3.1, Mistral, Qwen2, Qwen3, Qwen3-MoE and Mixtral. Imported checkpoints
load at any TP / PP (``--tp`` / ``--pp`` are checked against the model and recorded as its
layout). Both directions stream one tensor at a time and write into a temporary directory renamed
into place at the end.
Exit codes: 0 done, 2 bad input (the message names it and the fix).
"""

from __future__ import annotations

import argparse
import sys

# Before torch: the package's import makes a Ctrl-C during torch's own import (seconds) one line,
# and a Python without the project's environment one line too (use_checkout.py).
import use_checkout  # noqa: F401

# isort: split
import torch

from megatron_train import cli
from megatron_train.config import ExperimentConfig


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import-hf", help="Hugging Face directory -> checkpoint")
    imp.add_argument("--hf", type=cli.path, required=True, help="Hugging Face model directory")
    imp.add_argument("--out", type=cli.path, required=True, help="new checkpoint save dir")
    imp.add_argument(
        "--tp", type=cli.positive_int, default=1, help="tensor-parallel size to check and record"
    )
    imp.add_argument(
        "--pp", type=cli.positive_int, default=1, help="pipeline-parallel size to check and record"
    )
    imp.add_argument(
        "--vocab-pad-multiple", type=cli.positive_int, default=128, help="pad the vocabulary to this"
    )
    exp = commands.add_parser("export-hf", help="checkpoint -> Hugging Face directory")
    exp.add_argument(
        "--ckpt", type=cli.path, required=True, help="checkpoint (iter_* dir, save dir or run dir)"
    )
    exp.add_argument("--out", type=cli.path, required=True, help="new Hugging Face model directory")
    exp.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="default: an imported model's own, bfloat16 for one trained here (the Hub's usual)",
    )
    exp.add_argument("--max-shard-gib", type=cli.positive_float, default=5.0, help="largest safetensors file")
    exp.add_argument("--tokenizer", type=cli.path, help="the run's tokenizer, if it moved since training")
    args = parser.parse_args(argv)
    return cli.run(lambda: convert(args))


def convert(args: argparse.Namespace) -> None:
    from megatron_train import runtime
    from megatron_train.hf.convert import export_hf, import_hf

    # megatron's checkpoint I/O runs in a process group; conversion needs only this process.
    runtime.initialize(ExperimentConfig(), runtime.LaunchEnv(rank=0, world_size=1, local_rank=0))
    if args.command == "import-hf":
        import_hf(args.hf, args.out, args.tp, args.pp, args.vocab_pad_multiple, log=cli.say)
    else:
        dtype = getattr(torch, args.dtype) if args.dtype else None
        # A size past any model's (1e300 GiB is past every float) is one file, as asked.
        max_shard_bytes = int(min(args.max_shard_gib * 2**30, sys.maxsize))
        export_hf(args.ckpt, args.out, dtype, max_shard_bytes, args.tokenizer, log=cli.say)


if __name__ == "__main__":
    cli.exit_process(main())
