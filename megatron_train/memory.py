"""Per-GPU memory of a training job, from the config alone: the model states (weights, gradient
buffer, optimizer shards) and the activations the pipeline schedule keeps alive, for the busiest
pipeline stage. Preflight reports it and refuses layouts that do not fit.

Activations are counted per token and layer for a Llama-style block as megatron-core saves them
for backward with flash / SDPA attention (no score matrix); tensors of hidden size are split over
TP only with sequence parallelism. A mixture of experts counts each token's top-k copies and the
experts it reaches; routed experts' weights are split over EP x expert-TP ranks. Context
parallelism splits every sequence's tokens; our own CP attention adds the gathered keys and
values, and its document mask a byte per query-key pair. The last stage adds the logits and the
cross-entropy's fp32 softmax (megatron-core's loss) or the logits' gradient (our compiled one).
``benchmarks/memory_model.py`` measures peak memory for comparison (``tests/test_memory.py``
holds it within 15%).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch

from megatron_train.config import ExperimentConfig, ModelConfig, data_parallel_size
from megatron_train.config_checks import validate_for_training, validate_options
from megatron_train.errors import ConfigError
from megatron_train.host_memory import physical_memory
from megatron_train.models.common import one_pass_loss
from megatron_train.models.registry import family_of


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU on one pipeline stage."""

    stage: str
    weights: float
    grads: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        """Everything above."""
        return self.weights + self.grads + self.optimizer + self.activations


def _layer_values_per_token(cfg: ExperimentConfig, te: bool) -> dict[str, float]:
    """Activation values one layer keeps per token, by what recompute can drop.

    Local spec (unfused; what the CPU runs): each norm keeps its input, the normalised value and
    its output; attention keeps the QKV output (v is a view of it), q and k after RoPE, the output
    and the output projection's contiguous input; SwiGLU keeps gate, up and silu(gate), the down
    projection its input. Transformer Engine fuses each norm into the next linear (input and norm
    output kept) and SwiGLU into one kernel.
    """
    m, p = cfg.model, cfg.parallel
    q, kv = m.head_dim * m.num_attention_heads, m.head_dim * m.query_groups
    hidden = m.hidden_size / (p.tensor if p.sequence_parallel else 1)
    swiglu = 3 if te else 4
    if m.num_experts is None:
        mlp = swiglu * m.ffn_hidden_size / p.tensor
    else:
        # Each token's top-k copies: permuted, dispatched and combined hidden states, and the
        # SwiGLU of each expert it reaches (split over expert TP).
        mlp = m.moe_router_topk * (
            3 * m.hidden_size + swiglu * m.expert_ffn_hidden_size / (p.expert_tensor or p.tensor)
        )
    shared = swiglu * (m.moe_shared_expert_ffn_hidden_size or 0) / p.tensor
    if te:
        return {"layer input": hidden, "norms": 3 * hidden, "attention": (3 * q + 3 * kv) / p.tensor,
                "mlp": mlp, "shared expert": shared}  # fmt: skip
    # Our context-parallel attention keeps the whole sequence's keys and values, gathered.
    gathered = 2 * kv * (p.context - 1)
    return {"layer input": hidden, "norms": 5 * hidden, "attention": (4 * q + 3 * kv + gathered) / p.tensor,
            "mlp": mlp, "shared expert": shared}  # fmt: skip


def _layer_bytes(cfg: ExperimentConfig, te: bool, tokens: float, elem: int, layers: float) -> float:
    """Bytes ``layers`` layers keep for one micro-batch, with the configured recompute."""
    m = cfg.model
    parts = {key: value * tokens * elem for key, value in _layer_values_per_token(cfg, te).items()}
    full = sum(parts.values())
    if m.recompute == "selective":
        # mlp, moe, shared_experts: only the checkpoint's input stays (a mixture of experts' whole
        # layer, shared expert included, for moe); layernorm: the normalised values and outputs of
        # both norms go (Transformer Engine fuses the norms, so nothing to drop).
        dropped = {
            "mlp": parts["mlp"],
            "moe": parts["mlp"] + parts["shared expert"],
            "shared_experts": parts["shared expert"],
            "layernorm": 0.0 if te else parts["norms"] * 4 / 5,
        }
        return layers * (full - sum(dropped.get(module, 0.0) for module in m.recompute_modules))
    if m.recompute == "full" and m.recompute_method == "uniform":
        group = min(m.recompute_num_layers, layers)
        return layers / group * parts["layer input"] + group * full
    if m.recompute == "full":
        recomputed = min(m.recompute_num_layers, layers)
        return recomputed * parts["layer input"] + (layers - recomputed) * full + full
    return layers * full


def _in_flight(cfg: ExperimentConfig, microbatches: int) -> float:
    """Micro-batches whose activations the first stage holds at once (in units of all its layers)."""
    p = cfg.parallel
    vpp = p.virtual_pipeline or 1
    if p.pipeline == 1:
        return 1
    if vpp == 1:
        return min(p.pipeline, microbatches)
    # Interleaved warm-up: (pp - 1) * 2 + (vpp - 1) * pp chunk-microbatches, plus the one running.
    chunks = min(microbatches * vpp, (p.pipeline - 1) * 2 + (vpp - 1) * p.pipeline + 1)
    return chunks / vpp


def estimate(cfg: ExperimentConfig, world_size: int, on_gpu: bool = True) -> MemoryEstimate:
    """The busiest stage's memory per GPU: on GPU bf16 compute with fp32 master weights (or what
    ``train.precision`` says) and Transformer Engine layers unless ``model.transformer_impl`` is
    local; on CPU fp32 and the local layers."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    bf16 = cfg.train.precision == "bf16" or (cfg.train.precision == "auto" and on_gpu)
    te = on_gpu and m.transformer_impl != "local"
    elem = 2 if bf16 else 4
    dp = data_parallel_size(cfg, world_size)
    shards = dp * p.context if cfg.optimizer.distributed else 1
    count = family_of(m).parameters(m)
    layers = m.num_layers / p.pipeline
    microbatches = t.global_batch_size // (t.micro_batch_size * dp)
    tokens = t.micro_batch_size * cfg.data.seq_length / p.context
    # The logits, and megatron-core's cross-entropy's fp32 softmax (and fp32 copy of bf16 logits);
    # our compiled loss keeps the logits for its backward and writes their gradient, nothing more.
    per_logit = 2 * elem if one_pass_loss(m, te) else elem + (8 if bf16 else 4)
    logits = tokens * m.padded_vocab_size / p.tensor * per_logit
    # Our attention's document mask: a byte per (local query, key) pair, shared by the layers.
    mask = tokens * cfg.data.seq_length if cfg.data.document_mask and not te else 0.0
    stages = {
        "first": (count.first + layers * count.per_layer + (count.last if p.pipeline == 1 else 0),
                  _in_flight(cfg, microbatches), logits if p.pipeline == 1 else 0.0),
        "last": (layers * count.per_layer + count.last + (count.first if m.tie_embeddings else 0),
                 1.0, logits),
    }  # fmt: skip
    # Routed experts are split over expert-parallel (and expert-TP) ranks, and their optimizer
    # state over the expert-data-parallel ranks that remain.
    expert_split = p.expert * (p.expert_tensor or p.tensor)
    expert_shards = world_size // (expert_split * p.pipeline) if cfg.optimizer.distributed else 1
    experts = layers * count.per_layer_experts
    estimates = []
    for stage, (params, in_flight, last_logits) in stages.items():
        dense, experts_here = (params - experts) / p.tensor, experts / expert_split
        params = dense + experts_here
        estimates.append(
            MemoryEstimate(
                stage=stage if p.pipeline > 1 else "only",
                weights=elem * params,
                grads=(4 if cfg.ddp.grad_reduce_in_fp32 or not bf16 else 2) * params,
                optimizer=((4 if bf16 else 0) + 8) * (dense / shards + experts_here / expert_shards),
                activations=in_flight * (_layer_bytes(cfg, te, tokens, elem, layers) + mask) + last_logits,
            )
        )
    return max(estimates, key=lambda e: e.total)


def _selective_modules(m: ModelConfig) -> list[str]:
    """The selective recompute suggested for a model: its MLP (``moe`` for experts) and norms."""
    return ["mlp" if m.num_experts is None else "moe", "layernorm"]


def fitting_layouts(cfg: ExperimentConfig, world_size: int, limit_bytes: float) -> list[str]:
    """Up to three layouts of ``world_size`` GPUs (TP within a node, PP, CP, recompute) that fit,
    least model parallelism and recompute first, as override strings."""
    m, default = cfg.model, ModelConfig()
    modules = _selective_modules(m)
    # Per kind of recompute: its override text and the model with it. The settings a kind does not
    # use are left at their defaults, which validation requires; full keeps the config's own.
    unused = {
        "recompute_modules": default.recompute_modules,
        "recompute_method": default.recompute_method,
        "recompute_num_layers": default.recompute_num_layers,
    }
    recomputes = {
        "none": ("", dataclasses.replace(m, **dict(unused, recompute="none"))),
        "selective": (
            f" model.recompute=selective model.recompute_modules=[{','.join(modules)}]",
            dataclasses.replace(m, **dict(unused, recompute="selective", recompute_modules=modules)),
        ),
        "full": (
            " model.recompute=full",
            dataclasses.replace(m, recompute="full", recompute_modules=default.recompute_modules),
        ),
    }
    found = []
    sizes = itertools.product(recomputes, (1, 2, 4, 8), (1, 2, 4, 8, 16), (1, 2, 4, 8, 16))
    for recompute, tensor, pipeline, context in sizes:
        parallel = dataclasses.replace(
            cfg.parallel,
            tensor=tensor,
            pipeline=pipeline,
            virtual_pipeline=None,
            context=context,
            sequence_parallel=tensor > 1,
        )
        extra, model = recomputes[recompute]
        trial = dataclasses.replace(cfg, parallel=parallel, model=model)
        # Only what training would accept: the experts' layout, heads, widths, batch and the rest.
        try:
            validate_options(trial, world_size)
            validate_for_training(trial)
        except ConfigError:
            continue
        if estimate(trial, world_size).total <= limit_bytes:
            sp = " parallel.sequence_parallel=true" if tensor > 1 else ""
            cp = f" parallel.context={context}" if context > 1 else ""
            found.append(f"parallel.tensor={tensor} parallel.pipeline={pipeline}{cp}{sp}{extra}")
        if len(found) == 3:
            return found
    return found


def check_fits_this_node(cfg: ExperimentConfig, world_size: int, local_rank: int, local_ranks: int) -> None:
    """The estimate fits the memory each rank has: on CPU the whole estimate against an equal
    share of this machine's memory, on GPU the weights, gradients and optimizer state (what stays
    resident whatever the schedule does) against the device's. A ConfigError names layouts that
    fit; otherwise the first allocation that fails stops the run with a traceback, or the kernel
    kills it."""
    on_gpu = torch.cuda.is_available()
    mem = estimate(cfg, world_size, on_gpu)
    if on_gpu:
        # The rank's own GPU: asking device 0 from every rank would open a context there for each.
        device = torch.cuda.get_device_properties(local_rank % torch.cuda.device_count())
        needed, limit = mem.total - mem.activations, device.total_memory
        what, where = "weights, gradients and optimizer state", f"{device.name}'s memory"
    else:
        needed, memory = mem.total, physical_memory()
        limit = memory / max(1, local_ranks)
        what, where = "everything", f"this machine's {memory / 2**30:,.1f} GiB over {local_ranks} rank(s)"
    if needed > limit:
        fits = fitting_layouts(cfg, world_size, limit)
        raise ConfigError(
            "parallel",
            f"the estimate is {needed / 2**30:,.1f} GiB per rank ({what}, {mem.stage} stage), more than "
            f"the {limit / 2**30:,.1f} GiB each rank has ({where})",
            ("use one of: " + " | ".join(fits))
            if fits
            else "use more ranks, recompute, a smaller micro batch or a smaller model",
        )
