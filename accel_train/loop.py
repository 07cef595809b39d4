"""The training loop: one explicit loop on Accelerate, the same on 1 CPU process or many GPUs.

A "step" is an optimizer step. Everything that varies with the hardware (device placement, DDP/FSDP/
DeepSpeed wrapping, mixed precision, gradient sync) is done by `accelerator.prepare`, `accumulate` and
`backward`; the loop itself has no `if distributed` branch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from accelerate import Accelerator

from . import checkpoint as ckpt
from .config import TrainConfig, save_config
from .errors import CheckpointError, ConfigError
from .hooks import EarlyStopping, call_hooks, hook_key
from .metrics import MetricsFn, as_loss_output, batch_size_of, evaluate_model
from .optim import StepPlan, build_optimizer, build_scheduler, current_lr, make_plan, steps_on_evaluation
from .runtime import build_accelerator, startup_report
from .tracking import RunLog, StepMeter

RUN_FILES = ("config.yaml", "metrics.jsonl", "all_results.json", "checkpoints", "runs")


@dataclass
class TrainState:
    """Where the run is. Saved with every checkpoint (as JSON) and restored on resume."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # epoch in progress (0-based)
    batch_in_epoch: int = 0  # micro-batches consumed in this epoch, per process
    samples_seen: int = 0  # samples consumed, all processes
    samples_in_epoch: int = 0  # samples consumed in this epoch, all processes
    loss_sum: float = 0.0  # sum over logged intervals of (mean loss x steps), for the run's train_loss
    loss_steps: int = 0
    skipped_steps: int = 0  # optimizer steps skipped by the fp16 loss scaler
    best_metric: Optional[float] = None
    best_checkpoint: Optional[str] = None
    world_size: int = 1
    global_batch_size: int = 0
    hooks: dict[str, Any] = field(default_factory=dict)

    @property
    def train_loss(self) -> float:
        return self.loss_sum / self.loss_steps if self.loss_steps else math.nan


@dataclass
class TrainResult:
    state: TrainState
    metrics: dict[str, float]
    model: torch.nn.Module  # the prepared model (use accelerator.unwrap_model for the bare one)
    accelerator: Accelerator


def default_loss(label_smoothing: float = 0.0) -> Callable:
    """Loss for models that take the batch as keyword arguments (transformers): the model's own loss, or
    cross-entropy with label smoothing on its logits."""

    def loss_fn(model, batch):
        labels = batch.get("labels")
        classification = labels is not None and not labels.is_floating_point() and labels.ndim == 1
        if label_smoothing and classification:
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
            per_sample = torch.nn.functional.cross_entropy(
                logits.float(), labels, label_smoothing=label_smoothing, reduction="none"
            )
            return {"loss": per_sample.mean(), "per_sample_loss": per_sample, "logits": logits}
        out = model(**batch)
        result = {"loss": out.loss, "logits": out.logits}
        if classification and out.logits.ndim == 2 and out.logits.shape[-1] > 1:
            result["per_sample_loss"] = torch.nn.functional.cross_entropy(
                out.logits.detach().float(), labels, reduction="none"
            )
        return result

    return loss_fn


def train(
    model: torch.nn.Module,
    train_loader: torch.utils.data.DataLoader,
    *,
    config: TrainConfig,
    loss_fn: Optional[Callable] = None,
    eval_loader: Optional[torch.utils.data.DataLoader] = None,
    metrics_fn: Optional[MetricsFn] = None,
    optimizer: Optional[torch.optim.Optimizer | Sequence] = None,
    scheduler: Any = None,
    hooks: Sequence[Any] = (),
    accelerator: Optional[Accelerator] = None,
    processing_class: Any = None,
    extra_configs: Sequence[Any] = (),
    final_eval_loaders: Optional[Mapping[str, torch.utils.data.DataLoader]] = None,
) -> TrainResult:
    """Train `model` on `train_loader` as `config` says; return the final state and metrics.

    model, loaders and optimizer are passed unprepared; `optimizer` may be an optimizer, a list of param
    groups, or None (AdamW/SGD per `config.optim`, no weight decay on biases and norms). `loss_fn(model,
    batch)` returns a scalar loss or a mapping with "loss" (plus tensors such as "logits" for metrics); it
    must return the mean over the micro-batch, *not* divided by the accumulation count.
    `metrics_fn(outputs)` receives the gathered evaluation outputs and returns named floats.
    `final_eval_loaders` ({"test": loader}) are evaluated once, after training, with their name as the metric
    prefix (test_loss, test_accuracy, ...); they run inside train() since the process group closes at its end.
    """
    accelerator = accelerator or build_accelerator(config)
    existing = check_output_dir(config, accelerator.process_index)
    loss_fn = loss_fn or default_loss(config.label_smoothing_factor)
    raw_optimizer = optimizer if isinstance(optimizer, torch.optim.Optimizer) else build_optimizer(model, config, optimizer)
    shapes = ckpt.parameter_shapes(model)
    model, optimizer, train_loader = accelerator.prepare(model, raw_optimizer, train_loader)
    eval_loader = accelerator.prepare(eval_loader) if eval_loader is not None else None
    plan = make_plan(config, len(train_loader), accelerator.num_processes)
    scheduler = accelerator.prepare(scheduler or build_scheduler(raw_optimizer, config, plan))
    hooks = list(hooks) + _builtin_hooks(config)
    state = TrainState(world_size=accelerator.num_processes, global_batch_size=plan.global_batch_size)
    if config.resume_from_checkpoint:
        state = resume(accelerator, config, plan, shapes, hooks)
    start_run_dir(accelerator, config, existing, extra_configs)  # only now, with every check passed, write
    run = Run(accelerator, config, plan, model, optimizer, scheduler, loss_fn, metrics_fn, eval_loader, hooks, shapes)
    run.last_save = run.last_log_step = state.step
    run.final_eval_loaders = {name: accelerator.prepare(dl) for name, dl in (final_eval_loaders or {}).items()}
    run.log = RunLog(accelerator, config.output_dir, plan.total_steps, state.step,
                     {**_merged(extra_configs), **config.to_dict()}, config.run_name or "accel_train",
                     disable_bar=config.disable_tqdm)
    run.log.write(startup_report(accelerator, config, plan, _num_samples(train_loader)))
    stop = call_hooks(hooks, "on_train_start", state)
    meter = StepMeter(accelerator)
    gas = config.gradient_accumulation_steps
    started = time.perf_counter()
    model.train()
    while state.step < plan.total_steps and not stop:
        _seed_epoch(train_loader, config, state.epoch)
        batches = accelerator.skip_first_batches(train_loader, state.batch_in_epoch) if state.batch_in_epoch else train_loader
        for batch, waited in _timed(batches):
            with accelerator.accumulate(model):
                loss = as_loss_output(loss_fn(model, batch))["loss"]
                # accelerator.backward divides by gas; the epoch's last window may be shorter: rescale it
                # so every step's gradient is the mean over the micro-batches it really had.
                accelerator.backward(loss * _window_scale(state.batch_in_epoch, plan.batches_per_epoch, gas))
            n = batch_size_of(batch)
            meter.add_micro_batch(loss, n, _real_tokens(batch), waited)
            state.batch_in_epoch += 1
            state.samples_in_epoch += n * accelerator.num_processes
            state.samples_seen += n * accelerator.num_processes
            if not accelerator.sync_gradients:
                continue
            if config.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm)
            optimizer.step()
            if accelerator.optimizer_step_was_skipped:
                state.skipped_steps += 1
            elif not steps_on_evaluation(scheduler):
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            epoch_end = state.batch_in_epoch == plan.batches_per_epoch
            if epoch_end:
                state.epoch, state.batch_in_epoch, state.samples_in_epoch = state.epoch + 1, 0, 0
            stop = run.after_step(state, meter, epoch_end)
            if stop or state.step >= plan.total_steps:
                break
    return run.finish(state, meter, time.perf_counter() - started, processing_class)


class Run:
    """What happens between optimizer steps: logging, evaluation, checkpoints, hooks, and the end."""

    def __init__(self, accelerator, config, plan, model, optimizer, scheduler, loss_fn, metrics_fn, eval_loader,
                 hooks, shapes):
        self.accelerator, self.config, self.plan = accelerator, config, plan
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.loss_fn, self.metrics_fn, self.eval_loader = loss_fn, metrics_fn, eval_loader
        self.hooks, self.shapes = hooks, shapes
        self.log: RunLog
        self.last_eval: tuple[int, dict[str, float]] = (-1, {})
        self.last_save = self.last_log_step = 0
        self.final_eval_loaders: dict[str, Any] = {}

    def due(self, strategy: str, every: int, step: int, epoch_end: bool) -> bool:
        return (strategy == "steps" and step % every == 0) or (strategy == "epoch" and epoch_end)

    def after_step(self, state: TrainState, meter: StepMeter, epoch_end: bool) -> bool:
        cfg, stop, acted = self.config, False, False
        self.log.advance()
        if self.due(cfg.logging_strategy, cfg.logging_steps, state.step, epoch_end):
            stop |= self.log_train(state, meter)
            acted = True
        improved = False
        if self.eval_loader is not None and self.due(cfg.eval_strategy, cfg.eval_steps or cfg.logging_steps,
                                                     state.step, epoch_end):
            metrics, improved = self.evaluate(state)
            stop |= call_hooks(self.hooks, "on_evaluate", state, metrics)
            acted = True
        if cfg.save_strategy != "no" and (improved or self.due(cfg.save_strategy, cfg.save_steps, state.step, epoch_end)):
            stop |= self.save(state, best=improved)
            acted = True
        if not acted:
            return False
        if stop:  # agreed across ranks, so that every process stops at the same step
            self.accelerator.set_trigger()
        return self.accelerator.check_trigger()

    def log_train(self, state: TrainState, meter: StepMeter) -> bool:
        record = meter.record()
        steps, self.last_log_step = state.step - self.last_log_step, state.step
        if steps and not math.isnan(record["loss"]):  # the run's train_loss weights intervals by their steps
            state.loss_sum += record["loss"] * steps
            state.loss_steps += steps
        record.update(learning_rate=current_lr(self.optimizer), epoch=self.epoch_float(state))
        if state.skipped_steps:
            record["skipped_steps"] = state.skipped_steps
        self.log.log(record, state.step)
        return call_hooks(self.hooks, "on_log", state, record)

    def epoch_float(self, state: TrainState) -> float:
        return round(state.epoch + state.batch_in_epoch / self.plan.batches_per_epoch, 4)

    def evaluate(self, state: TrainState) -> tuple[dict[str, float], bool]:
        metrics = evaluate_model(self.accelerator, self.model, self.eval_loader, self.loss_fn, self.metrics_fn)
        self.last_eval = (state.step, metrics)
        self.log.log({**metrics, "epoch": self.epoch_float(state)}, state.step)
        name = self.config.best_metric_name
        if steps_on_evaluation(self.scheduler):
            self.scheduler.step(metrics[self.config.monitored_metric])
        if name is None:
            return metrics, False
        if name not in metrics:
            raise ConfigError(f"--metric_for_best_model {name}: the evaluation returned only {sorted(metrics)}.")
        value, best = metrics[name], state.best_metric
        improved = best is None or (value > best if self.config.best_is_greater else value < best)
        if improved:
            state.best_metric = value
        return metrics, improved

    def save(self, state: TrainState, best: bool = False) -> bool:
        if self.last_save == state.step:
            if best:  # this step's checkpoint exists already; it is now the best one
                state.best_checkpoint = ckpt.checkpoint_name(state.step)
            return False
        if best:
            state.best_checkpoint = ckpt.checkpoint_name(state.step)
        state.hooks = {hook_key(h, i): h.state_dict() for i, h in enumerate(self.hooks) if hasattr(h, "state_dict")}
        path = ckpt.save_checkpoint(self.accelerator, self.config.output_dir, state.step,
                                    dataclasses.asdict(state), self.shapes)
        self.last_save = state.step
        if self.accelerator.is_main_process:
            ckpt.rotate_checkpoints(self.config.output_dir, self.config.save_total_limit, state.best_checkpoint)
        self.accelerator.wait_for_everyone()
        return call_hooks(self.hooks, "on_save", state, path)

    def finish(self, state: TrainState, meter: StepMeter, runtime: float, processing_class) -> TrainResult:
        acc, cfg = self.accelerator, self.config
        if meter.micro_batches and cfg.logging_strategy != "no":
            self.log_train(state, meter)
        if cfg.save_strategy != "no":
            self.save(state)
        if cfg.load_best_model_at_end and state.best_checkpoint:
            best = ckpt.checkpoints_dir(cfg.output_dir) / state.best_checkpoint
            acc.load_state(str(best))
            self.log.write(f"restored the best checkpoint {best} ({cfg.best_metric_name} = {state.best_metric:.6g})")
            self.last_eval = (-1, {})
        metrics: dict[str, float] = {}
        if self.eval_loader is not None:
            step, metrics = self.last_eval
            if step != state.step:
                metrics = evaluate_model(acc, self.model, self.eval_loader, self.loss_fn, self.metrics_fn)
        for name, loader in self.final_eval_loaders.items():
            metrics.update(evaluate_model(acc, self.model, loader, self.loss_fn, self.metrics_fn, prefix=name))
        metrics.update(
            train_loss=state.train_loss, train_runtime=round(runtime, 3), train_steps=state.step,
            train_samples_per_second=round(state.samples_seen / runtime, 3) if runtime else 0.0,
            epoch=self.epoch_float(state),
        )
        if state.skipped_steps:
            metrics["train_skipped_steps"] = state.skipped_steps
        call_hooks(self.hooks, "on_train_end", state, metrics)
        ckpt.export_model(acc, self.model, cfg.output_dir, processing_class)
        if acc.is_main_process:
            (Path(cfg.output_dir) / "all_results.json").write_text(json.dumps(metrics, indent=2))
            self.log.write("final metrics: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        self.log.close()
        return TrainResult(state=state, metrics=metrics, model=self.model, accelerator=acc)


def _seed_epoch(loader, config: TrainConfig, epoch: int) -> None:
    """Make the epoch's data order and worker seeds depend only on (seed, epoch), so a resumed run sees
    exactly the batches an uninterrupted one would. A DataLoader without its own generator draws its worker
    base seed from the global RNG at every `iter()`, which would shift dropout after a mid-epoch resume."""
    loader.set_epoch(epoch)
    seed = config.data_seed if config.data_seed is not None else config.seed
    loader.generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)


def _window_scale(batch_index: int, batches_per_epoch: int, gas: int) -> float:
    """gas / (micro-batches in this accumulation window): 1 except in a short last window of an epoch."""
    start = (batch_index // gas) * gas
    return gas / min(gas, batches_per_epoch - start)


def _timed(loader):
    """Yield (batch, seconds spent waiting for it): the data-stall share of each step."""
    iterator = iter(loader)
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(iterator)
        except StopIteration:
            return
        yield batch, time.perf_counter() - t0


def _real_tokens(batch: Any) -> int:
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    return int(mask.sum()) if isinstance(mask, torch.Tensor) else 0


def _num_samples(loader) -> Optional[int]:
    try:
        return len(loader.dataset)
    except (TypeError, AttributeError):
        return None


def _merged(configs: Sequence[Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for cfg in configs:
        merged.update(dataclasses.asdict(cfg))
    return merged


def _builtin_hooks(config: TrainConfig) -> list:
    if config.early_stopping_patience is None:
        return []
    return [EarlyStopping(config.best_metric_name, "max" if config.best_is_greater else "min",
                          config.early_stopping_patience, config.early_stopping_threshold)]


def check_output_dir(config: TrainConfig, rank: int) -> list[str]:
    """Refuse to mix two runs in one directory, or a directory that cannot be written. Writes nothing
    that could be mistaken for a run, so a refused start leaves the directory as it was. Every rank checks."""
    out = Path(config.output_dir)
    existing = [name for name in RUN_FILES if (out / name).exists()]
    if existing and not config.resume_from_checkpoint and not config.overwrite_output_dir:
        raise ConfigError(
            f"--output_dir {out} already holds a run ({', '.join(existing)}). Continue it with "
            "--resume_from_checkpoint latest, replace it with --overwrite_output_dir, or choose another --output_dir."
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{rank}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"--output_dir {out} is not writable ({err.strerror}). Choose another directory.") from None
    return existing


def start_run_dir(accelerator: Accelerator, config: TrainConfig, existing: list[str], extra_configs=()) -> None:
    """Clear a replaced run (--overwrite_output_dir) and write the resolved config."""
    out = Path(config.output_dir)
    if accelerator.is_main_process:
        if existing and config.overwrite_output_dir and not config.resume_from_checkpoint:
            for name in existing:
                target = out / name
                shutil.rmtree(target) if target.is_dir() else target.unlink()
        save_config([*extra_configs, config], out / "config.yaml")
    accelerator.wait_for_everyone()


def resume(accelerator: Accelerator, config: TrainConfig, plan: StepPlan, shapes: dict, hooks: list) -> TrainState:
    """Load a checkpoint and re-derive the data position from the samples consumed in the current epoch."""
    path = ckpt.resolve_checkpoint(config.output_dir, config.resume_from_checkpoint)
    manifest = ckpt.verify_checkpoint(path)
    ckpt.check_compatible(path, manifest, shapes)
    saved = ckpt.load_train_state(path)
    state = TrainState(**saved)
    if state.global_batch_size != plan.global_batch_size:
        raise CheckpointError(
            f"{path} was trained with a global batch of {state.global_batch_size} samples per step, this run has "
            f"{plan.global_batch_size} (per-device batch x processes x accumulation). The schedule and data "
            "position would not line up: keep the same global batch when resuming."
        )
    per_batch = config.per_device_train_batch_size * accelerator.num_processes
    if state.samples_in_epoch % per_batch:
        raise CheckpointError(
            f"{path}: {state.samples_in_epoch} samples of the epoch were consumed, which is not a whole number "
            f"of batches of {per_batch} for this world size; resume with the original world size."
        )
    accelerator.load_state(str(path))
    state.batch_in_epoch = state.samples_in_epoch // per_batch
    state.world_size = accelerator.num_processes
    for i, hook in enumerate(hooks):
        if hasattr(hook, "load_state_dict") and hook_key(hook, i) in state.hooks:
            hook.load_state_dict(state.hooks[hook_key(hook, i)])
    if manifest.get("world_size") != accelerator.num_processes:
        accelerator.print(
            f"note: {path} was written by {manifest.get('world_size')} process(es), resuming on "
            f"{accelerator.num_processes}; the data position is re-derived from the samples consumed. Random "
            "streams (dropout, augmentation) of processes the checkpoint did not have start afresh."
        )
    accelerator.print(f"resumed from {path} at step {state.step} (epoch {state.epoch}, batch {state.batch_in_epoch})")
    return state
