"""Check a job before it waits in the queue: config vs allocation, data, tokenizer, save dir,
resume checkpoint, and a per-GPU memory estimate (an error above the GPU's memory, naming layouts
that fit). Runs on a login node (no GPU, no torch.distributed).

    python -m megatron_train.preflight --config X.yaml --nodes 4 --gpus-per-node 8 [key=value ...]

Exit codes: 0 ready, 2 a problem (one ``error:`` line naming it and the fix). Nothing is written.
"""

from __future__ import annotations

from pathlib import Path

from megatron_train import cli
from megatron_train.config import ExperimentConfig, checkpoint_dir, data_parallel_size, data_prefixes
from megatron_train.config_loading import override_for_option
from megatron_train.errors import BAD_INPUT, ConfigError
from megatron_train.memory import MemoryEstimate, estimate, fitting_layouts
from megatron_train.resolve import resolve


def check_resume(cfg: ExperimentConfig) -> str:
    """The checkpoint a job would resume from is complete and was trained with the same model."""
    from megatron_train.checkpoint import files
    from megatron_train.checkpoint.state import check_same_optimizer, check_within_steps, read_common

    try:
        decision = files.resolve_load(
            cfg.checkpoint.load,
            checkpoint_dir(cfg),
            finetune=cfg.checkpoint.finetune,
            run_dir=Path(cfg.logging.run_dir),
        )
    except files.CheckpointError as err:
        raise ConfigError(
            "checkpoint.load", str(err), "point it at a complete checkpoint or set it to auto / none"
        ) from err
    if decision.path is None and cfg.checkpoint.init_from:
        return f"starts from checkpoint.init_from={cfg.checkpoint.init_from}"
    if decision.path is None:
        return "starts fresh (" + "; ".join(decision.notes) + ")"
    if cfg.checkpoint.verify_checksums:  # the checksums themselves are left to the job
        files.check_checksums_recorded(decision.path, files.read_record(decision.path))
    common = read_common(decision.path)
    iteration = files.iteration_of(decision.path)
    if iteration is not None and not cfg.checkpoint.finetune:
        check_within_steps(decision.path, iteration, cfg.train.steps)
    if not (cfg.checkpoint.finetune or common.get("weights_only")):
        check_same_optimizer(decision.path, common, cfg.optimizer.distributed)
    saved = common["config"]["model"]
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


def check_memory(cfg: ExperimentConfig, world_size: int, gpu_memory_gib: float) -> MemoryEstimate:
    """The per-GPU estimate; ConfigError naming layouts that fit when it exceeds the GPU's memory."""
    mem = estimate(cfg, world_size)
    limit = gpu_memory_gib * 2**30
    if mem.total > limit:
        fits = fitting_layouts(cfg, world_size, limit)
        raise ConfigError(
            "parallel",
            f"the estimate is {mem.total / 2**30:.1f} GiB per GPU ({mem.stage} stage), above "
            f"--gpu-memory-gib={gpu_memory_gib:g}",
            (
                "use one of: " + " | ".join(fits)
                if fits
                else "use more GPUs, recompute or a smaller micro batch"
            )
            + " (or pass --allow-over-memory)",
        )
    return mem


def run(
    config: str,
    overrides: list[str],
    world_size: int,
    gpu_memory_gib: float = 80.0,
    allow_over_memory: bool = False,
) -> list[str]:
    """All checks; returns the report lines, or raises a bad-input error."""
    from megatron_train.runtime import collective_timeout

    cfg = resolve(config, overrides, world_size)
    timeout = collective_timeout()  # the job inherits the submitting shell's environment
    resume = check_resume(cfg)
    mem = estimate(cfg, world_size) if allow_over_memory else check_memory(cfg, world_size, gpu_memory_gib)
    gib = 2**30
    p = cfg.parallel
    dp = data_parallel_size(cfg, world_size)
    return [
        f"layout: TP{p.tensor} x PP{p.pipeline} x CP{p.context} x DP{dp} = {world_size} ranks"
        + (f" (experts: EP{p.expert} x ETP{p.expert_tensor or p.tensor})" if cfg.model.num_experts else "")
        + "; "
        f"{cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)} microbatches per step; "
        f"a collective waits up to {timeout.total_seconds() / 60:g} min",
        f"data: {len(data_prefixes(cfg.data))} datasets found; the tokenizer fits "
        f"model.vocab_size={cfg.model.vocab_size}",
        f"checkpoints: {checkpoint_dir(cfg)} can be written; the job {resume}",
        f"memory per GPU (estimate, {mem.stage} stage): weights {mem.weights / gib:.1f} GiB + grads "
        f"{mem.grads / gib:.1f} + optimizer {mem.optimizer / gib:.1f} + activations "
        f"{mem.activations / gib:.1f} = {mem.total / gib:.1f} GiB of {gpu_memory_gib:g}",
    ]


@cli.entry_point
def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(override_for=override_for_option, description=__doc__)
    parser.add_argument("--config", type=cli.non_empty, required=True)
    parser.add_argument("--nodes", type=cli.positive_int, default=1)
    parser.add_argument("--gpus-per-node", type=cli.positive_int, default=8)
    parser.add_argument(
        "--gpu-memory-gib", type=cli.positive_float, default=80.0, help="the GPU's memory (H100: 80)"
    )
    parser.add_argument(
        "--allow-over-memory", action="store_true", help="report, do not refuse, an estimate above it"
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    try:
        lines = run(
            args.config,
            args.overrides,
            args.nodes * args.gpus_per_node,
            args.gpu_memory_gib,
            args.allow_over_memory,
        )
    except BAD_INPUT as err:
        cli.report(err)
        return cli.EXIT_BAD_INPUT
    for line in lines:
        print(f"preflight: {line}")
    return 0


if __name__ == "__main__":
    cli.exit_process(main())
