"""Options that contradict each other or the launched world (a layout that does not divide the
ranks, a setting that has no effect under another): :func:`validate_options` refuses them, each
with a :class:`ConfigError` naming the key to change. No files are looked at here."""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_train.config import (
    ExperimentConfig,
    ModelConfig,
    ParallelConfig,
    ProfileConfig,
    data_parallel_size,
    decay_end,
    split_numbers,
)
from megatron_train.config_loading import check_fields
from megatron_train.errors import ConfigError, shown


def _validate_context(cfg: ExperimentConfig) -> None:
    p, d = cfg.parallel, cfg.data
    if p.context > 1 and d.seq_length % (2 * p.context):
        raise ConfigError(
            "data.seq_length",
            f"{d.seq_length} is not divisible by 2 x parallel.context = {2 * p.context} "
            "(context parallelism splits each sequence into that many chunks)",
            f"use a sequence length that is a multiple of {2 * p.context}",
        )
    if p.sequence_parallel and (d.seq_length // p.context) % p.tensor:
        per_rank = f"{d.seq_length} / parallel.context" if p.context > 1 else f"{d.seq_length}"
        raise ConfigError(
            "data.seq_length",
            f"{per_rank} is not divisible by parallel.tensor={p.tensor} (sequence parallel)",
            f"use a sequence length that is a multiple of {p.context * p.tensor}",
        )
    if d.reset_position_ids and not d.document_mask:
        raise ConfigError(
            "data.reset_position_ids",
            "restarts positions per document, but data.document_mask is false, so attention would "
            "cross documents at restarted positions",
            "set data.document_mask=true or data.reset_position_ids=false",
        )


def validate_options(cfg: ExperimentConfig, world_size: int) -> None:
    """Reject impossible layouts and inconsistent options (no files are looked at)."""
    check_fields(cfg)
    m, p, t, d = cfg.model, cfg.parallel, cfg.train, cfg.data
    if d.valid_blend is not None:
        if not d.valid_blend:
            raise ConfigError(
                "data.valid_blend",
                "is an empty list",
                "list validation datasets, or set it to null to validate on the part data.split cuts",
            )
        # A split with no valid or test part says what valid_blend does (train on all of blend),
        # and is how a command line overrides a config file's split.
        if "split" in _changed_fields(d) and any(split_numbers(d.split)[1:]):
            raise ConfigError(
                "data.split",
                f"is {d.split!r}, but with data.valid_blend every dataset is read whole",
                "remove data.split or set it to 100,0,0, or remove data.valid_blend to cut validation "
                "from data.blend",
            )
    model_parallel = p.tensor * p.pipeline * p.context
    if world_size % model_parallel:
        sizes = {"parallel.tensor": p.tensor, "parallel.pipeline": p.pipeline, "parallel.context": p.context}
        # The key to change: one that alone does not divide the world, else the first one set.
        key = next((k for k, size in sizes.items() if world_size % size), None)
        raise ConfigError(
            key or next(k for k, size in sizes.items() if size > 1),
            f"world size {world_size} is not divisible by tensor x pipeline x context = "
            f"{p.tensor} x {p.pipeline} x {p.context} = {model_parallel}",
            "launch a multiple of that many ranks or change parallel.tensor/pipeline/context",
        )
    _validate_experts(m, p, world_size)
    groups = m.query_groups
    if m.num_attention_heads % p.tensor:
        raise ConfigError(
            "model.num_attention_heads",
            f"{m.num_attention_heads} heads are not divisible by parallel.tensor={p.tensor}",
            "choose a tensor-parallel size that divides the number of heads",
        )
    if m.num_attention_heads % groups:
        raise ConfigError(
            "model.num_query_groups",
            f"{m.num_attention_heads} heads are not divisible into {groups} query groups",
            "use a number of query groups that divides num_attention_heads",
        )
    if groups % p.tensor:
        raise ConfigError(
            "model.num_query_groups",
            f"is {groups}, which parallel.tensor={p.tensor} does not divide (a rank holds whole groups)",
            "choose a tensor-parallel size that divides the number of query groups",
        )
    # Tensor parallelism splits an MLP's width across its ranks (megatron asserts it, at build).
    widths = {"model.moe_shared_expert_ffn_hidden_size": m.moe_shared_expert_ffn_hidden_size}
    if m.num_experts is None:
        widths["model.ffn_hidden_size"] = m.ffn_hidden_size
    for key, width in widths.items():
        if width and width % p.tensor:
            raise ConfigError(
                key,
                f"{width} is not divisible by parallel.tensor={p.tensor}, which splits the MLP's width",
                f"use a multiple of {p.tensor}, or a tensor-parallel size that divides it",
            )
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            "model.hidden_size",
            f"{m.hidden_size} is not divisible by {m.num_attention_heads} heads",
            "make hidden_size a multiple of num_attention_heads or set model.kv_channels",
        )
    if m.head_dim % 2:
        raise ConfigError(
            "model.kv_channels" if m.kv_channels else "model.hidden_size",
            f"gives heads of {m.head_dim} channels, but rotary embeddings turn channels in pairs",
            "use an even head dimension (kv_channels, or hidden_size / num_attention_heads)",
        )
    vpp = p.virtual_pipeline or 1
    if vpp > 1 and p.pipeline < 3:
        # With two stages a rank's previous and next stage are the same peer, and megatron's
        # batched p2p then matches same-shaped activations and gradients by posting order:
        # they can swap silently (measured: losses off by 1e-3 from step 1). Megatron-LM
        # rejects this layout too.
        raise ConfigError(
            "parallel.virtual_pipeline",
            f"the interleaved schedule needs parallel.pipeline >= 3, got {p.pipeline}",
            "set parallel.virtual_pipeline to null or use 3 or more pipeline stages",
        )
    if m.num_layers % (p.pipeline * vpp):
        raise ConfigError(
            "model.num_layers",
            f"{m.num_layers} layers are not divisible by pipeline x virtual_pipeline = {p.pipeline} x {vpp}",
            "choose a parallel.pipeline (x virtual_pipeline) that divides the layer count, or a layer "
            "count that is a multiple of it",
        )
    _validate_recompute(m, m.num_layers // (p.pipeline * vpp))
    if not m.rope_scaling and "rope_scaling_factor" in _changed_fields(m):
        # A factor alone reads as a long-context model that trains with unscaled RoPE.
        raise ConfigError(
            "model.rope_scaling_factor",
            "has no effect with model.rope_scaling=false",
            "set model.rope_scaling=true to scale RoPE as Llama 3.1 does, or remove it",
        )
    if cfg.ddp.overlap_param_gather and not cfg.optimizer.distributed:
        raise ConfigError(
            "ddp.overlap_param_gather",
            "overlaps the distributed optimizer's parameter all-gather, but optimizer.distributed is false",
            "set optimizer.distributed=true or ddp.overlap_param_gather=false",
        )
    if cfg.checkpoint.optimizer_format != "auto" and not cfg.optimizer.distributed:
        raise ConfigError(
            "checkpoint.optimizer_format",
            f"{cfg.checkpoint.optimizer_format!r} is a form of the distributed optimizer's state, but "
            "optimizer.distributed is false",
            "set optimizer.distributed=true or remove checkpoint.optimizer_format",
        )
    if p.sequence_parallel and p.tensor == 1:
        raise ConfigError(
            "parallel.sequence_parallel", "needs parallel.tensor > 1", "set it to false or raise TP"
        )
    _validate_context(cfg)
    dp = data_parallel_size(cfg, world_size)
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            "train.global_batch_size",
            f"{t.global_batch_size} is not divisible by micro_batch_size x data-parallel size = "
            f"{t.micro_batch_size} x {dp}",
            f"use a multiple of {t.micro_batch_size * dp}",
        )
    if vpp > 1 and (t.global_batch_size // (t.micro_batch_size * dp)) % p.pipeline:
        raise ConfigError(
            "train.global_batch_size",
            "the interleaved schedule needs the number of microbatches to be a multiple of "
            f"parallel.pipeline={p.pipeline}",
            "raise train.global_batch_size or lower train.micro_batch_size",
        )
    if d.seq_length > m.max_position_embeddings:
        raise ConfigError(
            "data.seq_length",
            f"{d.seq_length} exceeds model.max_position_embeddings={m.max_position_embeddings}",
            "shorten data.seq_length or raise model.max_position_embeddings",
        )
    if m.vocab_pad_multiple % p.tensor:
        raise ConfigError(
            "model.vocab_pad_multiple",
            f"{m.vocab_pad_multiple} is not divisible by parallel.tensor={p.tensor}",
            "use a multiple of the tensor-parallel size (e.g. 128)",
        )
    o = cfg.optimizer
    end = decay_end(cfg)
    end_key = "optimizer.decay_steps" if o.decay_steps else "train.steps"
    within = f"{end_key}={end}"
    if o.warmup_steps >= end:
        raise ConfigError(
            "optimizer.warmup_steps",
            f"{o.warmup_steps} warmup steps leave no decay within {within}",
            f"use fewer warmup steps than {end_key}",
        )
    if o.wsd_decay_steps is not None and o.decay_style != "WSD":
        raise ConfigError(
            "optimizer.wsd_decay_steps",
            f"applies to optimizer.decay_style=WSD only, not {o.decay_style}",
            "set optimizer.decay_style=WSD or remove optimizer.wsd_decay_steps",
        )
    if o.wsd_decay_steps is not None and o.wsd_decay_steps > end - o.warmup_steps:
        raise ConfigError(
            "optimizer.wsd_decay_steps",
            f"{o.wsd_decay_steps} decay steps do not fit after {o.warmup_steps} warmup steps within {within}",
            f"use at most {end - o.warmup_steps} decay steps",
        )
    if o.min_lr > o.lr:
        raise ConfigError(
            "optimizer.min_lr",
            f"{o.min_lr} exceeds the peak optimizer.lr={o.lr}",
            "set optimizer.min_lr to at most optimizer.lr",
        )
    _validate_profile(cfg.profile, t.steps, world_size)
    c = cfg.checkpoint
    if c.init_from and c.load != "auto":
        raise ConfigError(
            "checkpoint.init_from",
            f"applies only while resuming is automatic, but checkpoint.load={c.load!r}",
            "set checkpoint.load=auto, or load the weights with checkpoint.load + checkpoint.finetune",
        )
    if c.verify_checksums and not c.checksums:
        # Found only at the first resume otherwise: a requeued job would stop at its own checkpoint.
        raise ConfigError(
            "checkpoint.verify_checksums",
            "verifies checksums on load, and checkpoint.checksums=false writes none: this run could not "
            "resume from its own checkpoints",
            "set checkpoint.checksums=true, or checkpoint.verify_checksums=false",
        )
    if c.finetune and c.load in ("auto", "none"):
        raise ConfigError(
            "checkpoint.finetune",
            "needs a checkpoint to take weights from",
            "set checkpoint.load to its path",
        )


def _changed_fields(section: Any) -> list[str]:
    """The fields of a config section set otherwise than its defaults, in declaration order."""
    default = type(section)()
    return [
        f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(default, f.name)
    ]


def _validate_profile(pr: ProfileConfig, steps: int, world_size: int) -> None:
    if pr.start_step is None:
        if changed := _changed_fields(pr):
            raise ConfigError(
                f"profile.{changed[0]}",
                "has no effect while profile.start_step is null (profiling is off)",
                "set profile.start_step to the first step to profile, or remove it",
            )
        return
    if pr.num_steps > steps:
        # No start_step would do; the fix names the most that fits after the one given.
        room = steps - pr.start_step + 1
        raise ConfigError(
            "profile.num_steps",
            f"{pr.num_steps} exceeds train.steps={steps}",
            f"set it to at most {room} (steps {pr.start_step}-{steps})"
            if room > 0
            else f"set it to at most {steps}, and profile.start_step within train.steps",
        )
    last = pr.start_step + pr.num_steps - 1
    if last > steps:
        raise ConfigError(
            "profile.start_step",
            f"steps {pr.start_step}-{last} run past train.steps={steps}",
            f"set it to at most {steps - pr.num_steps + 1}, or lower profile.num_steps",
        )
    outside = [r for r in pr.ranks if r >= world_size]
    if not pr.ranks or outside or len(set(pr.ranks)) != len(pr.ranks):
        problem = (
            f"rank {outside[0]} does not exist in a job of {world_size} rank{'s' * (world_size > 1)}"
            if outside
            else f"{shown(pr.ranks)} is not a non-empty list of distinct ranks"
        )
        fix = (
            "set it to [0], the only rank"
            if world_size == 1
            else f"list ranks from 0 to {world_size - 1}, each once"
        )
        raise ConfigError("profile.ranks", problem, fix)


def _validate_experts(m: ModelConfig, p: ParallelConfig, world_size: int) -> None:
    if m.num_experts is None:
        keys = [f"model.{k}" for k in _changed_fields(m) if k.startswith("moe_")]
        keys += ["parallel.expert"] * (p.expert != 1)
        keys += ["parallel.expert_tensor"] * (p.expert_tensor not in (None, p.tensor))
        if keys:
            raise ConfigError(
                keys[0], "applies to mixture-of-experts models only", "set model.num_experts or remove it"
            )
        return
    if m.moe_router_topk > m.num_experts:
        raise ConfigError(
            "model.moe_router_topk",
            f"{m.moe_router_topk} exceeds model.num_experts={m.num_experts}",
            "route each token to at most num_experts experts",
        )
    if m.moe_router_topk == 1 and m.moe_router_score_function == "softmax" and not m.moe_router_pre_softmax:
        raise ConfigError(
            "model.moe_router_pre_softmax",
            "must be true with top-1 softmax routing (a softmax over one chosen logit is constant)",
            "set model.moe_router_pre_softmax=true or route to 2 or more experts",
        )
    if m.moe_router_pre_softmax and m.moe_router_score_function != "softmax":
        # megatron-core reads the flag on its softmax path only: with sigmoid it would do nothing.
        raise ConfigError(
            "model.moe_router_pre_softmax",
            "chooses where the softmax goes, and model.moe_router_score_function is sigmoid",
            "set model.moe_router_pre_softmax=false or the score function to softmax",
        )
    if m.moe_router_expert_bias and m.moe_router_score_function != "sigmoid":
        raise ConfigError(
            "model.moe_router_expert_bias",
            "aux-loss-free balancing needs model.moe_router_score_function=sigmoid",
            "set the score function to sigmoid or turn the expert bias off",
        )
    if m.num_experts % p.expert:
        raise ConfigError(
            "parallel.expert",
            f"{m.num_experts} experts are not divisible over {p.expert} expert-parallel ranks",
            "choose an expert-parallel size that divides model.num_experts",
        )
    etp = p.expert_tensor or p.tensor
    if m.expert_ffn_hidden_size % etp:
        raise ConfigError(
            "parallel.expert_tensor",
            f"the experts' width {m.expert_ffn_hidden_size} is not divisible by expert TP size {etp}",
            "choose an expert_tensor size that divides model.moe_ffn_hidden_size (or ffn_hidden_size)",
        )
    if world_size % (etp * p.expert * p.pipeline):
        raise ConfigError(
            "parallel.expert",
            f"world size {world_size} is not divisible by expert_tensor x expert x pipeline = "
            f"{etp} x {p.expert} x {p.pipeline}",
            "launch a multiple of that many ranks or change parallel.expert/expert_tensor",
        )
    if p.expert > 1 and p.tensor > 1 and not p.sequence_parallel:
        raise ConfigError(
            "parallel.sequence_parallel",
            "must be true when expert and tensor parallelism are combined (megatron-core's rule)",
            "set parallel.sequence_parallel=true",
        )


def validate_for_training(cfg: ExperimentConfig) -> None:
    """What megatron-core refuses only in training: inference, and a conversion that saves a
    checkpoint at the layout, take these."""
    if cfg.model.num_experts is not None and cfg.parallel.tensor > 1 and not cfg.parallel.sequence_parallel:
        # megatron-core's MoE layer raised a ValueError at the first training step.
        raise ConfigError(
            "parallel.sequence_parallel",
            "must be true to train a mixture-of-experts model with tensor parallelism (megatron-core's rule)",
            "set parallel.sequence_parallel=true",
        )


RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "moe", "shared_experts")


def _validate_recompute(m: ModelConfig, layers_per_stage: int) -> None:
    unused = {"selective": ("recompute_method", "recompute_num_layers"), "full": ("recompute_modules",)}.get(
        m.recompute, ("recompute_modules", "recompute_method", "recompute_num_layers")
    )
    if changed := [k for k in _changed_fields(m) if k in unused]:
        raise ConfigError(
            f"model.{changed[0]}",
            f"has no effect with model.recompute={m.recompute}",
            "set model.recompute to the kind it applies to (modules: selective; method and layers: "
            "full) or remove it",
        )
    if m.recompute == "selective":
        modules = m.recompute_modules
        bad = [x for x in modules if x not in RECOMPUTE_MODULES]
        if not modules or bad or len(set(modules)) != len(modules):
            raise ConfigError(
                "model.recompute_modules",
                f"{shown(modules)} is not a non-empty list of distinct modules"
                + (f" ({shown(bad)} unknown)" if bad else ""),
                f"list some of {list(RECOMPUTE_MODULES)}",
            )
        _validate_mlp_recompute(m)
    if m.compile:
        _validate_compile(m)
    if m.recompute == "full" and not 1 <= m.recompute_num_layers <= layers_per_stage:
        raise ConfigError(
            "model.recompute_num_layers",
            f"must be between 1 and the {layers_per_stage} layers of one pipeline stage, "
            f"got {m.recompute_num_layers}",
            f"set it to a value from 1 to {layers_per_stage}",
        )


def _validate_compile(m: ModelConfig) -> None:
    """What torch.compile cannot trace in a layer: an expert layer's token routing (counts read
    back to the host, shapes that depend on them) and megatron-core's recompute of a part of the
    layer (``CheckpointWithoutOutput``, which keeps its inputs on a Python object)."""
    if m.num_experts is not None:
        raise ConfigError(
            "model.compile",
            "compiles dense layers only, and this model's MLPs are mixtures of experts",
            "set model.compile=false",
        )
    partial = [x for x in m.recompute_modules if x != "core_attn"] if m.recompute == "selective" else []
    if partial:
        raise ConfigError(
            "model.compile",
            f"cannot compile a layer that recomputes {partial!r} (only core_attn, or full recompute)",
            "set model.recompute_modules=[core_attn], model.recompute=full or model.compile=false",
        )


def _validate_mlp_recompute(m: ModelConfig) -> None:
    """The MLP modules fit the model: megatron-core skips ``mlp`` in a mixture-of-experts layer
    without a word, which would leave the memory it was meant to save in use."""
    modules = m.recompute_modules
    if m.num_experts is not None and "mlp" in modules:
        raise ConfigError(
            "model.recompute_modules",
            "'mlp' recomputes a dense MLP, and this model's MLPs are mixtures of experts "
            "(megatron-core would skip it)",
            "use 'moe' for the whole expert layer, or 'shared_experts' for its shared expert",
        )
    if m.num_experts is None and {"moe", "shared_experts"} & set(modules):
        raise ConfigError(
            "model.recompute_modules",
            "'moe' and 'shared_experts' recompute a mixture-of-experts layer, and this model is dense",
            "use 'mlp'",
        )
    if "shared_experts" in modules and "moe" in modules:
        raise ConfigError(
            "model.recompute_modules",
            "'shared_experts' is part of 'moe' already",
            "list 'moe' for the whole expert layer, or 'shared_experts' for its shared expert alone",
        )
    if "shared_experts" in modules and not m.moe_shared_expert_ffn_hidden_size:
        raise ConfigError(
            "model.recompute_modules",
            "'shared_experts' needs a shared expert, and this model has none "
            "(model.moe_shared_expert_ffn_hidden_size is unset)",
            "use 'moe', or set model.moe_shared_expert_ffn_hidden_size",
        )
