"""`train()`: one run, from unprepared objects to the final metrics.

    session = Session(spec)                      check, prepare, plan (core/session.py); nothing written yet
    observer = Observer(session, recorder)       the pre-flight check refuses a broken run here
    state = session.start(hooks)                 resume or fresh; run directory, log, start-up report
    call_hooks(hooks, "on_train_start", state)   the hooks' set-up (report facts, schedule plot): not timed
    run_loop(session, state, meter, probe, stop) the step loop (core/loop.py); train_runtime times it
    session.finish(state, meter, runtime)        final evaluation, the finish seam, results written once
    export_formats_at_end(...)                   --export_formats: TorchScript / ExportedProgram / ONNX, verified
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from accelerate import Accelerator

from .config import TrainConfig
from .core.compiled import CompileCount, compiling
from .core.control import any_rank
from .core.evaluation import MetricsFn, check_monitored_metric
from .core.hooks import EarlyStopping, call_hooks
from .core.loop import run_loop
from .core.loss import evaluation_loss
from .core.meter import StepMeter
from .core.rescue import FinishGuard
from .core.session import RunSpec, Session
from .core.state import TrainResult
from .deploy import RecordModelFactory, check_exportable, describe_model, export_formats_at_end
from .errors import PeerTimeout, Preempted
from .observe.eval_again import evaluate_again
from .observe.fed_record import fed_recorder
from .observe.gradient_record import record_gradient
from .observe.observer import ConfusionRecorder, Observer
from .observe.overfit import overfit_setup
from .rundir.metrics_log import end_training_safely, fail_trackers
from .rundir.outdir import is_collective_timeout, peer_timeout_message, record_crash


def train(
    model: torch.nn.Module,
    train_loader: torch.utils.data.DataLoader,
    *,
    config: TrainConfig,
    loss_fn: Callable | None = None,
    eval_loader: torch.utils.data.DataLoader | None = None,
    metrics_fn: MetricsFn | None = None,
    optimizer: torch.optim.Optimizer | Sequence | None = None,
    scheduler: Any = None,
    hooks: Sequence[Any] = (),
    accelerator: Accelerator | None = None,
    processing_class: Any = None,
    extra_configs: Sequence[Any] = (),
    final_eval_loaders: Mapping[str, torch.utils.data.DataLoader] | None = None,
    end_training: bool = True,
) -> TrainResult:
    """Train `model` on `train_loader` as `config` says; return the final state and metrics.

    model, loaders and optimizer are passed unprepared; `optimizer` may be an optimizer, a list of param groups, or
    None (AdamW/SGD per `config.optim`, no weight decay on biases and norms). `loss_fn(model, batch)` returns a
    scalar loss or a mapping with "loss" (plus tensors such as "logits" for metrics, and scalars under "log" to log
    beside the loss); it must return the mean over the micro-batch, *not* divided by the accumulation count; a loss
    with training-only terms (label smoothing, mixup) carries `evaluation_loss`, the loss without them, which
    evaluations and the --overfit_batches check use. `metrics_fn(outputs)` receives the gathered evaluation outputs
    and returns named floats. `final_eval_loaders` ({"test": loader}) are evaluated once, after training, with their
    name as the metric prefix (test_loss, test_accuracy, ...). A hook's `on_finish(session, metrics)` runs on every
    process after the final evaluation and after the final model is written, with the prepared model
    (`session.model`), and may add to `metrics` (test predictions, generated text); all_results.json and the report
    are written after it, once. An error there raises `FinishError` with the model and the measured results already
    saved. An error raised once the run has started is recorded in output_dir/crash_rank<R>.json (then re-raised).
    `result.metrics` is the same dict on every process: the main process's (what all_results.json holds).
    `end_training=False` keeps the process group alive for other collective work after training; call
    `end_training_safely(result.accelerator)` then (`accelerator.end_training()` after a pause that lets gloo's
    threads finish: see rundir/metrics_log.py).

        result = train(model, make_loader(train_set, config, train=True), config=config, loss_fn=loss_fn,
                       eval_loader=make_loader(val_set, config, train=False), metrics_fn=metrics_fn)
        print(result.metrics["eval_loss"])
    """
    spec = RunSpec(model, train_loader, config, loss_fn, eval_loader, metrics_fn, optimizer, scheduler, tuple(hooks),
                   accelerator, processing_class, tuple(extra_configs), final_eval_loaders)
    if config.overfit_batches:  # debug mode: N fixed batches, repeated, until the loss is near zero
        overfit_config, overfit_loader = overfit_setup(config, train_loader, accelerator)
        # the plain objective (no label smoothing or mixup): whether *it* can reach zero is the question
        plain = evaluation_loss(loss_fn) if loss_fn is not None else None
        spec = dataclasses.replace(spec, config=overfit_config, train_loader=overfit_loader, eval_loader=None,
                                   final_eval_loaders=None, loss_fn=plain)
    check_monitored_metric(spec.config, spec.metrics_fn, spec.eval_loader is not None)
    if spec.config.export_formats:
        check_exportable(model)
    recorder = ConfusionRecorder(spec.metrics_fn)  # the observer keeps each evaluation's confusion matrix
    session = Session(dataclasses.replace(spec, metrics_fn=recorder))
    observer = Observer(session, recorder)
    factory = _factory_hook(model, spec, session.accelerator.is_main_process)
    compiled = [CompileCount(session.log.write)] if compiling(session.accelerator) else []  # train_compiled_graphs
    # fed_recorder: ACCEL_TRAIN_RECORD_FED=1, what verify's data accounting reads; evaluate_again:
    # ACCEL_TRAIN_EVAL_AGAIN=1, a second evaluation of the final weights, what verify's evaluation check compares
    state = session.start([*spec.hooks, *_builtin_hooks(session.config, session.log.write), *factory, observer,
                           *compiled, *fed_recorder(session), *evaluate_again(session)])
    meter = StepMeter(session.accelerator)
    meter.flops.restore(state.flop_count)  # resumed: the count of the first run's first micro-batch
    try:
        # set-up, not training time: what hooks do before the first step (the observer's run facts, schedule plot)
        # agreed: a stop asked on one rank only would leave the others training into their first collective
        stop = any_rank(session.accelerator, call_hooks(session.hooks, "on_train_start", state))
        meter.resume_interval(state.pending_loss)  # its clock starts here; resumed: the interval it fell inside
        started = time.perf_counter()
        with observer.probe(state.step) as probe:
            # ACCEL_TRAIN_RECORD_GRADIENT=1: step 1's gradient, what verify's accumulation and world-size checks compare
            run_loop(session, state, meter, record_gradient(session, probe), stop)
        formats = session.config.export_formats
        with FinishGuard(session, state, meter) as guard:  # SIGTERM until the final model is written (core/rescue.py)
            result = session.finish(state, meter, time.perf_counter() - started, end_training and not formats, guard)
    except Preempted:  # a checkpoint was saved on purpose: not a crash
        raise
    except BaseException as error:  # the cause stays in the run directory, for `accel-train report`
        acc, out = session.accelerator, session.config.output_dir
        failed_write = session.writer.wait_alone()  # --async_save: a pending checkpoint lands before the process ends
        if failed_write:
            error.add_note(failed_write)
        record_crash(out, acc.process_index, state.step, error)
        fail_trackers(acc)  # finished as failed, not left open (MLflow's exit handler would mark the run FINISHED)
        if acc.num_processes > 1 and is_collective_timeout(error):  # a hung or dead peer: say which, and how long
            raise PeerTimeout(peer_timeout_message(out, acc.num_processes, acc.process_index, state.step,
                                                   session.config.ddp_timeout, error)) from error
        raise
    if formats:  # after all_results.json and the weights: a failed export loses neither
        export_formats_at_end(session.accelerator, session.model, session.config.output_dir, formats,
                              session.processing_class, session.eval_loader, train_loader=session.train_loader)
        if end_training:
            end_training_safely(session.accelerator)
    return result


def _factory_hook(model: torch.nn.Module, spec: RunSpec, main_process: bool) -> list:
    """model_factory.json for a model that describes itself (`factory_kwargs`): how `accel-train export` rebuilds it
    from the run directory or any checkpoint. A transformers model has config.json instead."""
    if describe_model(model) is None or any(isinstance(h, RecordModelFactory) for h in spec.hooks):
        return []
    return [RecordModelFactory(model, spec.config.output_dir, main_process)]


def _builtin_hooks(config: TrainConfig, say: Callable[[str], None]) -> list:
    if config.early_stopping_patience is None:
        return []
    return [EarlyStopping(config.best_metric_name, "max" if config.best_is_greater else "min",
                          config.early_stopping_patience, config.early_stopping_threshold, say=say)]
