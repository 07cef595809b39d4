"""The training loop: one explicit loop on Accelerate, the same on 1 CPU process or many GPUs.

A "step" is an optimizer step. Everything that varies with the hardware (device placement, DDP/FSDP/
DeepSpeed wrapping, mixed precision, gradient sync) is done by `accelerator.prepare`, `accumulate` and
`backward`; the loop itself has no `if distributed` branch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from accelerate import Accelerator
from accelerate.state import GradientState
from accelerate.utils import GradientAccumulationPlugin

from . import checkpoint as ckpt
from .batch_size import find_micro_batch, with_micro_batch
from .config import TrainConfig
from .deploy import export_formats_at_end
from .diagnostics import StepGuard, fault_point, fetch_batch, locate_nonfinite, micro_batch_indices, write_report
from .errors import ConfigError, Preempted, TrainingDiverged
from .hooks import EarlyStopping, call_hooks, hook_key
from .metrics import MetricsFn, as_loss_output, batch_size_of, evaluate_model
from .optim import batches_per_process, build_optimizer, build_scheduler, current_lr, make_plan, steps_on_evaluation
from .rundir import check_output_dir, resume, start_run_dir
from .runtime import build_accelerator, startup_report
from .observe import Observer
from .overfit import overfit_setup
from .state import TrainResult, TrainState
from .tracking import RunLog, StepMeter, peak_memory


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
    end_training: bool = True,
) -> TrainResult:
    """Train `model` on `train_loader` as `config` says; return the final state and metrics.

    model, loaders and optimizer are passed unprepared; `optimizer` may be an optimizer, a list of param
    groups, or None (AdamW/SGD per `config.optim`, no weight decay on biases and norms). `loss_fn(model,
    batch)` returns a scalar loss or a mapping with "loss" (plus tensors such as "logits" for metrics); it
    must return the mean over the micro-batch, *not* divided by the accumulation count.
    `metrics_fn(outputs)` receives the gathered evaluation outputs and returns named floats.
    `final_eval_loaders` ({"test": loader}) are evaluated once, after training, with their name as the metric
    prefix (test_loss, test_accuracy, ...). `end_training=False` keeps the process group alive for other
    collective work after training (e.g. writing predictions); call `result.accelerator.end_training()` then.
    """
    if config.overfit_batches:  # debug mode (overfit.py): N fixed batches, repeated, until the loss is near zero
        config, train_loader = overfit_setup(config, train_loader, accelerator)
        eval_loader = final_eval_loaders = None
    run, state = _start(model, train_loader, config, loss_fn, eval_loader, metrics_fn, optimizer, scheduler,
                        hooks, accelerator, extra_configs, final_eval_loaders)
    accelerator, model, optimizer, scheduler, train_loader = (run.accelerator, run.model, run.optimizer,
                                                             run.scheduler, run.train_loader)
    config = run.config  # with --auto_find_batch_size: the micro-batch and accumulation actually used
    plan, gas, meter = run.plan, config.gradient_accumulation_steps, StepMeter(accelerator)
    stop, started = call_hooks(run.hooks, "on_train_start", state), time.perf_counter()
    model.train()
    with StepGuard(accelerator, check_gradients=accelerator.scaler is None) as guard, \
            run.observer.diagnose(state.step) as diag:  # diag: None unless a diagnostics flag is set
        while state.step < plan.total_steps and not stop:
            _seed_epoch(train_loader, config, state.epoch)
            batches = accelerator.skip_first_batches(train_loader, state.batch_in_epoch) if state.batch_in_epoch else train_loader
            for batch, waited in _timed(batches):
                with accelerator.accumulate(model), meter.flops.measure(batch_size_of(batch)):  # MFU: GPU, once
                    loss = as_loss_output(run.loss_fn(model, batch))["loss"]
                    # accelerator.backward divides by gas; the epoch's last window may be shorter: rescale it
                    # so every step's gradient is the mean over the micro-batches it really had.
                    accelerator.backward(loss * _window_scale(state.batch_in_epoch, plan.batches_per_epoch, gas))
                guard.watch(loss)
                n = batch_size_of(batch)
                meter.add_micro_batch(loss, n, _real_tokens(batch), waited)
                state.batch_in_epoch += 1
                state.samples_in_epoch += n * accelerator.num_processes
                state.samples_seen += n * accelerator.num_processes
                if not accelerator.sync_gradients:
                    continue
                if diag is not None:
                    diag.before_clip(state.step + 1)  # per-layer gradient norms, activation statistics
                # Clip (or, with max_grad_norm <= 0, only measure): the norm also reveals non-finite gradients.
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.max_grad_norm if config.max_grad_norm > 0 else math.inf)
                verdict = guard.verdict(grad_norm)  # agreed by every rank: non-finite values, SIGTERM
                if verdict.nonfinite:
                    run.on_nonfinite(state, verdict)  # stop: report and raise; skip: count it
                else:
                    optimizer.step()
                if accelerator.optimizer_step_was_skipped:
                    state.skipped_steps += 1  # the fp16 loss scaler skipped it (overflow)
                elif not steps_on_evaluation(scheduler):
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                state.step += 1
                if diag is not None:
                    diag.after_step(state.step)  # profiler step, memory snapshot
                fault_point("kill_after_step", state.step, accelerator.is_main_process)
                epoch_end = state.batch_in_epoch == plan.batches_per_epoch
                if epoch_end:
                    state.epoch, state.batch_in_epoch, state.samples_in_epoch = state.epoch + 1, 0, 0
                stop = run.after_step(state, meter, epoch_end, grad_norm)
                if verdict.preempt:
                    run.preempt(state)
                if stop or state.step >= plan.total_steps:
                    break
    return run.finish(state, meter, time.perf_counter() - started, processing_class, end_training)


def _start(model, train_loader, config, loss_fn, eval_loader, metrics_fn, optimizer, scheduler, hooks, accelerator,
           extra_configs, final_eval_loaders) -> tuple["Run", TrainState]:
    """Check, prepare, plan, resume; write the run directory only once every check has passed."""
    accelerator = accelerator or build_accelerator(config)
    existing = check_output_dir(config, accelerator.process_index)
    accelerator.wait_for_everyone()  # every rank has looked before the main process writes anything
    if not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = build_optimizer(model, config, optimizer, accelerator)
    loss_fn = loss_fn or default_loss(config.label_smoothing_factor)
    _enable_gradient_checkpointing(model, config)
    if config.auto_find_batch_size:
        micro = find_micro_batch(accelerator, model, train_loader, loss_fn, config, optimizer)
        if micro != config.per_device_train_batch_size:
            accelerator.print(f"auto batch size: micro-batch {config.per_device_train_batch_size} -> {micro}, "
                              "accumulation raised to keep the global batch and schedule")
            config, train_loader = with_micro_batch(config, train_loader, micro)
            GradientState(GradientAccumulationPlugin(num_steps=config.gradient_accumulation_steps))
    shapes = ckpt.parameter_shapes(model)
    plan = make_plan(config, batches_per_process(train_loader, accelerator.num_processes), accelerator.num_processes)
    scheduler = scheduler or build_scheduler(optimizer, config, plan, accelerator)
    # One prepare call: DeepSpeed needs the model, optimizer, scheduler and loader together.
    model, optimizer, train_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, scheduler)
    eval_loader = accelerator.prepare(eval_loader) if eval_loader is not None else None
    if len(train_loader) != plan.batches_per_epoch:
        raise RuntimeError(f"planned {plan.batches_per_epoch} batches per epoch, the prepared loader has {len(train_loader)}")
    hooks = list(hooks) + _builtin_hooks(config)
    state = TrainState(world_size=accelerator.num_processes, global_batch_size=plan.global_batch_size)
    # Observability (observe.py): the pre-flight check refuses a broken run here, before anything is written;
    # the observer is a built-in hook (run facts at start, report at the end) and wraps metrics_fn.
    observer = Observer.start(accelerator, config, plan, model, optimizer, scheduler, train_loader, eval_loader,
                              loss_fn, metrics_fn)
    hooks, metrics_fn = hooks + [observer], observer.metrics_fn
    if config.resume_from_checkpoint:
        state = resume(accelerator, config, plan, shapes, hooks)
    start_run_dir(accelerator, config, existing, extra_configs)
    run = Run(accelerator, config, plan, model, optimizer, scheduler, loss_fn, metrics_fn, train_loader, eval_loader,
              hooks, shapes)
    run.last_save = run.last_log_step = state.step
    run.observer = observer
    run.start_samples = state.samples_seen  # throughput counts this session's samples, not a resumed run's
    run.final_eval_loaders = {name: accelerator.prepare(dl) for name, dl in (final_eval_loaders or {}).items()}
    run.log = RunLog(accelerator, config.output_dir, plan.total_steps, state.step,
                     {**_merged(extra_configs), **config.to_dict()}, config.run_name or "accel_train",
                     disable_bar=config.disable_tqdm)
    run.log.write(startup_report(accelerator, config, plan, _num_samples(train_loader)))
    return run, state


class Run:
    """What happens between optimizer steps: logging, evaluation, checkpoints, hooks, and the end."""

    def __init__(self, accelerator, config, plan, model, optimizer, scheduler, loss_fn, metrics_fn, train_loader,
                 eval_loader, hooks, shapes):
        self.accelerator, self.config, self.plan = accelerator, config, plan
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.loss_fn, self.metrics_fn = loss_fn, metrics_fn
        self.train_loader, self.eval_loader = train_loader, eval_loader
        self.hooks, self.shapes = hooks, shapes
        self.log: RunLog
        self.last_eval: tuple[int, dict[str, float]] = (-1, {})
        self.last_save = self.last_log_step = self.start_samples = 0
        self.final_eval_loaders: dict[str, Any] = {}

    def due(self, strategy: str, every: int, step: int, epoch_end: bool) -> bool:
        return (strategy == "steps" and step % every == 0) or (strategy == "epoch" and epoch_end)

    def after_step(self, state: TrainState, meter: StepMeter, epoch_end: bool, grad_norm=None) -> bool:
        cfg, stop, acted = self.config, False, False
        self.log.advance()
        if self.due(cfg.logging_strategy, cfg.logging_steps, state.step, epoch_end):
            stop |= self.log_train(state, meter, grad_norm)
            acted = True
        improved, started = False, time.perf_counter()
        if self.eval_loader is not None and self.due(cfg.eval_strategy, cfg.eval_steps or cfg.logging_steps,
                                                     state.step, epoch_end):
            metrics, improved = self.evaluate(state)
            stop |= call_hooks(self.hooks, "on_evaluate", state, metrics)
            acted = True
        if cfg.save_strategy != "no" and (improved or self.due(cfg.save_strategy, cfg.save_steps, state.step, epoch_end)):
            stop |= self.save(state, best=improved)
            acted = True
        meter.pause(time.perf_counter() - started)
        if not acted:
            return False
        if stop:  # agreed across ranks, so that every process stops at the same step
            self.accelerator.set_trigger()
        return self.accelerator.check_trigger()

    def log_train(self, state: TrainState, meter: StepMeter, grad_norm=None) -> bool:
        record = meter.record()
        if grad_norm is not None:
            record["grad_norm"] = float(grad_norm)
        steps, self.last_log_step = state.step - self.last_log_step, state.step
        if steps and not math.isnan(record["loss"]):  # the run's train_loss weights intervals by their steps
            state.loss_sum += record["loss"] * steps
            state.loss_steps += steps
        record.update(learning_rate=current_lr(self.optimizer), epoch=self.epoch_float(state))
        if state.skipped_steps:
            record["skipped_steps"] = state.skipped_steps
        if state.nonfinite_skips:
            record["nonfinite_skips"] = state.nonfinite_skips
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

    def on_nonfinite(self, state: TrainState, verdict) -> None:
        """--on_nonfinite skip: count and log the step (its gradients are dropped); stop after the limit.
        --on_nonfinite stop, or the limit reached: write a report that locates the first non-finite module,
        keep the last good checkpoint, and raise TrainingDiverged."""
        step, cfg = state.step + 1, self.config
        what = "loss" if verdict.nonfinite_loss else "gradient"
        if cfg.on_nonfinite == "skip" and state.nonfinite_skips < cfg.max_nonfinite_skips:
            state.nonfinite_skips += 1
            self.log.log({"nonfinite_skipped_step": step, "nonfinite": what, "nonfinite_skips": state.nonfinite_skips}, step)
            self.log.write(f"step {step}: non-finite {what}, step skipped ({state.nonfinite_skips}/{cfg.max_nonfinite_skips})")
            return
        report = self.diagnose_nonfinite(state, verdict)
        latest = ckpt.list_checkpoints(cfg.output_dir)
        raise TrainingDiverged(
            f"non-finite {what} at step {step} (epoch {state.epoch}); first non-finite output: "
            f"{report.get('first_nonfinite_output')}, gradient: {report.get('first_nonfinite_gradient')}. "
            f"Report: {report['path']}. The last good checkpoint is "
            f"{latest[-1] if latest else 'none (no checkpoint was saved yet)'}. Lower --learning_rate, check the "
            "data at the reported sample indices, or use --on_nonfinite skip."
            + (f" ({state.nonfinite_skips} steps were skipped before)" if state.nonfinite_skips else "")
        )

    def diagnose_nonfinite(self, state: TrainState, verdict) -> dict:
        acc, gas = self.accelerator, self.config.gradient_accumulation_steps
        last = state.batch_in_epoch - 1  # the window's micro-batches: last - (len-1) .. last
        window = list(range(last - (last % gas), last + 1))
        positions = verdict.bad_micro_batches or [len(window) - 1]
        report: dict[str, Any] = {"step": state.step + 1, "epoch": state.epoch, "rank": acc.process_index,
                                  "nonfinite_loss": verdict.nonfinite_loss, "nonfinite_gradient": verdict.nonfinite_grad,
                                  "micro_batches": []}
        for pos in positions:
            indices = micro_batch_indices(self.train_loader, window[min(pos, len(window) - 1)])
            entry: dict[str, Any] = {"sample_indices": indices}
            if indices is not None and acc.distributed_type.value in ("NO", "MULTI_CPU", "MULTI_GPU"):
                entry.update(locate_nonfinite(acc, self.model, fetch_batch(self.train_loader, indices), self.loss_fn))
            report["micro_batches"].append(entry)
        first = report["micro_batches"][0] if report["micro_batches"] else {}
        report["first_nonfinite_output"] = first.get("first_nonfinite_output")
        report["first_nonfinite_gradient"] = first.get("first_nonfinite_gradient")
        path = Path(self.config.output_dir) / f"nonfinite_step{state.step + 1}_rank{acc.process_index}.json"
        write_report(path, report)
        report["path"] = str(path)
        return report

    def preempt(self, state: TrainState) -> None:
        """SIGTERM: save a checkpoint at this step boundary and stop on purpose (every rank agreed)."""
        path = ckpt.checkpoints_dir(self.config.output_dir) / ckpt.checkpoint_name(state.step)
        self.save(state)
        self.log.close()
        raise Preempted(f"SIGTERM received: stopped at step {state.step} after saving {path}. "
                        "Resume with --resume_from_checkpoint latest.")

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

    def finish(self, state: TrainState, meter: StepMeter, runtime: float, processing_class,
               end_training: bool = True) -> TrainResult:
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
            train_samples_per_second=round((state.samples_seen - self.start_samples) / runtime, 3) if runtime else 0.0,
            epoch=self.epoch_float(state),
        )
        metrics.update({f"train_{k}": v for k, v in peak_memory(acc.device).items()})
        if state.skipped_steps:
            metrics["train_skipped_steps"] = state.skipped_steps
        if state.nonfinite_skips:
            metrics["train_nonfinite_skips"] = state.nonfinite_skips
        call_hooks(self.hooks, "on_train_end", state, metrics)
        ckpt.export_model(acc, self.model, cfg.output_dir, processing_class)
        if acc.is_main_process:
            (Path(cfg.output_dir) / "all_results.json").write_text(json.dumps(metrics, indent=2))
            self.log.write("final metrics: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
        if cfg.export_formats:  # last: a failed export leaves the weights and results saved
            export_formats_at_end(acc, self.model, cfg.output_dir, cfg.export_formats, processing_class, self.eval_loader)
        self.log.close(end_training)
        return TrainResult(state=state, metrics=metrics, model=self.model, accelerator=acc)


def _enable_gradient_checkpointing(model: torch.nn.Module, config: TrainConfig) -> None:
    if not config.gradient_checkpointing:
        return
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ConfigError("--gradient_checkpointing: this model has no gradient_checkpointing_enable() (transformers "
                          "models do); wrap its blocks with torch.utils.checkpoint.checkpoint instead.")
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _seed_epoch(loader, config: TrainConfig, epoch: int) -> None:
    """Make the epoch's data order and worker seeds depend only on (seed, epoch), so a resumed run sees
    exactly the batches an uninterrupted one would. A DataLoader without its own generator draws its worker
    base seed from the global RNG at every `iter()`, which would shift dropout after a mid-epoch resume."""
    loader.set_epoch(epoch)
    seed = config.data_seed if config.data_seed is not None else config.seed
    # On Accelerate's prepared loader, an attribute set lands on the wrapper; the DataLoader that draws the
    # base seed is the wrapped one.
    getattr(loader, "base_dataloader", loader).generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)


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


def _real_tokens(batch: Any):
    """Non-pad tokens in the batch, left on the device (no sync) until the meter reports."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    return mask.sum() if isinstance(mask, torch.Tensor) else 0


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
