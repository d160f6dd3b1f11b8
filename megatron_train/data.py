"""Training and validation data through megatron-core's BlendedMegatronDatasetBuilder."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from megatron_train import megatron_compat
from megatron_train.config import DataConfig, ExperimentConfig, split_blends, split_numbers
from megatron_train.errors import ConfigError
from megatron_train.inputs import requested_samples
from megatron_train.stopping import leave_the_stop_signals_to_the_rank
from megatron_train.tokenizer import load_tokenizer


class IndexProgress(logging.Handler):
    """Counts the dataset indices megatron builds or reads from its cache while it builds a blend
    (from the line it logs for each), and reports how far it got every ``every`` seconds."""

    def __init__(self, total: int, report: Callable[[str], None], every: float = 10.0) -> None:
        super().__init__(logging.INFO)
        self.total, self.report, self.every = total, report, every
        self.built = self.cached = 0
        self.started = self.reported = time.monotonic()

    def emit(self, record: logging.LogRecord) -> None:
        found = megatron_compat.DATASET_INDEX_MESSAGE.search(record.getMessage())
        if not found:
            return
        # logging holds this handler's lock around emit: megatron's builder threads take turns.
        if found.group(1) == "Load":
            self.cached += 1
        else:
            self.built += 1
        now = time.monotonic()
        if now - self.reported >= self.every:
            self.reported = now
            self.report(
                f"dataset indices: {self.built + self.cached} of {self.total} begun after "
                f"{now - self.started:.0f} s ({self.summary()})"
            )

    def summary(self) -> str:
        """How many indices were built and how many read from the cache so far."""
        return f"{self.built} built, {self.cached} from cache"

    @contextlib.contextmanager
    def watching(self) -> Iterator[IndexProgress]:
        """Listen to megatron's dataset log while the body runs."""
        logger = logging.getLogger(megatron_compat.DATASET_INDEX_LOGGER)
        level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        try:
            yield self
        finally:
            logger.removeHandler(self)
            logger.setLevel(level)


def index_count(cfg: ExperimentConfig) -> int:
    """How many dataset indices the blends need: one per dataset and split it is read for."""
    blends = split_blends(cfg)
    if cfg.data.valid_blend is not None:
        return sum(len(blend[0]) for blend in blends if blend is not None)
    splits = sum(1 for part in split_numbers(cfg.data.split) if part > 0)
    return len(blends[0][0]) * splits


def build_datasets(
    cfg: ExperimentConfig,
    cache_dir: str,
    progress: IndexProgress | None = None,
    consumed_samples: int = 0,
    steps_done: int = 0,
) -> tuple[GPTDataset, GPTDataset | None]:
    """The blended train and validation datasets, sized for the whole run (a resumed one: the
    ``consumed_samples`` of its ``steps_done`` steps and the rest); ``progress`` hears of each
    dataset index as it is built or read."""
    dataset_config = GPTDatasetConfig(
        random_seed=cfg.train.seed,
        sequence_length=cfg.data.seq_length,
        # megatron-core reads a blend per split whole, and one blend cut by the split.
        **(
            {"blend_per_split": split_blends(cfg)}
            if cfg.data.valid_blend is not None
            else {"blend": split_blends(cfg)[0], "split": cfg.data.split}
        ),
        path_to_cache=cache_dir,
        num_dataset_builder_threads=cfg.data.build_threads,
        tokenizer=load_tokenizer(cfg.data.tokenizer.type, cfg.data.tokenizer.path),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        # Attention is causal by construction (SDPA is_causal / TE's causal mask type).
        create_attention_mask=False,
    )
    builder = BlendedMegatronDatasetBuilder(
        GPTDataset, requested_samples(cfg, consumed_samples, steps_done), lambda: True, dataset_config
    )
    with progress.watching() if progress else contextlib.nullcontext():
        train, valid, _ = builder.build()
    return train, valid


class PretrainingSampler:
    """Micro-batches of sample indices for this data-parallel rank, from ``consumed_samples`` on.

    Global batch ``g`` is samples ``[g*GBS, (g+1)*GBS)`` whatever the layout, so any DP size
    sees the same data per step and a resumed run continues from the exact next sample.
    """

    def __init__(self, total: int, consumed: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        self.total, self.consumed = total, consumed
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self) -> Iterator[list[int]]:
        stride = self.micro_batch_size * self.dp_size
        for start in range(self.consumed, self.total - stride + 1, stride):
            first = start + self.dp_rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))

    def __len__(self) -> int:
        return (self.total - self.consumed) // (self.micro_batch_size * self.dp_size)


def check_loader_workers(cfg: ExperimentConfig) -> None:
    """Refuse more loader worker processes than the CPU cores this rank may run on (its affinity,
    which Slurm's --cpus-per-task narrows): more only compete for those cores, and each is a fork
    of the rank holding its own pages (a thousand of them filled the dev machine's 24 GiB and the
    kernel killed the run). PyTorch's DataLoader suggests the same bound, and only warns. The
    default's two workers pass on a one-core machine, where they always ran."""
    workers, cores = cfg.data.num_workers, len(os.sched_getaffinity(0))
    most = max(cores, DataConfig.num_workers)
    if workers > most:
        raise ConfigError(
            "data.num_workers",
            f"is {workers:,}, more loader processes than the {cores} CPU core{'s' * (cores != 1)} this "
            "rank may run on",
            f"set data.num_workers to at most {most} (0 reads in the rank's own process)",
        )


def batch_loader(
    dataset: GPTDataset, consumed_samples: int, cfg: ExperimentConfig, num_samples: int | None = None
) -> torch.utils.data.DataLoader:
    """The micro-batches for this rank, starting after ``consumed_samples``, as a loader each
    ``iter()`` of which starts there again; its worker processes are forked on the first and
    serve every later one."""
    sampler = PretrainingSampler(
        total=num_samples or len(dataset),
        consumed=consumed_samples,
        micro_batch_size=cfg.train.micro_batch_size,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
    )
    if cfg.data.num_workers > 0:
        # The workers' queues need semaphores in /dev/shm. Met by torch's iterator half-way through
        # its construction, a full /dev/shm also left a traceback of that iterator's __del__.
        torch.multiprocessing.get_context().Lock()
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=cfg.data.num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=cfg.data.num_workers > 0,
        worker_init_fn=leave_the_stop_signals_to_the_rank,
        # Each iter() draws a seed for its workers from this generator. From torch's default one
        # (which dropout draws from on a CPU), it would shift that stream, and a resumed run, whose
        # loaders are made after the checkpoint's RNG states are restored, would drop out other
        # units than the run it resumes.
        generator=torch.Generator().manual_seed(cfg.train.seed),
    )


class TimedBatches:
    """Micro-batches from ``batches``, counting the seconds ``next`` waited for them: the time a
    step stood still for its data (the loader's workers behind, a slow file system)."""

    def __init__(self, batches: Iterator[dict[str, torch.Tensor]]) -> None:
        self._batches, self.waited_s = batches, 0.0

    def __iter__(self) -> TimedBatches:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        began = time.perf_counter()
        try:
            return next(self._batches)
        finally:
            self.waited_s += time.perf_counter() - began


def slowest_wait(batches: list[TimedBatches], device: torch.device) -> float:
    """The most seconds any rank waited for its micro-batches since the last call (a collective:
    every rank calls it at the same step). One rank's wait holds every other one up."""
    waited = torch.tensor([sum(b.waited_s for b in batches)], dtype=torch.float64, device=device)
    for b in batches:
        b.waited_s = 0.0
    torch.distributed.all_reduce(waited, op=torch.distributed.ReduceOp.MAX)
    return waited.item()


def batch_iterator(
    dataset: GPTDataset, consumed_samples: int, cfg: ExperimentConfig, num_samples: int | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """An iterator of micro-batches for this rank, starting after ``consumed_samples``."""
    return iter(batch_loader(dataset, consumed_samples, cfg, num_samples))
