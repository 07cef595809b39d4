"""The loop's state and result: small dataclasses, saved with every checkpoint as JSON."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator


@dataclass
class TrainState:
    """Where the run is. Saved with every checkpoint (as JSON) and restored on resume."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # epoch in progress (0-based)
    batch_in_epoch: int = 0  # micro-batches consumed in this epoch, per process: the data position
    per_device_batch: int = 0  # the micro-batch size batch_in_epoch counts in (0: a checkpoint from before it was kept)
    # --max_tokens_per_batch and the accumulation it ran with ([] without): its plan is what batch_in_epoch counts in
    token_plan: list[int] = field(default_factory=list)
    data: list[int] = field(default_factory=list)  # the training set batch_in_epoch counts in (data.data_fingerprint)
    samples_seen: int = 0  # examples consumed, all processes
    samples_in_epoch: int = 0  # examples consumed in this epoch, all processes (what samples/s counts)
    train_seconds: float = 0.0  # training seconds of the logged intervals, evaluations and saves excluded
    loss_sum: float = 0.0  # sum over logged intervals of (mean loss x weight), for the run's train_loss
    loss_steps: float = 0  # the weights: an interval's steps (mean losses) or its items (sum losses)
    # The logging interval a checkpoint fell inside: each rank's unlogged loss figures (StepMeter.pending) and the
    # step of the last log, so that a resumed run logs that interval and its train_loss as an uninterrupted one.
    pending_loss: list[dict[str, Any]] = field(default_factory=list)
    last_log_step: int = 0
    # Saved True only in the checkpoint written because this step's evaluation failed (core/rescue.py): a run resumed
    # from it runs that evaluation before its first step, as the run that never failed did after this step.
    evaluation_pending: bool = False
    # Saved True only by a SIGTERM at a step where the run stopped (a hook's stop: early stopping, a pause): a run
    # resumed from it trains no step and finishes there, as the run that was not cut did; its finish sets it back.
    stopped: bool = False
    # [step, metrics, setup] of the last evaluation during training: the final evaluation reuses it at that step, also
    # in a run resumed from a checkpoint of the last step (its evaluation ran before the checkpoint: logged once, not
    # twice) where the evaluation it would run is the same (evaluation.evaluation_setup: processes, batch, examples)
    last_eval: list = field(default_factory=lambda: [-1, {}])
    skipped_steps: int = 0  # optimizer steps skipped by the fp16 loss scaler
    nonfinite_skips: int = 0  # steps skipped for a non-finite loss or gradient (--on_nonfinite skip)
    spike_skips: int = 0  # steps skipped for a loss spike (--on_spike skip)
    spike_losses: list[float] = field(default_factory=list)  # the spike guard's window: the last steps' losses
    spike_rollbacks: int = 0  # returns to the last checkpoint for a loss spike (--on_spike rollback)
    tracker_offset: int = 0  # steps those rollbacks abandoned: trackers get steps counted on past them (RunLog)
    # [epoch, micro-batch position in that epoch (per process)] of each batch a rollback took out of the data; the
    # loop passes over them, so the run goes on as if its data never held them.
    excluded_batches: list[list[int]] = field(default_factory=list)
    best_metric: float | None = None  # never NaN or inf: a non-finite evaluation is never the best
    best_metric_name: str | None = None  # the metric best_metric is a value of, and its direction: a resumed run
    best_greater: bool | None = None  # watching another metric (or direction) does not compare across them
    best_checkpoint: str | None = None
    world_size: int = 1
    global_batch_size: int = 0
    precision: str = ""  # the precision in effect (accelerator.precision_in_effect); "": a checkpoint from before
    hooks: dict[str, Any] = field(default_factory=dict)  # keyed by hooks.hook_keys: the hook's state_key or class
    hyperparameters: dict[str, Any] = field(default_factory=dict)  # what the optimizer and schedule were built with
    # The model FLOPs of a micro-batch, counted on the run's first one (meter.FlopCount): a resumed run takes them
    # from here rather than count again, because counting changes the numerics of the step it counts (torch's
    # FlopCounterMode dispatches attention differently, ~1e-8 in the gradients): a resume would not be bitwise.
    flop_count: dict[str, float | None] = field(default_factory=dict)

    def update_best(self, name: str, greater: bool, value: float) -> bool:
        """Record `value` of metric `name` if it is the best so far; a non-finite value never is."""
        if not math.isfinite(value):
            return False
        if self.best_metric is not None and not (value > self.best_metric if greater else value < self.best_metric):
            return False
        self.best_metric, self.best_metric_name, self.best_greater = value, name, greater
        return True

    @property
    def train_loss(self) -> float:
        return self.loss_sum / self.loss_steps if self.loss_steps else math.nan


@dataclass
class TrainResult:
    state: TrainState
    metrics: dict[str, float]
    model: torch.nn.Module  # the prepared model (use accelerator.unwrap_model for the bare one)
    accelerator: Accelerator
