"""The experiment config: one typed schema, fed by a YAML file and ``key.sub=value`` overrides.

Every option is a dataclass field with a docstring below it. Loading rejects unknown keys and
wrong types, and :func:`validate_options` rejects impossible layouts, each with a :class:`ConfigError`
that names the exact key and how to fix it. This module is a leaf: presets, Hugging Face
architectures and the tokenizer's vocabulary are filled in by ``megatron_train.resolve``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml

from megatron_train.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """A field's valid numbers, declared on its type: ``Annotated[int, Range(1)]``."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    """Whether ``low`` itself is excluded."""
    high_open: bool = False
    """Whether ``high`` itself is excluded."""

    def allows(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def describe(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {_bound(self.low)}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {_bound(self.high)}")
        return " and ".join(parts)


def _bound(value: float) -> str:
    # An integer bound written whole: a seed's 4294967295, not 4.29497e+09.
    return str(value) if isinstance(value, int) else f"{value:g}"


@dataclass(frozen=True)
class Check:
    """A field's valid strings, declared on its type: ``accepts(text)`` is true for them."""

    accepts: Callable[[str], bool]
    describe: str


def split_parts(text: str) -> bool:
    """Whether ``text`` is a train/valid/test split in parts: up to three non-negative decimal
    numbers separated by ``,`` or ``/`` with a positive train part (megatron's own parser reads
    each run of digits and dots as a number, so ``1e2`` would be two, and asserts on the rest)."""
    parts = [part.strip() for part in re.split(r"[,/]", text)]
    if not all(re.fullmatch(r"[.0-9]+", part) for part in parts):
        return False
    try:
        numbers = [float(x) for x in parts]
    except ValueError:
        return False
    return len(parts) <= 3 and all(math.isfinite(x) and x >= 0 for x in numbers) and numbers[0] > 0


PositiveInt = Annotated[int, Range(1)]
NonNegativeInt = Annotated[int, Range(0)]
PositiveFloat = Annotated[float, Range(0, low_open=True)]
NonNegativeFloat = Annotated[float, Range(0)]
Probability = Annotated[float, Range(0, 1, high_open=True)]
FilePath = Annotated[str, Check(lambda text: bool(text.strip()), "a non-empty path")]


@dataclass
class ModelConfig:
    """The network: a decoder of one model family (a package in ``models/``), built from
    megatron-core's GPTModel. Sizes derived from these options (head dim, key/value heads, padded
    vocabulary) are the properties at the end, computed nowhere else."""

    family: str = "llama"
    """Model family: a package in ``models/`` (``llama`` covers Llama 2/3/3.1, Mistral, Qwen2).
    A preset or a Hugging Face ``checkpoint.init_from`` sets it."""
    preset: str | None = None
    """Name of a family's preset (e.g. ``llama3-8b``, ``tiny``; see ``models/<family>/presets.py``).
    Its values are the defaults; any other key set here overrides them."""
    num_layers: PositiveInt = 2
    """Number of transformer layers."""
    hidden_size: PositiveInt = 128
    """Model width."""
    ffn_hidden_size: PositiveInt = 352
    """Width of the SwiGLU MLP's inner projection."""
    num_attention_heads: PositiveInt = 4
    """Number of query heads."""
    num_query_groups: PositiveInt | None = None
    """Number of key/value heads for grouped-query attention; None means one per query head."""
    kv_channels: PositiveInt | None = None
    """Per-head dimension; None means hidden_size / num_attention_heads."""
    max_position_embeddings: PositiveInt = 2048
    """Longest sequence the model supports; data.seq_length may not exceed it."""
    vocab_size: PositiveInt | None = None
    """Vocabulary size; None takes it from the tokenizer."""
    vocab_pad_multiple: Annotated[int, Range(1, 65536)] = 128
    """The embedding is padded to a multiple of this (independent of TP, so checkpoints
    reshard across TP sizes); it must also be divisible by parallel.tensor. Megatron-LM's
    default is 128; more than 65536 rows of padding is a mistake."""
    norm_eps: PositiveFloat = 1e-5
    """RMSNorm epsilon."""
    rotary_base: PositiveInt = 10000
    """RoPE base (theta)."""
    rope_scaling: bool = False
    """Apply Llama-3.1-style RoPE frequency scaling."""
    rope_scaling_factor: Annotated[float, Range(1)] = 8.0
    """Llama-3.1 RoPE scaling factor (used when rope_scaling is true)."""
    tie_embeddings: bool = False
    """Share the input embedding and output projection weights."""
    qkv_bias: bool = False
    """Add a bias to the QKV projection (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over each head's queries and keys before attention (Qwen3)."""
    num_experts: PositiveInt | None = None
    """Routed experts per layer: every MLP becomes megatron-core's mixture-of-experts layer
    (dropless token routing). None keeps the dense SwiGLU MLP."""
    moe_ffn_hidden_size: PositiveInt | None = None
    """Inner width of each routed expert's SwiGLU; None means model.ffn_hidden_size."""
    moe_router_topk: PositiveInt = 2
    """Experts each token is routed to, at most model.num_experts."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router logits to weights: ``softmax`` over the chosen experts (Mixtral, Qwen3-MoE) or
    ``sigmoid`` (DeepSeek-V3)."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before choosing the top-k, so the chosen weights need not sum to
    one (Switch Transformer; Qwen3-MoE with ``norm_topk_prob: false``). Required for top-1;
    softmax scores only."""
    moe_router_expert_bias: bool = False
    """Aux-loss-free load balancing (DeepSeek-V3): a per-expert bias that only affects which experts
    are chosen, moved after each step towards equal loads. Needs the sigmoid score function."""
    moe_router_bias_update_rate: PositiveFloat = 1e-3
    """How far the expert bias moves per step (with model.moe_router_expert_bias)."""
    moe_aux_loss_coeff: NonNegativeFloat = 0.0
    """Weight of the Switch Transformer load-balancing loss (per micro-batch), added to the
    language-model loss; 0 turns it off."""
    moe_shared_expert_ffn_hidden_size: PositiveInt | None = None
    """Inner width of a shared expert every token also passes through; None means none."""
    moe_token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    """How tokens reach experts on other expert-parallel ranks."""
    init_method_std: PositiveFloat = 0.02
    """Std of the normal initialisation; output projections are scaled by 1/sqrt(2*num_layers)."""
    hidden_dropout: Probability = 0.0
    """Dropout after attention and MLP blocks."""
    attention_dropout: Probability = 0.0
    """Dropout on attention probabilities."""
    cross_entropy_fusion: bool = False
    """Fused cross-entropy: Transformer Engine's kernel with the TE spec; with the local spec,
    torch.compile'd passes over the logits as they are (megatron_train.models.loss), which never
    write the fp32 copy of a micro-batch's logits that megatron-core's loss keeps (see README:
    Design choices). Compiles at the first step (C++ on a CPU)."""
    gradient_accumulation_fusion: bool = True
    """Each weight-gradient GEMM adds its product straight into the fp32 main gradient instead of
    writing a gradient that is then added to it (megatron-core's gradient accumulation fusion,
    Megatron-LM's default): through apex's kernel where apex is installed, else through torch's
    ``addmm`` (on a GPU its form with bf16 inputs and fp32 output, when this torch has it). Off
    under model.compile, which cannot trace it."""
    rope_fusion: bool = False
    """The local spec's rotary embedding compiled: megatron-core's own RoPE function through
    torch.compile, whose fused kernels replace the about ten small ones it runs for each of a
    layer's queries and keys, two of them copies (megatron-core fuses RoPE only in Transformer
    Engine's spec, which always does). Compiles at the first step (C++ on a CPU). Already part of
    the compiled layers under model.compile."""
    attention_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    """Kernel for the local spec's SDPA attention; ``auto`` lets PyTorch choose. Ignored by TE."""
    compile: bool = False
    """torch.compile each transformer layer and the loss, as torchtitan compiles each block and
    its loss, so the norms, rotary embedding, SwiGLU and residual adds around the matmuls are
    fused, and the loss is model.cross_entropy_fusion's compiled passes. Dense models on the
    local layers, with full or ``core_attn`` recompute; tensor and sequence parallelism's
    communication splits each layer into several compiled graphs. The first step takes longer
    while the layer compiles (once: the layers share their code)."""
    transformer_impl: Literal["auto", "transformer_engine", "local"] = "auto"
    """Layer implementation: Transformer Engine's fused layers, megatron-core's own layers with
    PyTorch SDPA attention, or ``auto`` (TE when it imports and CUDA is present)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation, memory for compute: ``selective`` recomputes the submodules in
    model.recompute_modules during backward; ``full`` keeps only layer inputs and recomputes
    whole layers (model.recompute_method and model.recompute_num_layers say which)."""
    recompute_modules: list[Literal["core_attn", "mlp", "layernorm", "moe", "shared_experts"]] = field(
        default_factory=lambda: ["core_attn"]
    )
    """For ``selective``: any of ``core_attn`` (attention), ``layernorm`` (both norms of the local
    spec; Transformer Engine fuses them into the linears), and for the MLP: ``mlp`` (a dense
    model's SwiGLU MLP), ``moe`` (a mixture of experts' whole layer: router, dispatch, experts,
    shared expert) or ``shared_experts`` (only its shared expert)."""
    recompute_method: Literal["uniform", "block"] = "uniform"
    """For ``full``: ``uniform`` recomputes every layer, in groups of model.recompute_num_layers
    whose inputs are kept; ``block`` recomputes the first model.recompute_num_layers layers of each
    pipeline (or virtual) stage and keeps the rest's activations."""
    recompute_num_layers: PositiveInt = 1
    """For ``full``: the group size (uniform) or the layers per stage to recompute (block), from
    1 to the layers of one (virtual) pipeline stage."""

    @property
    def expert_ffn_hidden_size(self) -> int:
        """Inner width of one routed expert."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def head_dim(self) -> int:
        """Per-head dimension."""
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        """Key/value heads (query groups)."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        """The embedding's row count: the vocabulary rounded up to ``vocab_pad_multiple``."""
        return math.ceil(self.vocab_size / self.vocab_pad_multiple) * self.vocab_pad_multiple


@dataclass
class ParallelConfig:
    """How the model and batch are split over ranks. Data parallel size is what remains."""

    tensor: PositiveInt = 1
    """Tensor-parallel size (splits each layer's matmuls)."""
    pipeline: PositiveInt = 1
    """Pipeline-parallel size (splits the layers into stages)."""
    virtual_pipeline: PositiveInt | None = None
    """Model chunks per pipeline stage for the interleaved schedule; None or 1 disables it."""
    sequence_parallel: bool = False
    """Shard activations outside attention/MLP along the sequence across TP ranks."""
    context: PositiveInt = 1
    """Context-parallel size: each sequence is split over this many ranks in 2 x context chunks
    (rank i holds chunks i and 2 x context - 1 - i). Transformer Engine's attention where it is
    used, otherwise ours, which all-gathers keys and values over the context-parallel ranks."""
    expert: PositiveInt = 1
    """Expert-parallel size: each rank holds model.num_experts / expert of the routed experts.
    Expert ranks are carved from the data-parallel ranks (times TP, as in megatron-core)."""
    expert_tensor: PositiveInt | None = None
    """Tensor-parallel size inside each expert; None means parallel.tensor."""


@dataclass
class TokenizerConfig:
    """The tokenizer, loaded through megatron-core's tokenizer library."""

    type: Literal["sentencepiece", "huggingface"] = "sentencepiece"
    """Tokenizer library."""
    path: FilePath | None = None
    """SentencePiece ``.model`` file, or a Hugging Face tokenizer directory."""


@dataclass
class DataConfig:
    """Training data: megatron indexed datasets read through megatron-core's GPTDataset."""

    blend: list[FilePath | Annotated[float, Range(0)]] = field(default_factory=list)
    """Dataset prefixes (path without .bin/.idx). Either a list of prefixes (weighted by
    size) or a flat list ``[weight, prefix, weight, prefix, ...]``."""
    split: Annotated[str, Check(split_parts, "train,valid,test parts such as 98,2,0 (train > 0)")] = "98,2,0"
    """Train/valid/test split of every prefix, in parts."""
    valid_blend: list[FilePath | Annotated[float, Range(0)]] | None = None
    """Datasets validation reads, each whole, written as ``blend`` is (Megatron-LM's
    ``--valid-data-path``): a held-out set kept apart from the training data. Training then reads
    each dataset of ``blend`` whole as well, so ``split`` is not used. None: validation reads the
    valid part ``split`` cuts from ``blend``."""
    seq_length: PositiveInt = 256
    """Tokens per training sample."""
    cache_dir: FilePath | None = None
    """Where index caches are written; None puts them in ``<run_dir>/data_cache``."""
    document_mask: bool = False
    """Attention stays within each document of a packed sample (documents end with the
    tokenizer's EOD token); off, every token attends to all earlier tokens of its sample."""
    reset_position_ids: bool = False
    """With ``document_mask``: RoPE positions restart at 0 in each document."""
    num_workers: NonNegativeInt = 2
    """DataLoader worker processes per rank (0 reads in the training process); at most the CPU
    cores the rank may run on, which training checks at its start."""
    build_threads: PositiveInt = 1
    """Threads building the blend's dataset indices (megatron's ``num_dataset_builder_threads``);
    a blend of many datasets on a parallel filesystem builds faster with 4-8."""
    build_timeout_minutes: PositiveFloat = 120.0
    """How long the other ranks wait while rank 0 builds the dataset index (the first run over a
    large blend can take far longer than the collective timeout of training)."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """The tokenizer the data was preprocessed with."""


@dataclass
class OptimizerConfig:
    """Adam with megatron's distributed optimizer and OptimizerParamScheduler."""

    lr: PositiveFloat = 3e-4
    """Peak learning rate."""
    min_lr: NonNegativeFloat = 3e-5
    """Learning rate at the end of decay; at most ``lr``."""
    weight_decay: NonNegativeFloat = 0.1
    """Decoupled weight decay (not applied to norms and biases)."""
    adam_beta1: Probability = 0.9
    """Adam beta1."""
    adam_beta2: Probability = 0.95
    """Adam beta2."""
    adam_eps: PositiveFloat = 1e-8
    """Adam epsilon."""
    clip_grad: NonNegativeFloat = 1.0
    """Global gradient-norm clipping threshold; 0 disables clipping."""
    warmup_steps: NonNegativeInt = 0
    """Linear warmup steps."""
    decay_style: Literal["cosine", "linear", "WSD", "constant"] = "cosine"
    """Learning-rate decay after warmup."""
    decay_steps: PositiveInt | None = None
    """The step, counted from the first, at which the decay reaches ``min_lr`` (Megatron-LM's
    ``--lr-decay-iters``); later steps train at ``min_lr``. None: ``train.steps``. Set it to keep a
    run's schedule when a resume changes ``train.steps`` (extending a run), which otherwise
    stretches the decay over the new length."""
    wsd_decay_steps: PositiveInt | None = None
    """For WSD: steps of the final decay phase, within the steps after warmup (defaults to 10% of
    the decay steps)."""
    distributed: bool = True
    """Shard optimizer state over data-parallel ranks (megatron's distributed optimizer)."""


@dataclass
class DDPConfig:
    """megatron-core DistributedDataParallel settings."""

    grad_reduce_in_fp32: bool = True
    """Accumulate and reduce gradients in fp32 even when training in bf16."""
    bucket_size: PositiveInt | None = None
    """Gradient bucket size in elements; None lets megatron choose."""
    overlap_grad_reduce: bool = False
    """Overlap gradient reduce-scatter with the backward pass."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the next forward."""


@dataclass
class TrainConfig:
    """The training loop."""

    steps: PositiveInt = 100
    """Optimizer steps to train."""
    micro_batch_size: PositiveInt = 1
    """Sequences per microbatch per data-parallel rank."""
    global_batch_size: PositiveInt = 8
    """Sequences per optimizer step over all data-parallel ranks (gradient accumulation
    makes up the difference)."""
    seed: Annotated[int, Range(0, 2**32 - 1)] = 1234
    """Seed for weight init, data order and dropout."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute precision; ``auto`` is bf16 on GPU and fp32 on CPU."""
    eval_interval: NonNegativeInt = 50
    """Run validation every this many steps (and at the end); 0 disables it."""
    eval_steps: PositiveInt = 4
    """Global batches per validation run."""
    exit_after_minutes: NonNegativeFloat = 0.0
    """Wall-clock budget: once exceeded, save a checkpoint and exit with code 3 (resume later);
    0 disables it."""
    gc_interval: NonNegativeInt = 50
    """Python's garbage collection during the step loop: automatic collection is off and every
    rank collects after every this many steps (torchtitan's ``training.gc_freq``, Megatron-LM's
    ``--manual-gc-interval``), so no rank pauses alone while the others wait for it; 0 leaves
    Python's automatic collection on."""


@dataclass
class CheckpointConfig:
    """Distributed checkpoints (megatron-core dist_checkpointing, torch_dist format) and resume."""

    save_dir: FilePath | None = None
    """Where ``iter_NNNNNNN/`` checkpoints and the ``latest`` tracker go; None means
    ``<logging.run_dir>/checkpoints``."""
    load: FilePath = "auto"
    """``auto``: resume from the newest complete checkpoint in save_dir, or start fresh and say
    so. ``none``: start fresh. Anything else is a path (one ``iter_*`` checkpoint, a save
    dir, or a run directory saving to its default ``checkpoints/``) that must exist and be
    complete, or the run stops with an error. A start that would not continue the complete
    checkpoints save_dir already holds (``none``, another run's checkpoint, ``finetune``) is
    refused rather than overwrite them; an older checkpoint of save_dir itself is a rollback."""
    finetune: bool = False
    """Load only the model weights from ``load``; optimizer, LR schedule, step and data
    position start fresh."""
    init_from: FilePath | None = None
    """Weights to start from while save_dir holds no checkpoint yet (``load=auto``): a
    megatron-train checkpoint (an imported one, say) or a Hugging Face model directory, whose
    config.json then sets the model architecture (``model.max_position_embeddings`` may still be
    set, to train on longer sequences). Optimizer and step start fresh; once this run
    has saved, restarts resume from save_dir as usual."""
    interval: NonNegativeInt = 0
    """Save every this many steps; 0 disables step-based saves."""
    interval_minutes: NonNegativeFloat = 0.0
    """Save when this many minutes have passed since the last save; 0 disables it."""
    save_at_end: bool = True
    """Save after the last step."""
    async_save: bool = True
    """Write files in a background process while training continues (one save in flight)."""
    keep_last: NonNegativeInt = 2
    """Keep this many newest complete checkpoints; 0 keeps all."""
    keep_every: NonNegativeInt = 0
    """Also keep every checkpoint whose step is a multiple of this, forever; 0 disables it."""
    optimizer_format: Literal["auto", "dp_reshardable", "fully_reshardable"] = "auto"
    """How the distributed optimizer's state is stored. ``dp_reshardable``: each data-parallel
    rank writes its own shard, no gathering (fastest; resumable at any DP size, same TP / PP /
    VPP). ``fully_reshardable``: gathered into per-parameter tensors (resumable at any layout;
    the save gathers over data-parallel ranks). ``auto``: interval saves dp_reshardable, the
    end-of-run and stop saves (the ones a new layout resumes from) fully_reshardable."""
    fully_parallel_save: bool = True
    """Spread the writing of tensors every data-parallel rank holds (the weights) over those
    ranks, instead of the first one writing all of them."""
    fully_parallel_load: bool | Literal["auto"] = "auto"
    """Each data-parallel rank reads a share of the tensors they all need and the ranks exchange
    the rest, instead of every rank reading all of it. ``auto``: when the data-parallel ranks
    span several nodes, each of which would otherwise read the same bytes from the shared
    filesystem; ranks on one node share its page cache, where the exchange costs more than the
    repeated read."""
    checksums: bool = True
    """Record a SHA-256 of every file in the completion record (computed in the background)."""
    verify_checksums: bool = False
    """Verify those checksums when loading (sizes are always verified); needs checkpoint.checksums."""


@dataclass
class LoggingConfig:
    """Run directory, console log, metrics.jsonl, wandb and TensorBoard."""

    run_dir: FilePath = "runs/default"
    """Directory for the resolved config, metrics.jsonl and data caches."""
    log_interval: PositiveInt = 10
    """Print one line and write one metrics record every this many steps."""
    wandb: bool = False
    """Log to Weights & Biases."""
    wandb_project: Annotated[str, Check(bool, "a non-empty name")] = "megatron-train"
    """wandb project name."""
    wandb_mode: Literal["online", "offline"] = "offline"
    """``offline`` writes to ``<run_dir>/wandb`` without network; sync later with wandb sync."""
    tensorboard: bool = False
    """Also write every logged figure as a TensorBoard scalar into ``<run_dir>/tensorboard``
    (``tensorboard --logdir <run_dir>/tensorboard``); a resumed run hides the steps it redoes."""


@dataclass
class ProfileConfig:
    """A torch profiler trace of a few training steps, as Megatron-LM's ``--profile`` and
    torchtitan's ``[profiling]`` take one: ``<run_dir>/profile/step<a>-<b>/rank<r>.json.gz``
    (Perfetto or chrome://tracing) and ``rank<r>.txt``, the operators by their own time."""

    start_step: PositiveInt | None = None
    """First step to profile; null profiles nothing. Later than the first steps, which warm up."""
    num_steps: Annotated[int, Range(1, 100)] = 2
    """Steps one trace covers, from start_step on (a trace grows with every step)."""
    ranks: list[NonNegativeInt] = field(default_factory=lambda: [0])
    """Ranks that record a trace, each its own file; the others train unprofiled."""
    record_shapes: bool = False
    """Record each operator's input shapes too (a larger trace)."""
    memory: bool = False
    """Record allocations too; on a GPU also a CUDA memory snapshot of the same steps,
    ``rank<r>.memory.pickle``, for https://pytorch.org/memory_viz."""


@dataclass
class ExperimentConfig:
    """A whole experiment."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The network."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data and tokenizer."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""
    ddp: DDPConfig = field(default_factory=DDPConfig)
    """Gradient reduction."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training loop."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Outputs."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """Profiling some training steps."""


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _type_name(tp: Any) -> str:
    return _TYPE_NAMES.get(tp) or getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` checked against annotation ``tp`` (type, then declared range or check); ints are
    accepted where floats are expected. Every field of the schema is checked here and only here."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *declarations = typing.get_args(tp)
        value = _coerce(value, base, key)
        for rule in declarations:
            if isinstance(rule, Range) and not rule.allows(value):
                raise ConfigError(
                    key, f"{value!r} is out of range", f"set {key} to a value {rule.describe()}"
                )
            if isinstance(rule, Check) and not rule.accepts(value):
                raise ConfigError(key, f"{value!r} is not valid", f"set {key} to {rule.describe}")
        return value
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as err:
                errors.append(err)
        # An option of the value's own type that refused it says more than a type mismatch.
        errors.sort(key=lambda err: err.problem.startswith("expected"))
        if len(errors) > 1 and all(_is_mismatch(err) for err in errors):
            forms = ", or ".join(_form(option) for option in options if option is not type(None))
            raise ConfigError(key, f"{value!r} is not allowed", f"set {key} to {forms}")
        raise errors[0]
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(key, f"{value!r} is not allowed", f"use one of {list(choices)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, f"expected a list, got {value!r}", "write a YAML list")
        (item,) = typing.get_args(tp)
        return [_coerce(x, item, key) for x in value]
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key + ".")
    if tp is float:
        return _finite(value, key)
    if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    raise ConfigError(
        key,
        f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}",
        f"set {key} to {_type_name(tp)}",
    )


def _is_mismatch(err: ConfigError) -> bool:
    """Whether ``err`` says the value is of the wrong kind, not that its kind's rule refused it."""
    return err.problem.startswith("expected") or err.problem.endswith("is not allowed")


def _form(tp: Any) -> str:
    """What a value of annotation ``tp`` looks like, for a fix that lists a union's options."""
    if typing.get_origin(tp) is Literal:
        return ", ".join(repr(choice) for choice in typing.get_args(tp))
    if typing.get_origin(tp) is Annotated:
        return _form(typing.get_args(tp)[0])
    return _type_name(tp)


def _finite(value: Any, key: str) -> float:
    if isinstance(value, str):
        # YAML 1.1 reads exponent forms without a dot (``3e-4``) as strings.
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(
            key, f"expected a number, got {type(value).__name__} {value!r}", f"set {key} to a number"
        )
    if not math.isfinite(value):
        raise ConfigError(key, f"{value!r} is not a finite number", f"set {key} to a finite number")
    return float(value)


def check_fields(cfg: Any, prefix: str = "") -> None:
    """Check every field of a config built in code (not through :func:`from_dict`) against the
    schema's declarations."""
    hints = typing.get_type_hints(type(cfg), include_extras=True)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            check_fields(value, f"{prefix}{f.name}.")
        else:
            _coerce(value, hints[f.name], prefix + f.name)


def _names_paths(hint: Any) -> bool:
    return hint == FilePath or any(_names_paths(arg) for arg in typing.get_args(hint))


def check_paths_written_out(cfg: Any, prefix: str = "") -> None:
    """No path a user wrote starts with ``~`` or holds a ``$VARIABLE``: no shell reads a YAML
    config, so ``~/runs`` would make a folder named ``~`` in the working directory. Checked where
    a config is written (YAML and overrides), not where one is read back from a checkpoint."""
    hints = typing.get_type_hints(type(cfg), include_extras=True)
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            check_paths_written_out(value, key + ".")
        elif _names_paths(hints[f.name]):
            for path in value if isinstance(value, list) else [value]:
                if isinstance(path, str) and (path.startswith("~") or re.search(r"\$\{?\w", path)):
                    here = os.path.expanduser(os.path.expandvars(path))
                    raise ConfigError(
                        key,
                        f"{path!r} holds a ~ or $VARIABLE, which no shell expands in a config",
                        "write the path out in full" + ("" if "$" in here else f" (here: {here})"),
                    )


def from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a nested dict, rejecting unknown keys and wrong types."""
    key = prefix.rstrip(".") or "<top level>"
    if not isinstance(data, dict):
        raise ConfigError(key, f"expected a mapping, got {data!r}", "write key: value pairs")
    hints = typing.get_type_hints(cls, include_extras=True)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for name, value in data.items():
        if name not in names:
            close = difflib.get_close_matches(str(name), names, n=1)
            hint = f"did you mean '{prefix}{close[0]}'?" if close else f"valid keys: {names}"
            raise ConfigError(f"{prefix}{name}", "unknown key", hint)
        kwargs[name] = _coerce(value, hints[name], prefix + name)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b=value`` into its key path and YAML-parsed value."""
    if "=" not in text:
        raise ConfigError(text, "override is not of the form key.sub=value", "write key=value")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else None
    except yaml.YAMLError:
        value = raw
    except RecursionError:
        raise ConfigError(key.strip(), "the value nests lists or mappings too deeply", "flatten it") from None
    return key.strip().split("."), value


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one,
    so a second ``model:`` section would silently replace the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = []
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *anchor`` may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice", key_node.start_mark
                )
            seen.append(key)
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path) -> dict:
    """A YAML config file as plain data."""
    path = Path(path)
    if path.is_dir() or not path.exists():
        problem = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError("--config", f"{str(path)!r} {problem}", "pass an existing YAML file")
    if not path.is_file():
        # Every rank reads the config: a pipe (bash's <(...)) would give it to one rank only.
        raise ConfigError(
            "--config",
            f"{str(path)!r} is not a regular file (a device or a pipe, which one rank alone could read)",
            "write the config to a file and pass its path",
        )
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ConfigError(
            "--config", f"{path} is not valid YAML{where}: {problem}", "fix the YAML syntax"
        ) from err
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(
            "--config", f"{path} cannot be read as text ({err})", "pass a readable YAML file"
        ) from err
    except RecursionError:
        # PyYAML builds nested lists and mappings recursively.
        raise ConfigError(
            "--config", f"{path} nests lists or mappings too deeply to be read", "flatten them"
        ) from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(
            "--config",
            f"{path} holds a {type(raw).__name__}, not a mapping of sections",
            "write section: {key: value}",
        )
    return raw


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """``raw`` with ``key.sub=value`` overrides applied in order (changed in place)."""
    for text in overrides:
        keys, value = parse_override(text)
        node = raw
        for depth, part in enumerate(keys[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                dotted = ".".join(keys[: depth + 1])
                raise ConfigError(dotted, "is not a section", f"override a key inside {dotted}")
            node = child
        node[keys[-1]] = value
    return raw


def to_dict(cfg: ExperimentConfig) -> dict:
    """The resolved config as plain data (for printing and saving)."""
    return dataclasses.asdict(cfg)


SAVE_DIR_IN_RUN = "checkpoints"
"""The save dir's name inside logging.run_dir when checkpoint.save_dir is not set."""


def checkpoint_dir(cfg: ExperimentConfig) -> Path:
    """The directory checkpoints are saved to."""
    return Path(cfg.checkpoint.save_dir or Path(cfg.logging.run_dir) / SAVE_DIR_IN_RUN)


class RunFolder(typing.NamedTuple):
    """A folder a start may write inside logging.run_dir."""

    name: str
    on: Callable[[ExperimentConfig], bool]
    """Whether this config makes the start write it."""


RUN_FOLDERS = {
    "logging.tensorboard": RunFolder("tensorboard", lambda cfg: cfg.logging.tensorboard),
    "logging.wandb": RunFolder("wandb", lambda cfg: cfg.logging.wandb),
    "profile.start_step": RunFolder("profile", lambda cfg: cfg.profile.start_step is not None),
}
"""The folders a start may write inside logging.run_dir, by the key that turns each on."""


def run_folders(cfg: ExperimentConfig) -> dict[str, Path]:
    """The folders of :data:`RUN_FOLDERS` this start writes, as paths."""
    run_dir = Path(cfg.logging.run_dir)
    return {key: run_dir / f.name for key, f in RUN_FOLDERS.items() if f.on(cfg)}


def data_cache_dir(cfg: ExperimentConfig) -> Path:
    """The directory megatron-core's dataset indices are cached in."""
    return Path(cfg.data.cache_dir or Path(cfg.logging.run_dir) / "data_cache")


def data_parallel_size(cfg: ExperimentConfig, world_size: int) -> int:
    """Ranks left for data parallelism once TP, PP and CP are placed."""
    return world_size // (cfg.parallel.tensor * cfg.parallel.pipeline * cfg.parallel.context)


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
        if "split" in _changed_fields(d):
            raise ConfigError(
                "data.split",
                f"is {d.split!r}, but with data.valid_blend every dataset is read whole",
                "remove data.split, or data.valid_blend to cut validation from data.blend",
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
            f"{groups} query groups are not divisible by parallel.tensor={p.tensor}",
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
        raise ConfigError(
            "profile.num_steps", f"{pr.num_steps} exceeds train.steps={steps}", f"set it to at most {steps}"
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
            else f"{pr.ranks!r} is not a non-empty list of distinct ranks"
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
                f"{modules!r} is not a non-empty list of distinct modules"
                + (f" ({bad!r} unknown)" if bad else ""),
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
    if "shared_experts" in modules and ("moe" in modules or not m.moe_shared_expert_ffn_hidden_size):
        raise ConfigError(
            "model.recompute_modules",
            "'shared_experts' needs a shared expert (model.moe_shared_expert_ffn_hidden_size) and is "
            "part of 'moe' already",
            "list 'moe' alone, or 'shared_experts' for a model with a shared expert",
        )


def parse_blend(blend: list[Any], key: str = "data.blend") -> tuple[list[str], list[float] | None]:
    """``[w1, p1, w2, p2]`` or ``[p1, p2]`` -> (prefixes, weights or None); ``key`` names the
    option in errors."""
    if all(isinstance(item, str) for item in blend):
        prefixes, weights = list(blend), None
    elif len(blend) % 2 or not all(
        isinstance(w, (int, float)) and isinstance(p, str) for w, p in zip(blend[::2], blend[1::2])
    ):
        raise ConfigError(
            key,
            f"{blend!r} is neither a list of prefixes nor [weight, prefix, ...] pairs",
            "write [prefix, ...] or [0.7, prefix_a, 0.3, prefix_b]",
        )
    else:
        prefixes, weights = list(blend[1::2]), [float(w) for w in blend[::2]]
    seen: dict[str, str] = {}
    for prefix in prefixes:
        path = os.path.abspath(prefix)  # normalised too: a/../a/x is a/x
        if path in seen:
            # Both entries shuffle the same documents with the same seed: every sample comes twice.
            first = seen[path]
            also = "" if first == prefix else f" (also as {first})"
            raise ConfigError(
                key,
                f"{prefix} is named twice{also}",
                "name each dataset once; to weight it up, give it a larger weight in [weight, prefix, ...]",
            )
        seen[path] = prefix
    zero = [p for w, p in zip(weights, prefixes, strict=True) if w == 0] if weights else []
    if zero:
        # megatron-core's blend asserts that every weight is positive
        raise ConfigError(
            key,
            f"{zero[0]} has weight 0" + (f" (and {len(zero) - 1} more prefixes)" if len(zero) > 1 else ""),
            "leave it out of the blend or give it a positive weight",
        )
    return prefixes, weights


def decay_end(cfg: ExperimentConfig) -> int:
    """The step at which the learning-rate decay reaches ``optimizer.min_lr``."""
    return cfg.optimizer.decay_steps or cfg.train.steps


def split_blends(cfg: ExperimentConfig) -> list[tuple[list[str], list[float] | None] | None]:
    """The blend each split (train, valid, test) reads, as megatron-core's ``blend_per_split``
    takes them: with ``data.valid_blend``, ``data.blend`` for training and it for validation (none
    while validation is off), each dataset whole; otherwise ``data.blend`` for all three, which
    ``data.split`` cuts."""
    d = cfg.data
    train = parse_blend(d.blend)
    if d.valid_blend is None:
        return [train, train, train]
    valid = parse_blend(d.valid_blend, "data.valid_blend") if cfg.train.eval_interval > 0 else None
    return [train, valid, None]


def data_prefixes(d: DataConfig) -> dict[str, str]:
    """Every dataset prefix the config names, with the option that names it (a dataset in both
    blends: ``data.blend``)."""
    named = (
        {}
        if d.valid_blend is None
        else dict.fromkeys(parse_blend(d.valid_blend, "data.valid_blend")[0], "data.valid_blend")
    )
    return {**named, **dict.fromkeys(parse_blend(d.blend)[0], "data.blend")}
