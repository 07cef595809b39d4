"""One run: its prepared objects, and what happens around the step loop — start (or resume), log, evaluate, save,
finish.

    session = Session(RunSpec(model, train_loader, config, ...))   checks, prepares, plans; writes nothing
    state = session.start(hooks)                                    resume or fresh; run dir, log, start-up report
    ... the step loop (loop.py) calls session.after_step(...) after every optimizer step ...
    result = session.finish(state, meter, runtime)                        final evaluation, results, export

A Session is complete when its constructor returns: everything a run needs is prepared by Accelerate and
planned in optimizer steps before anything is written, so a refused start leaves output_dir as it was.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs, broadcast_object_list, gather_object

from ..config import TrainConfig
from ..errors import ConfigError, FinishError, MetricsError
from ..rundir import checkpoint as ckpt
from ..rundir.async_checkpoint import CheckpointWriter, refuse_async
from ..rundir.final_model import final_model_names, save_final_model
from ..rundir.layout import RESULTS, checkpoint_name, checkpoints_dir
from ..rundir.metrics_log import RunLog, json_safe
from ..rundir.outdir import check_output_dir, resume_target, start_run_dir
from ..rundir.run_files import end_attempt
from ..testing import faults
from .accelerator import build_accelerator, startup_report
from .batch_size import enable_gradient_checkpointing, fit_micro_batch
from .control import attach_hooks, settle
from .data import dataset_size
from .ema import evaluate_with_average, weight_average
from .evaluation import MetricsFn, evaluation_setup, prepare_for_evaluation
from .guard import Rollback, refuse_rollback_on_a_stream
from .hooks import call_hooks, ended, hook_states
from .hyperparameters import group_peaks
from .loss import check_loss, default_loss, evaluation_loss, loss_hooks
from .meter import StepMeter
from .objects import check_interval, loader_notes, report_lines, split_schedulers, take_schedules, what_ran
from .optim import batches_per_process, build_optimizer, current_lr, make_plan, run_schedule, steps_on_evaluation
from .rescue import FinishGuard
from .restore import exclusions_after, fresh_state, load_saved_state, restore_in_place, resume, session_hyperparameters
from .results import failure_message, final_evaluation, short, training_figures
from .sharded import check_engine, engine_notes, prepare_engine, refuse_sum_loss
from .state import TrainResult, TrainState
from .stream import StreamPosition, end_loader_workers, stateful_loaders
from .token_batches import check_token_loader


@dataclass(frozen=True)
class RunSpec:
    """What `train()` was given: the run's model, loaders, functions and settings, none of them prepared yet."""

    model: torch.nn.Module
    train_loader: Any
    config: TrainConfig
    loss_fn: Callable | None = None
    eval_loader: Any = None
    metrics_fn: MetricsFn | None = None
    optimizer: Any = None  # an optimizer, param groups, or None (built from the config)
    scheduler: Any = None
    hooks: Sequence[Any] = ()
    accelerator: Accelerator | None = None
    processing_class: Any = None  # saved beside the final model (a tokenizer, an image processor)
    extra_configs: Sequence[Any] = ()  # a recipe's own argument dataclasses, saved in config.yaml
    final_eval_loaders: Mapping[str, Any] | None = None  # {"test": loader}: evaluated once, after training


class Session:
    """The prepared objects of one run and the work between optimizer steps. See the module docstring."""

    def __init__(self, spec: RunSpec):
        config = spec.config
        acc = spec.accelerator or build_accelerator(config)
        if spec.accelerator is not None:
            check_engine(acc)
        # files no run wrote that the final model would write over are refused here (a base model's config.json)
        check_output_dir(config, acc.process_index, lambda: final_model_names(spec.model, spec.processing_class))
        acc.wait_for_everyone()  # every rank has looked before the main process writes anything
        model, optimizer, train_loader = spec.model, spec.optimizer, spec.train_loader
        check_interval(config, spec.scheduler is not None)
        config = check_token_loader(train_loader, config, acc.num_processes)  # a budget sampler of one's own; auto
        self.own_optimizer = isinstance(optimizer, torch.optim.Optimizer)  # else built (from groups or the config)
        optimizer = optimizer if self.own_optimizer else build_optimizer(model, config, optimizer, acc)
        loss_fn = spec.loss_fn or default_loss(config.label_smoothing_factor)
        check_loss(loss_fn, config)  # accumulation, label smoothing: what the loss declares it cannot do
        if getattr(loss_fn, "leaves_parameters_unused", False):  # some steps give trainable parameters no gradient
            acc.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=True)
        enable_gradient_checkpointing(model, config)
        if config.auto_find_batch_size:  # the micro-batch and accumulation actually used
            config, train_loader = fit_micro_batch(acc, model, train_loader, loss_fn, config, optimizer)
        self.shapes = ckpt.parameter_shapes(model)
        plan = make_plan(config, batches_per_process(train_loader, acc.num_processes), acc.num_processes)
        prepare_engine(acc, model, config, plan)  # FSDP2's wrap, DeepSpeed's "auto" values: before prepare
        own, plateau = split_schedulers(spec.scheduler, optimizer, self.own_optimizer)  # a clock one, a plateau or not
        scheduler = run_schedule(optimizer, config, plan, own, acc)
        refuse_rollback_on_a_stream(config, train_loader)
        self.stream = StreamPosition.of(train_loader, config, acc.num_processes)  # None: a stream it cannot save
        # One prepare call: DeepSpeed needs the model, optimizer, scheduler and loader together.
        notes = loader_notes(spec.train_loader, config, acc)  # before prepare, which replaces a RandomSampler in it
        with stateful_loaders(acc, self.stream is not None):
            model, optimizer, train_loader, scheduler, *plateau = acc.prepare(model, optimizer, train_loader, scheduler,
                                                                              *plateau)
        take_schedules(acc, scheduler, config)  # once per optimizer step; one of yours checkpointed, or refused
        if plan.batches_per_epoch is not None and len(train_loader) != plan.batches_per_epoch:
            raise RuntimeError(f"planned {plan.batches_per_epoch} batches per epoch, the prepared loader has "
                               f"{len(train_loader)}")
        refuse_sum_loss(acc, model, loss_fn, train_loader)  # DeepSpeed: it calls the prepared engine once
        self.accelerator, self.config, self.plan = acc, config, plan
        self.average = weight_average(acc, model, config)  # --ema_decay: None without it
        self.group_peaks = group_peaks(optimizer)  # each param group's peak rate and decay, compared on resume
        self.model, self.optimizer, self.scheduler, self.train_loader = model, optimizer, scheduler, train_loader
        self.plateau = plateau[0] if plateau else None  # a ReduceLROnPlateau passed beside a clock schedule
        if self.stream is not None:
            self.stream.attach(train_loader, acc.process_index)
        self.position_restored = False  # resume() sets it when the stream's loader starts at its saved position
        self.scheduler_built_here = spec.scheduler is None  # the pre-flight's advice depends on it
        self._prepare_evaluation(spec, loss_fn)
        self.processing_class, self.extra_configs = spec.processing_class, tuple(spec.extra_configs)
        self.hooks: list[Any] = []  # attached by start(), once the run has been checked
        self.control: Any = None  # start(): what the hooks may steer (control.RunControl)
        self.resume_path: Path | None = None  # the checkpoint start() resumed from
        self.log = RunLog(acc, config.output_dir, plan.total_steps, config.run_name or "accel_train",
                          disable_bar=config.disable_tqdm)
        # Bookkeeping between steps; start() sets it from the state it starts at.
        self.last_save = self.last_log_step = self.start_samples = 0
        self.verified: set[str] = set()  # checkpoints known to match their manifest (written or checked here)
        self.writer = CheckpointWriter(acc, config.async_save, model, spec.processing_class, self.stream, self.average)
        self.notes: list[str] = engine_notes(acc) + notes  # what the start-up report must add to the plan
        self.unlogged: dict[str, float] = {}  # the final evaluation's numbers, until finish() logs them
        self.throughput: list[tuple[float, float]] = []  # (model FLOP/s, MFU) of each logged interval

    def _prepare_evaluation(self, spec: RunSpec, loss_fn: Callable) -> None:
        """The evaluation loaders (prepared) and the functions an evaluation calls."""
        acc = self.accelerator
        self.eval_loader = prepare_for_evaluation(acc, spec.eval_loader, self.config.seed)  # refused where not sharded
        if any(steps_on_evaluation(s) for s in (self.scheduler, self.plateau)) and (
                self.eval_loader is None or self.config.eval_strategy == "no"):
            raise ConfigError("--lr_scheduler_type reduce_on_plateau changes the learning rate on evaluations, and "
                              "this run has none: the rate would never change. Give an evaluation loader and "
                              "--eval_strategy steps or epoch, or choose another schedule.")
        finals = spec.final_eval_loaders or {}
        self.final_eval_loaders = {name: prepare_for_evaluation(acc, loader, self.config.seed)
                                   for name, loader in finals.items()}
        self.loss_fn, self.metrics_fn = loss_fn, spec.metrics_fn
        # the metrics object the recipe passed (train() wraps it to keep confusion matrices): its declared hooks
        self.declared_metrics = getattr(spec.metrics_fn, "metrics_fn", spec.metrics_fn)
        self.eval_loss_fn = evaluation_loss(loss_fn)  # without training-only terms (label smoothing, mixup)

    # --------------------------------------------------------------------------------------------- start
    def start(self, hooks: Sequence[Any]) -> TrainState:
        """Attach the hooks, resume (with --resume_from_checkpoint; checkpointed hook state is restored) or start
        fresh, write the run directory and open the log. Call it once the run has been checked: it is the first
        thing that writes."""
        acc = self.accelerator
        declared = [h for h in loss_hooks(self.loss_fn, self.declared_metrics) if not any(h is g for g in hooks)]
        self.hooks = [*declared, *hooks]  # a loss's clock first: it must know the step before other hooks act
        self.control = attach_hooks(self)  # attach(run) before a resume's load_state_dict: hooks may build there
        if self.config.async_save:  # again: a hook may have registered a save_state pre-hook as it attached
            refuse_async(acc)
        self.resume_path = resume_target(acc, self.config, self.extra_configs)  # None: a fresh start
        if self.resume_path:
            resumed = resume(self)
            state, self.position_restored = resumed.state, resumed.position_restored
            self.notes += resumed.notes
            self.verified.add(self.resume_path.name)
        else:
            state = fresh_state(self)
        ran = what_ran(self.optimizer, self.scheduler, self.config, self.own_optimizer, not self.scheduler_built_here,
                       self.plateau)
        self.notes += start_run_dir(acc, self.config, self.extra_configs, state.step if self.resume_path else None,
                                    record=ran)
        self.last_save, self.last_log_step = state.step, state.last_log_step if state.pending_loss else state.step
        self.start_samples = state.samples_seen  # throughput counts this session's samples, not a resumed run's
        state.hyperparameters = session_hyperparameters(self)
        hparams = {k: v for cfg in self.extra_configs for k, v in dataclasses.asdict(cfg).items()}
        schedule, objects = report_lines(ran, self.config, self.plan.warmup_steps, self.plan.lr_scale)
        report = startup_report(acc, self.config, self.plan, dataset_size(self.train_loader), schedule, objects)
        self.log.open(state.step, {**hparams, **self.config.to_dict()},
                      "\n".join([report, *(f"  note             {note}" for note in self.notes)]), state.tracker_offset,
                      state.evaluation_pending, bool(state.pending_loss))  # what this run logs again at its step
        return state

    # --------------------------------------------------------------------------------------- between steps
    def after_step(self, state: TrainState, meter: StepMeter, epoch_end: bool, grad_norm=None, preempt=False) -> bool:
        """Log, evaluate, save and call the hooks at their intervals, then what the hooks asked (control.py); True
        when the run should stop (agreed by every rank). `preempt` (SIGTERM, agreed): an evaluation due or asked here
        is saved as pending (rescue.pending_evaluation: the resumed run's first work), the checkpoint written first."""
        faults.kill_point("kill_after_step", state.step, self.accelerator.is_main_process)
        faults.signal_point(state.step)
        faults.peer_fault_point(state.step, self.accelerator.process_index)
        state.flop_count = meter.flops.counts()  # saved with the checkpoints: a resumed run does not count again
        if self.average is not None:
            self.average.update()
        cfg, stop, acted, improved = self.config, False, False, False
        self.log.advance()
        if _due(cfg.logging_strategy, cfg.logging_steps, state.step, epoch_end):
            stop |= self.log_train(state, meter, grad_norm)
            acted = True
        meter.hold()  # from here: evaluating and saving, not training time
        due = self.eval_loader is not None and _due(cfg.eval_strategy, cfg.eval_steps or cfg.logging_steps,
                                                    state.step, epoch_end)
        state.evaluation_pending = due and preempt
        if due and not preempt:
            metrics, improved = self.evaluate(state)
            stop |= call_hooks(self.hooks, "on_evaluate", state, metrics)
            acted = True
        if cfg.save_strategy != "no" and (improved or _due(cfg.save_strategy, cfg.save_steps, state.step, epoch_end)):
            self.keep_interval(state, meter)
            stop |= self.save(state, best=improved, wait=False)
            acted = True
        meter.release()
        return settle(self, state, meter, stop, acted, preempt)  # the ranks' requests agreed, the asked work done

    def log_train(self, state: TrainState, meter: StepMeter, grad_norm=None, write: bool = True) -> bool:
        kept = state.step - self.last_log_step - meter.dropped  # a dropped step's losses left the interval's mean
        record = meter.record(state)
        if "mfu" in record:
            self.throughput.append((record["model_tflops"], record["mfu"]))
        meter.flops.say_stale(self.log.write)  # a model ran faster than the peak: why no MFU is published, once
        if grad_norm is not None:
            record["grad_norm"] = float(grad_norm)
        self.last_log_step = state.step
        weight = record.get("num_items", kept)  # train_loss weighs intervals by kept steps (means) or items (sums)
        if weight and not math.isnan(record["loss"]):
            state.loss_sum += record["loss"] * weight
            state.loss_steps += weight
        record.update(learning_rate=current_lr(self.optimizer), epoch=self.epoch_float(state))
        if state.skipped_steps:
            record["skipped_steps"] = state.skipped_steps
        if state.nonfinite_skips:
            record["nonfinite_skips"] = state.nonfinite_skips
        if not write:  # --logging_strategy no: measured for train_loss and the MFU, not logged
            return False
        self.log.log(record, state.step)
        return call_hooks(self.hooks, "on_log", state, record)

    def epoch_float(self, state: TrainState) -> float:
        if self.plan.batches_per_epoch is None:  # a stream: epochs are counted as they end
            return float(state.epoch)
        return round(state.epoch + state.batch_in_epoch / self.plan.batches_per_epoch, 4)

    def evaluate(self, state: TrainState) -> tuple[dict[str, float], bool]:
        """Evaluate on the evaluation loader, log it, step a plateau schedule; (metrics, is it the best so far)."""
        metrics = evaluate_with_average(self.accelerator, self.model, self.eval_loader, self.eval_loss_fn,
                                        self.metrics_fn, self.average)
        name = self.config.best_metric_name
        plateau = [schedule for schedule in (self.scheduler, self.plateau) if steps_on_evaluation(schedule)]
        for watched in {name, self.config.monitored_metric if plateau else None} - {None} - set(metrics):
            # a MetricsError, before the record is logged: the loop saves this step's training state before it stops
            # and the resumed run evaluates it again (core/rescue.py), logging it once
            raise MetricsError(f"--metric_for_best_model {watched}: the evaluation returned only {sorted(metrics)} "
                               "(best model, early stopping and a plateau schedule watch it). Set "
                               "--metric_for_best_model to one of them, or return it from the metrics function.")
        state.last_eval = [state.step, dict(metrics), evaluation_setup(self.accelerator, self.eval_loader)]  # saved
        self.log.log({**metrics, "epoch": self.epoch_float(state)}, state.step)
        for schedule in plateau:
            schedule.step(metrics[self.config.monitored_metric])
        return metrics, name is not None and state.update_best(name, self.config.best_is_greater, float(metrics[name]))

    def save(self, state: TrainState, best: bool = False, wait: bool = True) -> bool:
        """Checkpoint this step (collective), rotate old checkpoints, call on_save; True if a hook asks to stop.
        With --async_save and wait=False (the interval's saves) the write goes on in the background
        (rundir/async_checkpoint.py): it is rotated and reaches on_save when the next save settles it."""
        stop = self.settle_writes(state)  # one write at a time, rotated (keeping the best so far) when it landed
        if best:  # this step's checkpoint (perhaps written already) is the best one
            state.best_checkpoint = checkpoint_name(state.step)
        if self.last_save != state.step:
            state.hooks = hook_states(self.hooks)
            self.writer.write(self.config.output_dir, state.step, state, self.shapes)
            self.last_save = state.step
        return (self.settle_writes(state) if wait or not self.writer.asynchronous else False) or stop

    def settle_writes(self, state: TrainState) -> bool:
        """The checkpoints that landed since the last call: known good, the old ones rotated, on_save called with
        the state each was written from; True if a hook asks to stop."""
        stop = False
        for path, saved in self.writer.settle():
            self.verified.add(path.name)
            if self.accelerator.is_main_process:
                ckpt.rotate_checkpoints(self.config.output_dir, self.config.save_total_limit,  # the bests it names
                                        {state.best_checkpoint, saved.best_checkpoint}, self.verified)
            self.accelerator.wait_for_everyone()
            stop = call_hooks(self.hooks, "on_save", saved, path) or stop
        return stop

    def roll_back(self, state: TrainState, rollback: Rollback) -> None:
        """--on_spike rollback: back to its checkpoint (in `state` itself), the spiked step's micro-batches taken out
        of the data; the intervals and the next checkpoint count from there, and the history goes on from its step
        with the rollback marked (RunLog.rewind). The training clock goes on: the dropped steps' seconds were spent."""
        excluded, rollbacks = exclusions_after(state, self.config), state.spike_rollbacks + 1
        seconds = state.train_seconds
        if rollback.checkpoint.name not in self.verified:
            ckpt.verify_checkpoint(rollback.checkpoint)
            self.verified.add(rollback.checkpoint.name)
        restore_in_place(self, state, rollback.checkpoint)
        self.control.forget()  # requests made during the dropped step go with it
        state.excluded_batches, state.spike_rollbacks, state.train_seconds = excluded, rollbacks, seconds
        self.last_save, self.last_log_step = state.step, state.last_log_step if state.pending_loss else state.step
        state.tracker_offset = self.log.rewind(state.step, rollback.record)

    def keep_interval(self, state: TrainState, meter: StepMeter) -> None:
        """Before a checkpoint: the logging interval in progress goes into the state (collective)."""
        pending = meter.pending()
        parts = gather_object([pending]) if self.accelerator.num_processes > 1 else [pending]
        # a step since the last log: kept (its micro-batches) or skipped (its losses left the interval, not its seconds)
        state.pending_loss = parts if any(p["micro_batches"] or p["dropped"] for p in parts) else []
        state.last_log_step = self.last_log_step

    # ---------------------------------------------------------------------------------------------- finish
    def finish(self, state: TrainState, meter: StepMeter, runtime: float, end_training: bool = True,
               guard: FinishGuard | None = None) -> TrainResult:
        """The last log and checkpoint, the best checkpoint restored if asked, the final evaluation, and the final
        model written (weights, config, tokenizer); then the finish seam: every hook's on_finish(session, metrics)
        (a recipe's generation, predictions and test metrics), on_train_end (the report) and all_results.json,
        written once. The model is written before the seam, so that an error there loses nothing trained:
        all_results.json then holds what was measured, and a FinishError says where everything is. `guard`, entered
        around the call: a SIGTERM until the final model is written saves the last step and stops (rescue.py)."""
        acc, cfg = self.accelerator, self.config
        guard = guard or FinishGuard(self, state, meter)  # not entered: no handler, the agreements still collective
        if self.last_log_step != state.step:  # agreed: after a resume on another world size the main holds it all
            self.log_train(state, meter, write=cfg.logging_strategy != "no")
        if cfg.save_strategy != "no":
            self.keep_interval(state, meter)
            self.save(state)
        self.settle_writes(state)  # a background write a hook's request_save started (--save_strategy no too)
        guard.agree()  # before the best restore and the final evaluation
        if cfg.load_best_model_at_end and state.best_checkpoint:
            best = checkpoints_dir(cfg.output_dir) / state.best_checkpoint
            load_saved_state(self, best)
            self.log.write(f"restored the best checkpoint {best} ({cfg.best_metric_name} = {state.best_metric:.6g})")
            state.last_eval = [-1, {}]
        faults.finish_signal_point("evaluation")
        metrics, self.unlogged = final_evaluation(self, state)  # finish() logs what no evaluation logged yet
        guard.agree()  # after it (and the test splits), before the final model is written
        metrics.update(training_figures(self, state, meter, runtime))
        if cfg.save_ema_as_final:  # the average is the final model, and the finish seam runs on it
            self.average.copy_into_model()
            self.log.write(f"--save_ema_as_final: the final model is the weight average (decay {cfg.ema_decay})")
        save_final_model(acc, self.model, cfg.output_dir, self.processing_class)  # before the seam: never lost to it
        faults.finish_signal_point("seam")  # from here a SIGTERM is held: no agreement follows
        before = dict(metrics)
        self.run_finish_seam(state, metrics, before)
        # metrics.jsonl and the trackers get the final evaluation too (marked "final"): what no evaluation during
        # training logged, and the evaluations the finish seam added (a recipe's test split)
        self.log_final(state, metrics, before)
        call_hooks(self.hooks, "on_train_end", state, metrics)
        if acc.num_processes > 1:  # timings and peak memory differ by rank: every rank returns the main one's
            metrics = broadcast_object_list([metrics])[0]
        self.write_results(metrics)
        if acc.is_main_process:  # `auto` leaves a finished run alone
            end_attempt(cfg.output_dir, {"step": state.step, "total_steps": self.plan.total_steps,
                                         **ended(self.hooks, state.step)})
        if state.stopped:  # the stop a SIGTERM saved is finished: a later resume continues it as any stopped run
            saved = checkpoints_dir(cfg.output_dir) / checkpoint_name(state.step)
            ckpt.amend_train_state(acc, saved, {"stopped": False})
        end_loader_workers(self.train_loader)
        self.log.close(end_training)
        return TrainResult(state=state, metrics=metrics, model=self.model, accelerator=acc)

    def run_finish_seam(self, state: TrainState, metrics: dict[str, float], before: dict[str, float]) -> None:
        """Every hook's on_finish. An error there comes after the model was written: all_results.json gets what was
        measured, and a FinishError (chained to the cause, which the crash record keeps) says what is saved."""
        for hook in self.hooks:
            method = getattr(hook, "on_finish", None)
            if method is None:
                continue
            try:
                method(self, metrics)
            except Exception as error:  # noqa: BLE001 - any failure here must not hide that the model is saved
                self.log_final(state, metrics, before)
                self.write_results(metrics)
                self.log.close(end_training=False)
                raise FinishError(failure_message(self, hook, error, metrics)) from error

    def log_final(self, state: TrainState, metrics: dict[str, float], before: dict[str, float]) -> None:
        final = {**self.unlogged, **{k: v for k, v in metrics.items()
                                     if k.startswith(("eval_", "test_")) and k not in before}}
        if final:
            self.log.log({**final, "epoch": self.epoch_float(state)}, state.step, final=True)
        self.log.summary(metrics, state.step)

    def write_results(self, metrics: dict[str, float]) -> None:
        if self.accelerator.is_main_process:
            (Path(self.config.output_dir) / RESULTS).write_text(json.dumps(json_safe(metrics), indent=2))
            self.log.write("final metrics: " + ", ".join(f"{k}={short(v)}" for k, v in metrics.items()))


def _due(strategy: str, every: int, step: int, epoch_end: bool) -> bool:
    return (strategy == "steps" and step % every == 0) or (strategy == "epoch" and epoch_end)
