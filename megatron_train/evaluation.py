"""Validation every ``train.eval_interval`` steps and after the last one."""

from __future__ import annotations

import torch
from megatron.core.datasets.gpt_dataset import GPTDataset

from megatron_train.config import ExperimentConfig
from megatron_train.data import batch_loader
from megatron_train.metrics import MetricsLogger
from megatron_train.step import Stepper


def validation_due(cfg: ExperimentConfig, step: int) -> bool:
    """Whether validation runs after ``step``: every ``train.eval_interval`` steps and the last."""
    interval = cfg.train.eval_interval
    return bool(interval) and (step % interval == 0 or step == cfg.train.steps)


class Evaluator:
    """Runs and logs a validation pass when one is due."""

    def __init__(
        self, cfg: ExperimentConfig, stepper: Stepper, dataset: GPTDataset | None, log: MetricsLogger
    ):
        self.cfg, self.stepper, self.dataset, self.log = cfg, stepper, dataset, log
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
            loss = self.stepper.evaluate(iters, t.eval_steps)
        self.log.log_validation(step, loss)
