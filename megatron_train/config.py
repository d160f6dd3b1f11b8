"""The experiment config: one typed schema, and what follows from it alone (paths, sizes, blends).

Every option is a dataclass field with a docstring below it, its type declaring its valid values.
``config_loading`` builds it from YAML and ``key.sub=value`` overrides, checking each field against
those declarations; ``config_checks`` rejects options that contradict each other. Either raises a
:class:`ConfigError` that names the exact key and how to fix it. This module is a leaf: presets,
Hugging Face architectures and the tokenizer's vocabulary are filled in by ``megatron_train.resolve``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from megatron_train.errors import ConfigError, shown


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


def split_numbers(text: str) -> list[float]:
    """The parts of a ``data.split`` such as ``98,2,0`` or ``98/2/0``, in order; ValueError for
    text that is not decimal numbers separated by ``,`` or ``/``."""
    parts = [part.strip() for part in re.split(r"[,/]", text)]
    if not all(re.fullmatch(r"[.0-9]+", part) for part in parts):
        raise ValueError(f"{text!r} is not numbers separated by , or /")
    return [float(x) for x in parts]


def split_parts(text: str) -> bool:
    """Whether ``text`` is a train/valid/test split in parts: up to three non-negative decimal
    numbers (:func:`split_numbers`) with a positive train part (megatron's own parser reads each
    run of digits and dots as a number, so ``1e2`` would be two, and asserts on the rest)."""
    try:
        numbers = split_numbers(text)
    except ValueError:
        return False
    return len(numbers) <= 3 and all(math.isfinite(x) and x >= 0 for x in numbers) and numbers[0] > 0


PositiveInt = Annotated[int, Range(1)]
NonNegativeInt = Annotated[int, Range(0)]
PositiveFloat = Annotated[float, Range(0, low_open=True)]
NonNegativeFloat = Annotated[float, Range(0)]
MINUTES_A_YEAR = 365 * 24 * 60
"""The longest timeout taken: far past any job, and short of where torch's timeouts overflow."""
MINUTES_SHORTEST = 0.01
"""The shortest timeout taken (0.6 s): torch keeps timeouts in whole milliseconds, so a shorter
one became no time at all, and every collective failed as if its peers were missing."""
Probability = Annotated[float, Range(0, 1, high_open=True)]
# The operating system takes no NUL in a path; a YAML "\0" escape would reach os.path as one.
FilePath = Annotated[
    str,
    Check(lambda text: bool(text.strip()) and "\0" not in text, "a non-empty path without NUL characters"),
]


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
    rotary_base: Annotated[int, Range(1, 2**63 - 1)] = 10000
    """RoPE base (theta); at most torch's largest integer, which megatron-core raises to powers."""
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
    gradient_accumulation_fusion: bool | Literal["auto"] = "auto"
    """Each weight-gradient GEMM adds its product straight into the fp32 main gradient instead of
    writing a gradient that is then added to it (megatron-core's gradient accumulation fusion,
    Megatron-LM's default): through apex's kernel where apex is installed, else through torch's
    ``addmm`` (on a GPU its form with bf16 inputs and fp32 output, when this torch has it).
    ``auto``: on, except under model.compile, which cannot trace it; ``true`` under model.compile
    runs the linears outside the compiled graphs, which then hold what lies between them."""
    rope_fusion: bool = False
    """The local spec's rotary embedding compiled: megatron-core's own RoPE function through
    torch.compile, whose fused kernels replace the about ten small ones it runs for each of a
    layer's queries and keys, two of them copies (megatron-core fuses RoPE only in Transformer
    Engine's spec, which always does). Compiles at the first step (C++ on a CPU). Already part of
    the compiled layers under model.compile."""
    attention_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    """Kernel for the local spec's SDPA attention; ``auto`` lets PyTorch choose. Ignored by TE.
    Refused at the start where PyTorch has no such kernel for the model: ``cudnn`` and ``efficient``
    without CUDA; ``flash`` with attention dropout on a CPU, with ``data.document_mask`` on CUDA;
    ``flash`` and ``cudnn`` in fp32 on CUDA."""
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


WEIGHT_SHAPING_KEYS = (
    "family",
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "vocab_size",
    "vocab_pad_multiple",
    "tie_embeddings",
    "qkv_bias",
    "qk_norm",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_shared_expert_ffn_hidden_size",
    "moe_router_expert_bias",
)
"""The ``model.*`` keys that decide which tensors a model holds and their shapes: a checkpoint's
weights load only into a model that agrees with it on these."""


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
    each dataset of ``blend`` whole as well, so ``split`` is left out (or ``100,0,0``). None:
    validation reads the valid part ``split`` cuts from ``blend``."""
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
    build_timeout_minutes: Annotated[float, Range(MINUTES_SHORTEST, MINUTES_A_YEAR)] = 120.0
    """How long the other ranks wait while rank 0 builds the dataset index (the first run over a
    large blend can take far longer than the collective timeout of training); from 0.01 (0.6 s)
    to a year, beyond which torch's timeouts overflow."""
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
    refused rather than overwrite them, and so is an older checkpoint of save_dir while newer
    complete ones are there (to roll back, move those out of save_dir and resume with ``auto``)."""
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


def to_dict(cfg: ExperimentConfig) -> dict:
    """The resolved config as plain data (for printing and saving)."""
    return dataclasses.asdict(cfg)


def dotted_leaves(tree: dict, prefix: str = "") -> dict:
    """A nested config dict as ``{"section.key": value}``."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(dotted_leaves(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


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
            f"{shown(blend)} is neither a list of prefixes nor [weight, prefix, ...] pairs",
            "write [prefix, ...] or [0.7, prefix_a, 0.3, prefix_b]",
        )
    else:
        prefixes, weights = list(blend[1::2]), [float(w) for w in blend[::2]]
    seen: dict[str, str] = {}
    for prefix in prefixes:
        # Normalised (a/../a/x is a/x) and through symbolic links, of the folders or of the .bin.
        path = os.path.realpath(f"{prefix}.bin")
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
    if weights and not math.isfinite(sum(weights)):
        # megatron-core divides each weight by their sum
        raise ConfigError(
            key,
            f"weights as large as {max(weights):g} add up past the largest float",
            "give weights as the shares they are, such as [0.7, prefix_a, 0.3, prefix_b]",
        )
    # megatron-core asserts that every weight, divided by their sum, is positive: one that small
    # next to the others comes out 0 as well.
    total = sum(weights) if weights else 0.0
    zero = (
        [(w, p) for w, p in zip(weights, prefixes, strict=True) if w == 0 or w / total == 0]
        if weights
        else []
    )
    if zero:
        (w, p), more = zero[0], f" (and {len(zero) - 1} more prefixes)" if len(zero) > 1 else ""
        raise ConfigError(
            key,
            (f"{p} has weight 0" if w == 0 else f"{p}'s weight {w:g} is 0 as a share of their sum {total:g}")
            + more,
            "leave it out of the blend or give it a positive weight"
            if w == 0
            else "give weights as the shares they are, such as [0.7, prefix_a, 0.3, prefix_b]",
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
