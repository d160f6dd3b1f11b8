"""What a checkpoint holds, as megatron-core sharded state dicts, and putting it back.

Model chunks are ShardedTensors, so they reshard to any TP / PP / VPP / DP on load. The
distributed optimizer's state is in one of megatron's two forms (``checkpoint.optimizer_format``),
recorded in the checkpoint so the load asks for the same form. The scheduler,
progress counters, config and layout are common state (rank 0 writes them). Each rank's RNG
states are a ShardedObject indexed by global rank; they are restored only when the layout is
unchanged (otherwise the ranks' streams have no counterpart).
"""

from __future__ import annotations

import contextlib
import pickle
import random
import re
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    verify_checkpoint_and_load_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
from torch.distributed.checkpoint.api import CheckpointException

from megatron_train import __version__, megatron_compat
from megatron_train.checkpoint.files import CheckpointError, changed_in_place, corrupt
from megatron_train.checkpoint.safe_load import safe_unpickling
from megatron_train.config import WEIGHT_SHAPING_KEYS, ExperimentConfig, dotted_leaves, to_dict
from megatron_train.errors import ConfigError, CorruptCheckpoint, denied, reason

# What checkpoints written before the format was recorded hold.
_FORMAT_BEFORE_RECORDING = "fully_reshardable"


@dataclass(frozen=True)
class Layout:
    """The parallel layout a checkpoint was written with."""

    tensor: int
    pipeline: int
    virtual_pipeline: int
    data: int
    world_size: int
    expert: int = 1
    """Expert-parallel size (checkpoints from before MoE support hold dense models: 1)."""
    expert_tensor: int | None = None
    """Expert tensor-parallel size; None where it is irrelevant (a dense model)."""

    @classmethod
    def current(cls, moe: bool = False) -> Layout:
        """This job's layout, from megatron's parallel_state (expert sizes for an MoE model)."""
        return cls(
            tensor=parallel_state.get_tensor_model_parallel_world_size(),
            pipeline=parallel_state.get_pipeline_model_parallel_world_size(),
            virtual_pipeline=parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
            data=parallel_state.get_data_parallel_world_size(with_context_parallel=True),
            world_size=torch.distributed.get_world_size(),
            expert=parallel_state.get_expert_model_parallel_world_size() if moe else 1,
            expert_tensor=parallel_state.get_expert_tensor_parallel_world_size() if moe else None,
        )

    def _model_split(self) -> tuple:
        return self.tensor, self.pipeline, self.virtual_pipeline, self.expert, self.expert_tensor

    def same_model_split(self, other: Layout) -> bool:
        """Whether both split the model the same way (they may differ in data parallelism)."""
        return self._model_split() == other._model_split()

    def _describe(self, data: str) -> str:
        experts = f" x EP{self.expert} x ETP{self.expert_tensor}" if self.expert_tensor else ""
        return f"TP{self.tensor} x PP{self.pipeline} x VPP{self.virtual_pipeline}{data}{experts}"

    def describe_model_split(self) -> str:
        """``TP2 x PP2 x VPP1`` (``x EP2 x ETP1`` for an MoE model)."""
        return self._describe("")

    def describe(self) -> str:
        """``TP2 x PP2 x VPP1 x DP2`` (``x EP2 x ETP1`` for an MoE model)."""
        return self._describe(f" x DP{self.data}")


@dataclass(frozen=True)
class Progress:
    """Where training stands: what a resumed run continues from."""

    iteration: int
    consumed_samples: int
    skipped_steps: int = 0
    consumed_tokens: int = 0
    """Counted step by step, as a resumed run may change train.global_batch_size or
    data.seq_length."""

    def advanced(self, samples: int, tokens: int, skipped: bool) -> Progress:
        """Where training stands after one more step of ``samples`` samples and ``tokens`` tokens."""
        return Progress(
            self.iteration + 1,
            self.consumed_samples + samples,
            self.skipped_steps + int(skipped),
            self.consumed_tokens + tokens,
        )

    @classmethod
    def saved(cls, record: dict, seq_length: int) -> Progress:
        """The progress a checkpoint recorded; one written before tokens were counted had trained
        at the ``seq_length`` its config records."""
        return cls(**{"consumed_tokens": record["consumed_samples"] * seq_length, **record})


def metadata(cfg: ExperimentConfig, layout: Layout) -> dict:
    """What every checkpoint records beside its state, training saves and imports alike: the
    writer's version, the layout it was written at and the config."""
    return {"version": __version__, "layout": vars(layout), "config": to_dict(cfg)}


def config_changes(saved: dict, now: dict, only: Collection[str] | None = None) -> list[str]:
    """``key: old -> new`` for each training setting (model, data, optimizer, DDP, train) this run
    sets otherwise than the checkpoint's config, among ``only`` where given; the layout is reported
    with the resharding, and logging and checkpoint settings are where a run writes, not how it
    trains."""
    sections = ("model", "data", "optimizer", "ddp", "train")
    old, new = (dotted_leaves({k: v for k, v in tree.items() if k in sections}) for tree in (saved, now))
    return [
        f"{key}: {old[key]} -> {value}"
        for key, value in new.items()
        if key in old and old[key] != value and (only is None or key in only)
    ]


def weight_setting_changes(saved: dict, now: dict) -> list[str]:
    """:func:`config_changes` among the settings of :data:`WEIGHT_SHAPING_KEYS`: what can keep a
    checkpoint's weights from loading into this run's model."""
    return config_changes(saved, now, only={f"model.{key}" for key in WEIGHT_SHAPING_KEYS})


def decay_end_note(saved: dict, now: dict) -> str | None:
    """What a resume's changed ``train.steps`` does to the learning-rate decay when the config
    leaves its end to ``train.steps`` (``optimizer.decay_steps`` null), or None if the end stays."""
    if now["optimizer"]["decay_style"] == "constant" or now["optimizer"]["decay_steps"]:
        return None
    old, new = (tree["optimizer"].get("decay_steps") or tree["train"]["steps"] for tree in (saved, now))
    if old == new:
        return None
    return (
        f"the learning-rate decay now ends at step {new}, not {old}, so the lr from here on follows "
        f"the new schedule; set optimizer.decay_steps={old} to keep the schedule it was following"
    )


def record_fields(meta: dict) -> dict:
    """The part of :func:`metadata` the completion record repeats (readable without torch)."""
    return {"version": meta["version"], "layout": meta["layout"]}


def capture_rng() -> dict:
    """Every RNG stream this rank draws from, as plain data (weights-only loadable)."""
    version, mt_state, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    return {
        "python": (version, mt_state, gauss),
        "numpy": (np_name, torch.from_numpy(np_keys.astype(np.int64)), np_pos, np_has_gauss, np_gauss),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def restore_rng(state: dict) -> None:
    """Put back what :func:`capture_rng` took."""
    version, mt_state, gauss = state["python"]
    random.setstate((version, tuple(mt_state), gauss))
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = state["numpy"]
    np.random.set_state((np_name, np_keys.numpy().astype(np.uint32), np_pos, np_has_gauss, np_gauss))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharding_metadata(fmt: str = _FORMAT_BEFORE_RECORDING) -> dict:
    dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    return {
        "distrib_optim_sharding_type": fmt,
        "chained_optim_avoid_prefix": True,
        "dp_cp_group": dp_cp_group,
    }


def optimizer_format(common: dict) -> str:
    """The form a checkpoint's optimizer state was saved in (from :func:`read_common`)."""
    return common.get("optimizer_format", _FORMAT_BEFORE_RECORDING)


def check_same_optimizer(path: Path, common: dict, distributed: bool) -> None:
    """The checkpoint's optimizer state was saved by the optimizer kind resuming it: megatron-core's
    plain and distributed optimizers cannot read each other's (a KeyError deep in the load)."""
    saved = common["config"]["optimizer"].get("distributed", True)
    if saved != distributed:
        raise CheckpointError(
            f"{path} holds the optimizer state of optimizer.distributed={str(saved).lower()}: resume "
            "with that setting, or set checkpoint.finetune=true to take only its weights"
        )


def check_within_steps(path: Path, iteration: int, steps: int) -> None:
    """A resumed run has steps left, or has just finished them (a requeued finished job is done);
    a checkpoint past ``train.steps`` would otherwise end the run at once, saying "done"."""
    if iteration > steps:
        raise ConfigError(
            "train.steps",
            f"is {steps}, but {path} is already at step {iteration}",
            "raise train.steps to train on from there, or start a new run in another logging.run_dir",
        )


@contextlib.contextmanager
def _reading(what: Path) -> Iterator[None]:
    """Any error reading ``what`` as CheckpointError calling the checkpoint corrupt (the readers
    raise many kinds on a damaged file), except a file this user may not read: that one is whole,
    and the entry point names it with the fix."""
    try:
        yield
    except Exception as err:
        if denied(err):
            raise
        # megatron's reader of a missing common.pt fails on its own error path ('str' object has
        # no attribute 'iterdir').
        problem = f"is unreadable ({reason(err)})" if what.exists() else "is missing"
        raise corrupt(f"{what} {problem}: the checkpoint is corrupt", what.parent) from err


def read_common(path: Path) -> dict:
    """A checkpoint's common state (progress, layout, config, scheduler, version), loaded safely;
    CheckpointError naming the file when it cannot be read or lacks what every checkpoint holds."""
    # load_common_state_dict's two reads, apart, so that the error names the file that failed.
    with _reading(Path(path) / "metadata.json"):  # read by json and checked by megatron
        _, common_strategy = verify_checkpoint_and_load_strategy(str(path))
    with _reading(Path(path) / "common.pt"), safe_unpickling():
        common = common_strategy.load_common(str(path))
    config = common.get("config") if isinstance(common, dict) else None
    if not (
        isinstance(config, dict)
        and all(isinstance(config.get(s), dict) for s in ("model", "data", "train"))
        and isinstance(common.get("layout"), dict)
        and isinstance(common.get("progress"), dict)
    ):
        raise CheckpointError(
            f"{Path(path) / 'common.pt'} lacks the config, layout or progress every checkpoint holds: "
            "the checkpoint is corrupt or was not written by megatron-train"
        )
    return common


def read_tensor_metadata(path: Path) -> dict[str, ShardedTensor]:
    """Every saved tensor's key, global shape and dtype (no data read), loaded safely."""
    with _reading(Path(path) / ".metadata"), safe_unpickling():
        return dist_checkpointing.load_tensors_metadata(str(path))


def read_sharded(sharded_state: dict, path: Path, partial: bool = False, parallel: bool = False) -> dict:
    """Load the tensors and objects ``sharded_state`` asks for (any layout), safely.

    ``partial`` allows asking for part of a tensor (one layer, say), which megatron's check
    that the job's requests cover every tensor would otherwise refuse. ``parallel`` (with more
    than one data-parallel rank) has each data-parallel rank read a share of what they all need
    and exchange the rest, instead of every rank reading all of it."""
    strategy = None
    if parallel:
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        strategy = FullyParallelLoadStrategyWrapper(get_default_load_sharded_strategy(str(path)), group)
    try:
        with safe_unpickling():
            return dist_checkpointing.load(
                sharded_state, str(path), strategy, validate_access_integrity=not partial
            )
    except (Exception, CheckpointException) as err:  # DCP's gathers every rank's failures
        if (damaged := changed_in_place(Path(path))) is not None:
            raise damaged from err
        causes = [f[0] for f in err.failures.values()] if isinstance(err, CheckpointException) else [err]
        if causes and all(isinstance(cause, pickle.UnpicklingError) for cause in causes):
            raise _undecodable(path, causes[0]) from err
        raise


def _undecodable(path: Path, err: BaseException) -> CorruptCheckpoint:
    """A damaged ``.distcp`` file, whose objects (optimizer steps, RNG states, progress) are
    pickles: its size was right, so the completion record took it as whole."""
    return corrupt(
        f"{path} holds an object that does not unpickle ({reason(err)}): a file is corrupt "
        "(tools/inspect_checkpoint.py --verify-checksums names it)",
        path,
    )


def _unwrap(chunk):
    """The GPTModel inside megatron's DDP wrapper (state dict keys without ``module.``)."""
    return getattr(chunk, "module", chunk)


def model_state(model: list) -> dict:
    """The model chunks' sharded state dicts (``model`` or ``model0``, ``model1`` with VPP)."""
    metadata = _sharding_metadata()
    if len(model) == 1:
        return {"model": _unwrap(model[0]).sharded_state_dict(metadata=metadata)}
    return {f"model{i}": _unwrap(c).sharded_state_dict(metadata=metadata) for i, c in enumerate(model)}


def _materialize_optimizer_state(optimizer) -> None:
    """Give a fresh distributed optimizer its Adam state so a checkpoint can be loaded into it."""
    for opt in megatron_compat.distributed_optimizers(optimizer):
        if not opt.optimizer.state:
            megatron_compat.init_optimizer_state(opt)


def load_optimizer(optimizer, loaded: dict) -> None:
    """Put the loaded optimizer state (any layout) into this rank's optimizer, keeping this run's
    hyperparameters (the config's peak and minimum LR, Adam's betas and eps): loading brings back
    the checkpoint's param groups whole, and megatron's scheduler reads each group's ``max_lr`` and
    ``min_lr``, so a resume with a changed ``optimizer.lr`` trained on with the old one (the
    problem of Megatron-LM's issue 1138). The LR and weight decay are set by the scheduler's load."""
    own = [
        {k: v for k, v in group.items() if k not in ("params", "step")} for group in optimizer.param_groups
    ]
    # megatron 0.16's dp_reshardable load copies into the main params with autograd on, which
    # fails where they are the model's own fp32 parameters (its fully_reshardable load does not).
    with torch.no_grad(), megatron_compat.keeping_torch_adam_step(optimizer):
        optimizer.load_state_dict(loaded)
    for group, hyperparameters in zip(optimizer.param_groups, own, strict=True):
        group.update(hyperparameters)


def scheduler_state(saved: dict, progress: Progress) -> dict:
    """A checkpoint's scheduler state counted in optimizer steps, as :func:`build_optimizer` counts
    them: the steps that updated the weights (a skipped step leaves the schedule where it was).
    Checkpoints written before counted samples there."""
    return {**saved, "num_steps": progress.iteration - progress.skipped_steps}


def full_state(
    model: list, optimizer, scheduler, progress: Progress, common: dict, is_loading: bool, fmt: str
) -> dict:
    """Everything a resumable checkpoint holds (``common`` is config, layout and version), with the
    optimizer state in megatron's form ``fmt`` (``dp_reshardable`` or ``fully_reshardable``)."""
    state = model_state(model)
    if is_loading:
        _materialize_optimizer_state(optimizer)
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading, metadata=_sharding_metadata(fmt))
    state["optimizer_format"] = fmt
    state["scheduler"] = scheduler.state_dict()
    state["progress"] = asdict(progress)
    state.update(common)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    state["rng_state"] = ShardedObject("rng_state", capture_rng(), (world,), (rank,), replica_id=0)
    return state


def _tensors(sharded: dict) -> dict[str, ShardedTensor]:
    found = {}
    for item in nested_values(sharded):
        items = nested_values(item.build()) if isinstance(item, ShardedTensorFactory) else [item]
        for shard in items:
            if isinstance(shard, ShardedTensor):
                found.setdefault(shard.key, shard)
    return found


_OPTIMIZER_KEY = re.compile(r"(chained_\d+\.)?optimizer\.")


def _first_mismatch(
    needed: dict[str, ShardedTensor], everywhere: set[str], saved: dict[str, ShardedTensor]
) -> str | None:
    """The first tensor that keeps a checkpoint (``saved``) from loading into a model whose rank
    needs ``needed`` and whose ranks together hold ``everywhere``, in words; None if none does."""
    # Optimizer state: "optimizer.*", or "chained_<i>.optimizer.*" per optimizer of a chain (an MoE
    # model's experts have their own) in the dp_reshardable form.
    extra = sorted(k for k in saved if not _OPTIMIZER_KEY.match(k) and k not in everywhere)
    if extra:
        return f"the checkpoint has tensor {extra[0]!r} that the model has no place for"
    for key, shard in sorted(needed.items()):
        if key not in saved:
            return f"the checkpoint has no tensor {key!r} that the model needs"
        if tuple(saved[key].global_shape) != tuple(shard.global_shape):
            return (
                f"tensor {key!r} has shape {tuple(saved[key].global_shape)} in the checkpoint, "
                f"{tuple(shard.global_shape)} in the model"
            )
    return None


def check_architecture(
    model_sharded: dict, saved: dict[str, ShardedTensor], changes: list[str], alternative: str = ""
) -> None:
    """Fail with the first tensor whose global shape differs from the checkpoint's, that the
    checkpoint lacks, or that the checkpoint holds and the model has no place for (untied output
    weights loaded into a tied model, say: they would be dropped silently). The message names
    ``changes`` (:func:`weight_setting_changes`) as the settings to set back, and offers
    ``alternative`` as the other way out."""
    needed = _tensors(model_sharded)
    # A pipeline stage holds only its own tensors; the whole model is what all ranks hold together.
    held = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(held, sorted(needed))
    problem = _first_mismatch(needed, set().union(*held), saved)
    if problem is None:
        return
    if changes:
        raise CheckpointError(
            f"architecture mismatch: {problem}; this config changes the model the checkpoint was saved "
            f"from ({'; '.join(changes)}). Fix: set those back to the checkpoint's values{alternative}"
        )
    # No weight-shaping key differs: the vocabulary came from another tokenizer, or the checkpoint's
    # config was written by another version.
    raise CheckpointError(
        f"architecture mismatch: {problem}. Fix: load it into a model with the settings it was saved "
        f"with (model.vocab_size null takes the size from data.tokenizer){alternative}"
    )


def weights_state(model: list) -> dict:
    """:func:`model_state` without the layers' ``_extra_state`` (FP8 metadata, no weights): what a
    weights-only checkpoint (an imported one) holds and what fine-tuning needs."""
    return {
        name: {k: v for k, v in sharded.items() if not k.endswith("._extra_state")}
        for name, sharded in model_state(model).items()
    }


def load_model(model: list, loaded: dict) -> None:
    """Copy loaded model tensors into the chunks. Every weight must be there; the layers'
    ``_extra_state`` may not be (weights-only checkpoints have none)."""
    for i, chunk in enumerate(model):
        state = loaded["model"] if len(model) == 1 else loaded[f"model{i}"]
        missing, unexpected = _unwrap(chunk).load_state_dict(state, strict=False)
        problems = [k for k in missing if not k.endswith("._extra_state")] + list(unexpected)
        if problems:
            raise CheckpointError(f"the checkpoint's weights do not fit the model: {problems[:5]}")


def load_weights(path: Path, model: list, changes: list[str]) -> None:
    """Load only the model weights of checkpoint ``path`` (written at any layout) into the chunks;
    ``changes`` (:func:`weight_setting_changes`) are named if they do not fit."""
    request = weights_state(model)
    try:
        check_architecture(request, read_tensor_metadata(path), changes)
    except (CheckpointError, ConfigError) as err:
        # A mangled tensor name in a .metadata changed in place reads as another architecture.
        if (damaged := changed_in_place(Path(path))) is not None:
            raise damaged from err
        raise
    load_model(model, read_sharded(request, path))
