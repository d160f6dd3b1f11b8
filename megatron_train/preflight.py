"""Check a job before it waits in the queue: config vs allocation, data, tokenizer, save dir,
resume checkpoint, and a per-GPU memory estimate. Runs on a login node (no GPU, no torch.distributed).

    python -m megatron_train.preflight --config X.yaml --nodes 4 --gpus-per-node 8 [key=value ...]

Exit codes: 0 ready, 2 a problem (one line naming it and the fix).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass

from megatron_train.config import ExperimentConfig, checkpoint_dir, data_parallel_size
from megatron_train.errors import BAD_INPUT, ConfigError
from megatron_train.models.registry import family_of
from megatron_train.resolve import resolve


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU on the busiest pipeline stage."""

    weights: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        """Everything above."""
        return self.weights + self.grads + self.optimizer + self.activations


def stage_parameters(cfg: ExperimentConfig) -> float:
    """Parameters held by one GPU of the first pipeline stage (its layers plus the embedding, and
    the output end too without pipelining)."""
    m, p = cfg.model, cfg.parallel
    count = family_of(m).parameters(m)
    last = count.last if p.pipeline == 1 else 0
    return (count.first + m.num_layers / p.pipeline * count.per_layer + last) / p.tensor


def estimate_memory(cfg: ExperimentConfig, world_size: int) -> MemoryEstimate:
    """Weights (bf16), fp32 grads, fp32 main params + Adam moments (sharded over DP with the
    distributed optimizer), and 1F1B activations with flash attention (Korthikanti et al.)."""
    p, t, m = cfg.parallel, cfg.train, cfg.model
    dp = data_parallel_size(cfg, world_size)
    params = stage_parameters(cfg)
    optimizer_shards = dp if cfg.optimizer.distributed else 1
    s, b, h = cfg.data.seq_length / p.context, t.micro_batch_size, m.hidden_size
    per_layer = s * b * h * 34 / (p.tensor if p.sequence_parallel else 1)
    in_flight = min(p.pipeline, t.global_batch_size // (t.micro_batch_size * dp))
    return MemoryEstimate(
        weights=2 * params,
        grads=(4 if cfg.ddp.grad_reduce_in_fp32 else 2) * params,
        optimizer=12 * params / optimizer_shards,
        activations=per_layer * m.num_layers / p.pipeline * in_flight,
    )


def check_save_dir(cfg: ExperimentConfig) -> None:
    """The save dir exists or can be created, and is writable."""
    path = checkpoint_dir(cfg)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".preflight"):
            pass
    except OSError as err:
        raise ConfigError(
            "checkpoint.save_dir", f"{path} is not writable ({err.strerror})", "use a writable path"
        ) from err


def check_resume(cfg: ExperimentConfig) -> str:
    """The checkpoint a job would resume from is complete and was trained with the same model."""
    from megatron_train.checkpoint import files
    from megatron_train.checkpoint.state import read_common

    try:
        decision = files.resolve_load(cfg.checkpoint.load, checkpoint_dir(cfg))
    except files.CheckpointError as err:
        raise ConfigError(
            "checkpoint.load", str(err), "point it at a complete checkpoint or set it to auto / none"
        ) from err
    if decision.path is None and cfg.checkpoint.init_from:
        return f"starts from checkpoint.init_from={cfg.checkpoint.init_from}"
    if decision.path is None:
        return "starts fresh (" + "; ".join(decision.notes) + ")"
    saved = read_common(decision.path)["config"]["model"]
    ours = vars(cfg.model)
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "vocab_size", "vocab_pad_multiple", "tie_embeddings", "qkv_bias"):  # fmt: skip
        if saved.get(key) != ours[key]:
            raise ConfigError(
                f"model.{key}",
                f"is {ours[key]} but checkpoint {decision.path} was trained with {saved.get(key)}",
                "use the checkpoint's model settings or another checkpoint",
            )
    return f"resumes from {decision.path}"


def run(config: str, overrides: list[str], world_size: int) -> tuple[list[str], MemoryEstimate]:
    """All checks; returns the report lines and the memory estimate, or raises ConfigError."""
    cfg = resolve(config, overrides, world_size)
    check_save_dir(cfg)
    resume = check_resume(cfg)
    mem = estimate_memory(cfg, world_size)
    gib = 2**30
    p = cfg.parallel
    dp = data_parallel_size(cfg, world_size)
    lines = [
        f"layout: TP{p.tensor} x PP{p.pipeline} x CP{p.context} x DP{dp} = {world_size} ranks; "
        f"{cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)} microbatches per step",
        f"data: {len(cfg.data.blend)} blend entries found; the tokenizer fits "
        f"model.vocab_size={cfg.model.vocab_size}",
        f"checkpoints: {checkpoint_dir(cfg)} is writable; the job {resume}",
        f"memory per GPU (estimate, busiest stage): weights {mem.weights / gib:.1f} GiB + grads "
        f"{mem.grads / gib:.1f} + optimizer {mem.optimizer / gib:.1f} + activations "
        f"{mem.activations / gib:.1f} = {mem.total / gib:.1f} GiB",
    ]
    return lines, mem


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory-gib", type=float, default=80.0, help="warn above this (H100: 80)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    try:
        lines, mem = run(args.config, args.overrides, args.nodes * args.gpus_per_node)
    except BAD_INPUT as err:
        print(f"preflight error: {err}", file=sys.stderr)
        return 2
    for line in lines:
        print(f"preflight: {line}")
    if mem.total / 2**30 > args.gpu_memory_gib:
        print(
            f"preflight warning: the estimate exceeds {args.gpu_memory_gib:g} GiB per GPU; consider more "
            "tensor/pipeline parallelism, sequence parallelism or a smaller micro batch",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
