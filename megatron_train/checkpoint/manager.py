"""Saving (when the policy says, async, one in flight) and resuming, on top of megatron-core's
dist_checkpointing.

A save runs in three parts: every rank builds its sharded state dict and hands it to
dist_checkpointing (the only blocking part); a background process per rank writes the files;
once every rank has finished, megatron runs our finaliser on all ranks and rank 0 records
the files (sizes, SHA-256) in a thread, then moves the tracker and applies retention.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from torch.distributed.checkpoint.api import CheckpointException

from megatron_train import errors, megatron_compat, placement, run_lock
from megatron_train.checkpoint import files, results_server
from megatron_train.checkpoint.files import CheckpointError
from megatron_train.checkpoint.policy import SavePolicy
from megatron_train.checkpoint.state import (
    Layout,
    Progress,
    check_architecture,
    check_same_optimizer,
    config_changes,
    decay_end_note,
    full_state,
    load_model,
    load_optimizer,
    load_weights,
    metadata,
    model_state,
    optimizer_format,
    read_common,
    read_sharded,
    read_tensor_metadata,
    record_fields,
    restore_rng,
    scheduler_state,
    weight_setting_changes,
)
from megatron_train.config import ExperimentConfig, checkpoint_dir, to_dict
from megatron_train.errors import CorruptCheckpoint
from megatron_train.parent_death import signal_at_parent_death
from megatron_train.stopping import STOP_SIGNALS, Decision

# A failed write is reported once, as SaveFailed's one line.
logging.getLogger(megatron_compat.ASYNC_WRITER_LOGGER).addFilter(
    lambda record: not megatron_compat.ASYNC_WRITER_FAILURE.match(record.getMessage())
)


class SaveFailed(RuntimeError):
    """A checkpoint's files could not be written (a full disk, a lost mount); raised on every rank
    together, the message is rank 0's, unless ``alone``: raised by the one rank that met it.
    Earlier checkpoints are untouched: the run stops with exit 1 and the same command resumes from
    the newest complete one."""

    def __init__(self, message: str, alone: bool = False) -> None:
        super().__init__(message)
        self.alone = alone


# How far below training the background writer runs (os.nice). Its files are not urgent; the
# training step is, and on a busy node (data workers, a few cores per GPU) the two compete.
WRITER_NICENESS = 10

# How long a save waits for its forked writer to run its first line before forking it again. A
# healthy child gets there in milliseconds; one forked while another thread held CPython's thread
# list lock never does (below).
WRITER_START_TIMEOUT_S = 10.0
# How often the save looks whether a writer that has not started yet has died instead.
WRITER_WATCH_S = 0.5


def _end_with(parent: int) -> None:
    """Have the kernel kill this (just forked) process when its parent ``parent`` exits, and exit
    now if it already has."""
    signal_at_parent_death(signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _in_writer(write: Callable, started_fd: int) -> Callable:
    """``write`` (megatron's writer entry point, run in the forked writer) reporting on
    ``started_fd`` that the child runs, then writing at a lower CPU priority.

    The writer ends with its rank (what it writes could no longer be recorded), and the processes
    megatron forks in it to write each bucket end with it: a worker whose writer was killed (by the
    out-of-memory killer, say) waits forever for it to take its result, holding the job's output
    open, so that a pipe or launcher reading it never sees its end.
    """
    rank_pid = os.getpid()

    @functools.wraps(write)
    def run(*args, **kwargs):
        _end_with(rank_pid)
        writer_pid = os.getpid()
        os.register_at_fork(after_in_child=lambda: _end_with(writer_pid))
        os.write(started_fd, b"s")
        os.nice(WRITER_NICENESS)
        try:
            return write(*args, **kwargs)
        except (ConnectionError, EOFError):
            # Its results server is gone, so the result cannot reach the rank, which says so.
            os._exit(1)

    return run


def _schedule_watched(queue: AsyncCallsQueue, request) -> None:
    """Hand ``request`` to megatron's queue, which forks a writer process for it, and see that the
    writer starts.

    CPython before 3.11.10 (gh-112275) deadlocks a forked child that inherits its thread list
    lock held, and gloo's worker threads take that lock whenever they free a tensor Python knows
    of (a new thread state each time), so now and then a writer hangs before it runs any Python
    and the save waits for it forever. A writer silent for WRITER_START_TIMEOUT_S is killed (it
    has written nothing) and forked again, as is one that dies before it starts.
    """
    if request.async_fn is None:  # nothing for this rank to write
        queue.schedule_async_request(request)
        return
    read_fd, write_fd = os.pipe()
    # poll, not select: a large job's process can hold more file descriptors than select takes.
    started = select.poll()
    started.register(read_fd, select.POLLIN)
    try:
        queue.schedule_async_request(request._replace(async_fn=_in_writer(request.async_fn, write_fd)))
        silent_s = 0.0
        while not started.poll(WRITER_WATCH_S * 1000):
            silent_s += WRITER_WATCH_S
            code = megatron_compat.last_async_call_exitcode(queue)
            if code is None and silent_s < WRITER_START_TIMEOUT_S:
                continue
            if code is not None and started.poll(0):
                break  # it started, and finished, between the two polls: its byte came before its exit
            why = (
                f"did not start within {WRITER_START_TIMEOUT_S:.0f} s (a fork-time deadlock of Python "
                "before 3.11.10)"
                if code is None
                else f"ended (exit code {code}) before it started"
            )
            print(
                f"rank {torch.distributed.get_rank()}: the checkpoint writer forked for this save {why}; "
                "forking it again",
                flush=True,
            )
            megatron_compat.fork_last_async_call_again(queue)
            # A child that reported just before it was killed leaves a byte behind.
            while started.poll(0):
                os.read(read_fd, 64)
            silent_s = 0.0
    finally:
        os.close(read_fd)
        os.close(write_fd)


def _write_failure(rank: int, err: BaseException) -> str:
    """What went wrong with ``rank``'s part of a save, for the error line."""
    if megatron_compat.ASYNC_WRITER_GONE in str(err):
        return (
            f"rank {rank}'s checkpoint writer process was killed, or crashed, before it finished "
            "(the out-of-memory killer often picks it: it holds a host copy of the rank's state)"
        )
    return errors.out_of_room(err) or errors.reason(err)


@contextlib.contextmanager
def gathered_params(model: list) -> Iterator[None]:
    """Every parameter holds this step's value inside the block, as Megatron-LM does before saving.

    With ``ddp.overlap_param_gather`` the distributed optimizer updates only this rank's shard;
    the other shards are all-gathered by forward pre-hooks during the next step. Disabling the
    hooks gathers them now; they are re-enabled (nothing left to gather) afterwards.
    """
    hooked = [chunk for chunk in model if chunk.use_forward_hook]
    for chunk in hooked:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in hooked:
            chunk.enable_forward_pre_hook()


def reads_in_parallel(option: bool | str, group: torch.distributed.ProcessGroup) -> bool:
    """Whether a load shares the reading over the data-parallel ``group``
    (``checkpoint.fully_parallel_load``); ``auto`` asks the ranks where they run (one collective
    over the group, whose ranks must all call this)."""
    if option != "auto" or group.size() == 1:
        return option is True and group.size() > 1
    nodes = [None] * group.size()
    torch.distributed.all_gather_object(nodes, placement.node_name(), group=group)
    return len(set(nodes)) > 1


class Checkpointer:
    """Decides when to save, saves and prunes the checkpoints of one run; finds and loads the one
    to resume from."""

    def __init__(self, cfg: ExperimentConfig, is_main: bool, log: Callable[[str], None]) -> None:
        self.cfg, self.options = cfg, cfg.checkpoint
        self.save_dir = checkpoint_dir(cfg)
        self.policy = SavePolicy.from_config(cfg)
        self.is_main, self.log = is_main, log
        self._queue = AsyncCallsQueue() if self.options.async_save else None
        self._recorder: threading.Thread | None = None
        self._recorder_error: BaseException | None = None
        self._results: results_server.ResultsServer | None = None
        self._strategies: dict[str, object] = {}
        self._writing: tuple[int, Path] | None = None
        # Rank 0's descriptor of the folder a save writes into. One removed (or moved) while the
        # save fills it may be made anew under its name (megatron's planning of the save makes
        # it), and the record would call the part written there complete.
        self._folder_fd: int | None = None

    def start_writer(self) -> None:
        """Start the server megatron's writer reports results through, and point megatron at it;
        called once every check of the start has passed, so a bad start does not wait for it.

        megatron's writer reports through a queue for synchronous saves too. megatron starts a
        Manager lazily on the first save, with default signal handling, so the SIGTERM or SIGINT
        that asks us to save-and-stop (torchrun and Ctrl-C signal the whole process group) kills
        it and the save fails. Ours ignores those signals. It starts in this thread, the one that
        forks the data loader's workers, in 0.06 s: started in a thread of its own while the
        loader forked, a worker kept the pipe on which Popen waits for its child's exec, and the
        first save waited for that worker to end, forever.
        """
        self._results = results_server.start(STOP_SIGNALS)
        megatron_compat.use_write_results_queue(self._results.queue())

    # -- saving ---------------------------------------------------------------------------

    def after_step(self, progress: Progress, decision: Decision, model: list, optimizer, scheduler) -> None:
        """Once a step on every rank: finish a background save, then save if the policy says so."""
        self.poll()
        why = self.policy.reason(progress.iteration, decision.elapsed_s, decision.stop)
        if why:
            self.save(progress.iteration, model, optimizer, scheduler, progress, why)
            self.policy.saved(decision.elapsed_s)

    def save(
        self, iteration: int, model: list, optimizer, scheduler, progress: Progress, why: str = "requested"
    ) -> None:
        """Start saving ``iteration`` (``why`` goes to the log); returns once the state is handed off
        (async) or written."""
        self.wait()
        start = time.perf_counter()
        path = files.iteration_dir(self.save_dir, iteration)
        if self.is_main:
            if path.is_symlink() or path.is_file():  # not a save of ours, under a save's name
                path.unlink()
            elif path.exists():
                # A torn save, or (checkpoint.load=none) an older run's step that this run replaces.
                shutil.rmtree(path)
            path.mkdir(parents=True)
            self._release_folder()
            self._folder_fd = os.open(path, os.O_PATH | os.O_DIRECTORY)
        torch.distributed.barrier()
        self._writing = (iteration, path)
        common = metadata(self.cfg, Layout.current(moe=self.cfg.model.num_experts is not None))
        fmt = self._format_for(why)
        first_of_its_kind = fmt not in self._strategies
        with gathered_params(model):
            state = full_state(model, optimizer, scheduler, progress, common, is_loading=False, fmt=fmt)
            # A run's state has one structure per format: the first save checks that every shard
            # is written exactly once and caches megatron's plans; later saves reuse them.
            request = dist_checkpointing.save(
                state, str(path), self._save_strategy(fmt), validate_access_integrity=first_of_its_kind,
                async_sharded_save=True,
            )  # fmt: skip
        request.add_finalize_fn(lambda: self._finalize(iteration, path, start, record_fields(common)))
        if self._queue is not None:
            _schedule_watched(self._queue, request)
        else:
            with self._failed_writes_reported():
                request.execute_sync()
        kind = "async" if self._queue is not None else "sync"
        blocked = time.perf_counter() - start
        self.log(
            f"checkpoint step {iteration} ({why}): {kind} save started, blocked training {blocked:.2f} s"
        )

    def _format_for(self, why: str) -> str:
        """The optimizer format of a save made for reason ``why`` (``checkpoint.optimizer_format``)."""
        if self.options.optimizer_format != "auto":
            return self.options.optimizer_format
        return "fully_reshardable" if why in ("stop", "end of run") else "dp_reshardable"

    def _save_strategy(self, fmt: str):
        """megatron's torch_dist writer for format ``fmt``, kept for the run so its plans are cached,
        spread over the data-parallel ranks when ``checkpoint.fully_parallel_save``."""
        if fmt not in self._strategies:
            strategy = get_default_save_sharded_strategy()
            strategy.use_cached_ckpt_structure = True
            group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            if self.options.fully_parallel_save and group.size() > 1:
                strategy = FullyParallelSaveStrategyWrapper(strategy, group, do_cache_distribution=True)
            self._strategies[fmt] = strategy
        return self._strategies[fmt]

    def _finalize(self, iteration: int, path: Path, start: float, extra: dict) -> None:
        """Runs on every rank once all ranks' files are written (megatron's finalize hook)."""
        if not self.is_main:
            return
        self._recorder = threading.Thread(
            target=self._record, args=(iteration, path, start, extra), daemon=False
        )
        self._recorder.start()
        if self._queue is None:
            self._join_recorder()

    def _folder_replaced(self, path: Path) -> bool:
        """Whether ``path`` no longer leads to the folder this save made there (rank 0 only)."""
        return self._folder_fd is not None and run_lock.replaced(path, self._folder_fd)

    def _release_folder(self) -> None:
        if self._folder_fd is not None:
            os.close(self._folder_fd)
            self._folder_fd = None

    def _record(self, iteration: int, path: Path, start: float, extra: dict) -> None:
        if self._folder_replaced(path):
            written_after = "what was written after that went into a new folder of that name, left unrecorded"
            self._recorder_error = self._save_failed(iteration, path, written_after)
            return
        self._release_folder()
        try:
            record = files.write_completion_record(path, iteration, self.options.checksums, extra)
            files.update_tracker(self.save_dir, iteration)
            removed = files.apply_retention(self.save_dir, self.options.keep_last, self.options.keep_every)
            gone = f"; removed {', '.join(p.name for p in removed)}" if removed else ""
            self.log(
                f"checkpoint step {iteration} complete: {path} ({files.total_size(record) / 2**20:.1f} MiB, "
                f"{time.perf_counter() - start:.2f} s from start to record){gone}"
            )
        except BaseException as err:  # re-raised on the training thread by wait()
            self._recorder_error = self._save_failed(iteration, path, f"recording it: {errors.reason(err)}")

    def _join_recorder(self) -> None:
        if self._recorder is not None:
            self._recorder.join()
            self._recorder = None
        if self._recorder_error is not None:
            err, self._recorder_error = self._recorder_error, None
            raise err

    def poll(self) -> None:
        """Finalise a finished background save (call on every rank, e.g. once per step)."""
        if self._queue is not None and self._queue.get_num_unfinalized_calls():
            with self._failed_writes_reported():
                self._queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        """Block until any save in flight is fully written and recorded (all ranks)."""
        if self._queue is not None and self._queue.get_num_unfinalized_calls():
            with self._failed_writes_reported():
                self._queue.maybe_finalize_async_calls(blocking=True)
        self._join_recorder()

    @contextlib.contextmanager
    def _failed_writes_reported(self) -> Iterator[None]:
        """Turn megatron's report of a failed write (raised on every rank, with the ranks' errors
        on rank 0 only) into :class:`SaveFailed` naming the step, the cause and the free space."""
        try:
            yield
        except CheckpointException as err:
            causes = sorted({_write_failure(rank, exc) for rank, (exc, _) in err.failures.items()})
            raise self._save_failed(*self._writing, "; ".join(causes) or "see rank 0") from None
        except (ConnectionError, EOFError):
            if self._results is None or self._results.running():
                raise
            # Its writer could not report either; the save is torn, and this rank alone knows.
            cause = (
                f"rank {torch.distributed.get_rank()}'s checkpoint results server (pid {self._results.pid}), "
                "which its writer reports to, was killed"
            )
            raise self._save_failed(*self._writing, cause, alone=True) from None
        except OSError as err:  # rank 0's own metadata write as it finalises (not a ConnectionError)
            raise self._save_failed(
                *self._writing, errors.out_of_room(err) or errors.reason(err), alone=True
            ) from None

    def _save_failed(self, iteration: int, path: Path, cause: str, alone: bool = False) -> SaveFailed:
        gone = run_lock.moved_away() or ([path] if self._folder_replaced(path) else [])
        self._release_folder()
        if gone:
            cause = (
                f"{' and '.join(map(str, gone))} removed or moved away while the save wrote into it: {cause}"
            )
        # The save dir may be what went.
        existing = next(
            folder for folder in (self.save_dir, *self.save_dir.absolute().parents) if folder.is_dir()
        )
        free = shutil.disk_usage(existing).free / 2**20
        newest = files.find_latest_complete(self.save_dir).path
        resume = f"{newest.name} is the newest complete checkpoint" if newest else "no checkpoint is complete"
        return SaveFailed(
            f"checkpoint step {iteration} could not be written to {path} "
            f"({cause}; {free:,.1f} MiB free on its file system). "
            f"{resume}: fix the cause and run the same command to resume",
            alone,
        )

    def release(self) -> None:
        """Stop the results server."""
        if self._results is not None:
            self._results.stop()
            self._results = None

    def close(self) -> None:
        """Wait for the last save, then stop the background writer."""
        self.wait()
        self._release_folder()
        if self._queue is not None:
            self._queue.close()

    # -- resuming -------------------------------------------------------------------------

    def _resolve_on_main(self) -> tuple[str | None, list[str], str | None]:
        try:
            decision = files.resolve_load(
                self.options.load,
                self.save_dir,
                self.options.verify_checksums,
                self.options.finetune,
                run_dir=Path(self.cfg.logging.run_dir),
            )
        except CheckpointError as err:
            return None, [], f"checkpoint.load: {err}. Fix checkpoint.load (or set it to auto / none)"
        except errors.ConfigError as err:
            return None, [], str(err)
        return (str(decision.path) if decision.path else None), decision.notes, None

    def resolve(self) -> Path | None:
        """The checkpoint to start from (decided on rank 0, agreed by all); None starts fresh."""
        decision = [self._resolve_on_main() if self.is_main else None]
        torch.distributed.broadcast_object_list(decision, src=0)
        path, notes, error = decision[0]
        for note in notes:
            self.log(note)
        if error:
            raise CheckpointError(error)
        return Path(path) if path else None

    def load(self, path: Path, model: list, optimizer, scheduler) -> Progress:
        """Load ``path`` into the model (and, unless fine-tuning, optimizer, schedule, RNG)."""
        try:
            return self._load(path, model, optimizer, scheduler)
        except CorruptCheckpoint as err:
            raise CorruptCheckpoint(err.problem, err.older, self._instead_of(path, err.older)) from err
        except (Exception, CheckpointException) as err:
            # A small file changed in place fails the load anywhere (a KeyError in the schedule's
            # state, a tensor "the model has no place for"); its checksum tells.
            if (damaged := files.changed_in_place(path)) is not None:
                raise CorruptCheckpoint(
                    damaged.problem, damaged.older, self._instead_of(path, damaged.older)
                ) from err
            raise

    def _instead_of(self, path: Path, older: Path | None) -> str:
        """What to resume from in place of ``path``, a whole checkpoint whose bytes are damaged
        (``older``: the newest complete one before it). It is not skipped as a torn one is: that
        would drop saved steps without a word."""
        if self.options.load != "auto":
            return f"set checkpoint.load to another checkpoint than {path}"
        where = (
            f"move {path.name} out of {self.save_dir} (to keep it) or delete it, then run the same command"
        )
        if older is None:
            return f"{where} to start afresh, or restore {path.name} from a copy"
        return f"{where} to resume from {older.name}, the newest complete checkpoint before it"

    def _load(self, path: Path, model: list, optimizer, scheduler) -> Progress:
        common, current = read_common(path), to_dict(self.cfg)
        if self.options.finetune or common.get("weights_only"):
            load_weights(path, model, weight_setting_changes(common["config"], current))
            # The optimizer's fp32 main copies were taken from the initial weights (bf16 models).
            optimizer.reload_model_params()
            self.log(f"fine-tuning from the weights of {path} (optimizer and step start fresh)")
            return Progress(iteration=0, consumed_samples=0)
        check_same_optimizer(path, common, self.cfg.optimizer.distributed)
        saved, now = Layout(**common["layout"]), Layout.current(moe=self.cfg.model.num_experts is not None)
        fmt = optimizer_format(common)
        if fmt == "dp_reshardable" and not saved.same_model_split(now):
            overrides = "train.exit_after_minutes=0.001"
            why = " (stop and end-of-run saves are fully_reshardable)"
            # That stop save takes this run's format, which a dp_reshardable setting would keep.
            if self.options.optimizer_format == "dp_reshardable":
                overrides += " checkpoint.optimizer_format=fully_reshardable"
                why = ""
            raise CheckpointError(
                f"{path} holds its optimizer state per data-parallel shard (dp_reshardable), which "
                f"resumes only at {saved.describe_model_split()} (any DP), not {now.describe()}. To move "
                f"it, run once at that layout with {overrides}: it trains one step and stops with a save "
                f"that loads at any layout{why}; or set checkpoint.finetune=true to take only its weights"
            )
        check_architecture(
            model_state(model),
            read_tensor_metadata(path),
            weight_setting_changes(common["config"], current),
            ", or start a new run in another logging.run_dir",
        )
        state = full_state(model, optimizer, scheduler, Progress(0, 0), {}, is_loading=True, fmt=fmt)
        if saved != now:
            del state["rng_state"]
        group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        parallel = reads_in_parallel(self.options.fully_parallel_load, group)
        loaded = read_sharded(state, path, parallel=parallel)
        load_model(model, loaded)
        try:
            load_optimizer(optimizer, loaded["optimizer"])
        except AssertionError as err:  # megatron asserts that dp_reshardable buckets match
            if fmt != "dp_reshardable":
                raise
            raise CheckpointError(
                f"{path}: its per-shard (dp_reshardable) optimizer state does not fit this run's "
                f"gradient buckets ({err}); resume with the ddp.bucket_size it was saved with, or "
                "from an end-of-run or stop save"
            ) from err
        progress = Progress.saved(loaded["progress"], common["config"]["data"]["seq_length"])
        scheduler.load_state_dict(scheduler_state(loaded["scheduler"], progress))
        if saved == now:
            restore_rng(loaded["rng_state"])
            how = "same layout, RNG states restored"
        else:
            how = f"resharded from {saved.describe()} to {now.describe()}; RNG streams start fresh"
        if parallel:
            how += "; read in parallel over data-parallel ranks"
        self.log(
            f"resumed from {path} at step {progress.iteration} "
            f"({progress.consumed_samples:,} samples, {progress.consumed_tokens:,} tokens consumed; {how})"
        )
        if changes := config_changes(common["config"], current):
            self.log(f"changed since that checkpoint: {'; '.join(changes)}")
        if note := decay_end_note(common["config"], current):
            self.log(note)
        return progress
