"""Validation every ``train.eval_interval`` steps and after the last one."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from megatron.core.datasets.gpt_dataset import GPTDataset

from megatron_train.config import ExperimentConfig
from megatron_train.data import batch_loader
from megatron_train.metrics import MetricsLogger
from megatron_train.step import Stepper
from megatron_train.stopping import StopWatch


def validation_due(cfg: ExperimentConfig, step: int) -> bool:
    """Whether validation runs after ``step``: every ``train.eval_interval`` steps and the last."""
    interval = cfg.train.eval_interval
    return bool(interval) and (step % interval == 0 or step == cfg.train.steps)


class Evaluator:
    """Runs and logs a validation pass when one is due."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        stepper: Stepper,
        dataset: GPTDataset | None,
        log: MetricsLogger,
        watch: StopWatch,
    ):
        self.cfg, self.stepper, self.dataset, self.log, self.watch = cfg, stepper, dataset, log, watch
        # Made once: each validation reads the same samples, and new loaders would fork their
        # workers again every time (their start-up, and on Python < 3.11.10 a chance that a child
        # forked beside a communication thread deadlocks at birth, CPython gh-112275).
        self._loaders: list[torch.utils.data.DataLoader] | None = None

    def after_step(self, step: int) -> None:
        """Validate and log if due (on every rank: validation runs the pipeline schedule)."""
        if self.dataset is None or not validation_due(self.cfg, step):
            return
        t = self.cfg.train
        samples = t.eval_steps * t.global_batch_size
        with self.log.left_out():
            if self._loaders is None:
                chunks = len(self.stepper.model)
                self._loaders = [
                    batch_loader(self.dataset, 0, self.cfg, num_samples=samples) for _ in range(chunks)
                ]
            iters = [iter(loader) for loader in self._loaders]
            loss = self.stepper.evaluate(iters, t.eval_steps, self._go_on(step))
        if loss is not None:
            self.log.log_validation(step, loss)

    def _go_on(self, step: int) -> Callable[[int], bool]:
        """After each schedule call of a validation (``done`` batches in all): a line once each
        ``logging.log_interval`` batches, so a long one is seen to move (the last batch's line is
        the result), and whether to go on. A stop signal or train.exit_after_minutes ends it
        early, as Megatron-LM's time limit does, so that the save it asks for comes before the
        scheduler's kill."""
        began, total, every = time.perf_counter(), self.cfg.train.eval_steps, self.cfg.logging.log_interval
        reported = 0

        def go_on(done: int) -> bool:
            nonlocal reported
            if done == total:
                return True
            decision = self.watch.decide()
            where = f"validation at step {step} | batch {done:,}/{total:,}"
            if decision.stop:
                why = self.watch.why(decision)
                self.log.info(f"{where} | cut short on {why}: no val loss at this step")
            elif done // every > reported // every:
                reported = done
                elapsed = time.perf_counter() - began
                left = elapsed / done * (total - done)
                self.log.info(f"{where} | {elapsed:.0f} s, about {left:.0f} s left")
            return not decision.stop

        return go_on
