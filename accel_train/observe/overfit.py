"""`--overfit_batches N`: can this model, loss and optimizer learn at all?

The run trains on the first N micro-batches of the training set (per process), the same ones every epoch, at
the configured peak learning rate held constant, with no evaluation and no checkpoints. A healthy setup drives
the loss near zero in a few dozen to a few hundred steps; one that cannot has a bug that more data will not fix
(a detached loss, labels that do not belong to their inputs, frozen layers, a learning rate off by orders of
magnitude) or regularisation that forbids memorising (dropout is fine; mixup and label smoothing are not).

The check passes when a logged loss falls to `TARGET` (5%) of the first one; the run then stops early. Its
verdict is printed and written to all_results.json and the report (`overfit_*` entries).
"""

from __future__ import annotations

import dataclasses
import math
import os

from torch.utils.data import DataLoader, Subset

from ..config import TrainConfig
from ..errors import ConfigError

TARGET = 0.05  # the loss must fall to 5% of its first logged value
DEFAULT_STEPS = 300  # when --max_steps is not given


def overfit_setup(config: TrainConfig, train_loader: DataLoader, accelerator=None) -> tuple[TrainConfig, DataLoader]:
    """The config and loader of an overfit run: the first N batches (per process), in a fixed order, trained
    at a constant learning rate, logged every step, with no evaluation and no checkpoints."""
    batch_size = getattr(train_loader, "batch_size", None)
    if batch_size is None:
        raise ConfigError("--overfit_batches needs a training loader with a batch_size (not a batch_sampler).")
    # The accelerator may not exist yet: the launcher's WORLD_SIZE is the number of processes that will run.
    processes = accelerator.num_processes if accelerator is not None else int(os.environ.get("WORLD_SIZE", "1"))
    samples = min(len(train_loader.dataset), config.overfit_batches * batch_size * processes)
    loader = DataLoader(Subset(train_loader.dataset, range(samples)), batch_size=batch_size, shuffle=False,
                        collate_fn=train_loader.collate_fn)
    overfit = dataclasses.replace(
        config, max_steps=config.max_steps if config.max_steps > 0 else DEFAULT_STEPS,
        lr_scheduler_type="constant", lr_scheduler_kwargs=None, warmup_steps=0, warmup_ratio=None,
        label_smoothing_factor=0.0, logging_strategy="steps", logging_steps=1, eval_strategy="no",
        save_strategy="no", load_best_model_at_end=False, early_stopping_patience=None, metric_for_best_model=None,
    )
    return overfit, loader


class OverfitCheck:
    """A hook: watches the logged loss, stops the run once it is at `TARGET` of the first one, and adds the
    verdict to the final metrics."""

    def __init__(self, config: TrainConfig, write=print):
        self.batches, self.write = config.overfit_batches, write
        self.first: float | None = None
        self.last: float | None = None
        self.steps = 0

    def passed(self) -> bool:
        return self.first is not None and self.last is not None and self.last <= TARGET * self.first

    def on_log(self, state, logs) -> bool:
        loss = logs.get("loss")
        if loss is None or not math.isfinite(loss):
            return False
        self.first = loss if self.first is None else self.first
        self.last, self.steps = loss, state.step
        return self.passed()

    def on_train_end(self, state, metrics) -> None:
        if self.first is None:
            return
        passed, share = self.passed(), self.last / self.first if self.first else math.nan
        metrics.update(overfit_initial_loss=self.first, overfit_final_loss=self.last, overfit_steps=self.steps,
                       overfit_passed=float(passed))
        what = f"{self.batches} fixed batch(es)"
        if passed:
            self.write(f"overfit check passed: the loss fell from {self.first:.4g} to {self.last:.4g} ({share:.1%}) in "
                       f"{self.steps} steps on {what}: the model, loss and optimizer can learn.")
        else:
            self.write(f"overfit check FAILED: after {self.steps} steps on {what} the loss is {self.last:.4g}, "
                       f"{share:.0%} of its first value {self.first:.4g} (target: {TARGET:.0%}). Suspects: a learning "
                       "rate far too low or too high (--learning_rate), a loss that does not depend on the model "
                       "output (detached tensors), labels that do not belong to their inputs, frozen layers, "
                       "regularisation that forbids memorising (mixup, heavy augmentation in the loss), too few "
                       "steps (--max_steps).")
