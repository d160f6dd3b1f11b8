"""Describe a megatron-train checkpoint: iteration, config, tensors, files, completeness.

    python tools/inspect_checkpoint.py runs/demo/checkpoints            # newest checkpoint
    python tools/inspect_checkpoint.py runs/demo/checkpoints/iter_0000200 --verify-checksums

Exit codes: 0 complete (and checksums match when verified), 1 torn or corrupted, 2 no checkpoint.
Nothing is unpickled beyond plain data and checkpoint metadata (see checkpoint/safe_load.py).
"""

from __future__ import annotations

import math
from pathlib import Path

# First: this checkout's package, which names a Python without the project's environment.
import use_checkout  # noqa: F401

# isort: split
from megatron_train import cli
from megatron_train.checkpoint import files
from megatron_train.checkpoint.files import CheckpointError


def _describe_common(path: Path) -> list[str]:
    from megatron_train.checkpoint.state import read_common

    common = read_common(path)
    try:
        return _common_lines(common)
    except (KeyError, TypeError) as err:
        raise CheckpointError(
            f"{path / 'common.pt'} lacks or mangles field {err}; the checkpoint is corrupt"
        ) from err


def _mlp(m: dict) -> str:
    """The MLP's widths: dense, or a mixture of experts (saved configs from before MoE have no
    expert keys)."""
    if not m.get("num_experts"):
        return f"ffn {m['ffn_hidden_size']}"
    shared = m.get("moe_shared_expert_ffn_hidden_size")
    return (
        f"{m['num_experts']} experts of ffn {m.get('moe_ffn_hidden_size') or m['ffn_hidden_size']} "
        f"(top {m['moe_router_topk']}{f', shared expert ffn {shared}' if shared else ''})"
    )


def _common_lines(common: dict) -> list[str]:
    from megatron_train.checkpoint.state import Layout, optimizer_format

    progress, layout, cfg = common["progress"], common["layout"], common["config"]
    m, t, o = cfg["model"], cfg["train"], cfg["optimizer"]
    tokens = f", {progress['consumed_tokens']:,} tokens" if "consumed_tokens" in progress else ""
    return [
        f"iteration:   {progress['iteration']} of {t['steps']} "
        f"({progress['consumed_samples']:,} samples{tokens} consumed, "
        f"{progress['skipped_steps']} skipped steps)",
        f"written by:  megatron-train {common.get('version', '?')} at {Layout(**layout).describe()} "
        f"({layout['world_size']} ranks); optimizer state {optimizer_format(common)}",
        f"model:       {m.get('preset') or 'custom'}: {m['num_layers']} layers, hidden {m['hidden_size']}, "
        f"{_mlp(m)}, {m['num_attention_heads']} heads / "
        f"{m['num_query_groups'] or m['num_attention_heads']} kv groups, vocab {m['vocab_size']}",
        f"training:    gbs {t['global_batch_size']} x seq {cfg['data']['seq_length']}, lr {o['lr']} "
        f"({o['decay_style']}), seed {t['seed']}",
    ]


def _describe_tensors(path: Path) -> list[str]:
    from megatron_train.checkpoint.state import read_tensor_metadata

    tensors = read_tensor_metadata(path)
    lines, total = [], 0
    for key in sorted(tensors):
        shard = tensors[key]
        total += math.prod(shard.global_shape)
        dtype = str(shard.dtype).removeprefix("torch.")
        lines.append(f"  {key:<72} {str(tuple(shard.global_shape)):<22} {dtype}")
    return [f"tensors ({len(tensors)}, {total:,} elements):", *lines]


@cli.entry_point
def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__)
    parser.add_argument(
        "path", type=cli.path, help="a checkpoint (iter_*), or a save dir or run dir (its newest is shown)"
    )
    parser.add_argument("--verify-checksums", action="store_true", help="recompute every file's SHA-256")
    parser.add_argument("--no-tensors", action="store_true", help="skip the tensor listing")
    args = parser.parse_args(argv)
    try:
        path = files.locate(args.path)
    except CheckpointError as err:
        cli.report(err)
        return cli.EXIT_BAD_INPUT
    try:
        files.verify(path)
        complete = True
    except CheckpointError:
        complete = False
        if older := files.complete_beside_a_save(path, args.path):
            print(f"note: {path.name} is being saved by a run still going; showing {older.name}")
            path, complete = older, True
    try:
        if complete:
            files.held_for_reading(path)  # kept from a running run's retention while it is read
    except CheckpointError as err:
        cli.report(err)
        return cli.EXIT_BAD_INPUT
    print(f"checkpoint:  {path.resolve()}")
    try:
        record = files.verify(path, checksums=args.verify_checksums)
        description = _describe_common(path) + ([] if args.no_tensors else _describe_tensors(path))
    except files.ChecksumsAbsent as err:
        cli.report(
            f"{err.problem}. Fix: inspect it without --verify-checksums (the sizes of its files are checked)"
        )
        return cli.EXIT_BAD_INPUT
    except CheckpointError as err:
        print(f"status:      INCOMPLETE OR CORRUPTED: {err}")
        return 1
    size = files.total_size(record)
    checked = "sizes and SHA-256 verified" if args.verify_checksums else "sizes verified"
    print(f"status:      complete ({len(record['files'])} files, {size / 2**20:.1f} MiB; {checked})")
    for line in description:
        print(line)
    return 0


if __name__ == "__main__":
    cli.exit_process(main())
