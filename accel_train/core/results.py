"""A run's results, for `Session.finish` (session.py): the final evaluation, the training figures beside it, and the
message of a failed finish seam. Each takes the finishing session and reads what it holds. ("Finish" is one thing in
this package: Session.finish, the end of a run, whose seam is every hook's on_finish.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import MetricsError
from ..rundir.final_model import save_final_model
from ..rundir.layout import RESULTS
from .ema import evaluate_with_average
from .evaluation import evaluation_setup
from .meter import StepMeter, peak_memory
from .state import TrainState


def final_evaluation(session: Any, state: TrainState) -> tuple[dict[str, float], dict[str, float]]:
    """(metrics, fresh): the evaluation of the final (or restored best) model, reusing this step's if it ran, then
    the final evaluation loaders, each under its own prefix; `fresh` is what no evaluation during training logged.
    An error there under --save_strategy no, where no checkpoint holds the trained weights, writes the final model
    first (the weight average with --save_ema_as_final; on several processes only for an error every rank agreed
    on, a MetricsError), then is raised: a metric that fails on the test split loses no training."""
    try:
        return _final_evaluation(session, state)
    except Exception as error:
        agreed = session.accelerator.num_processes == 1 or isinstance(error, MetricsError)
        if session.config.save_strategy == "no" and agreed:
            if session.config.save_ema_as_final:
                session.average.copy_into_model()
            save_final_model(session.accelerator, session.model, session.config.output_dir, session.processing_class)
            session.log.write(f"the final evaluation failed: the final model was written first to "
                              f"{session.config.output_dir}")
        raise


def _final_evaluation(session: Any, state: TrainState) -> tuple[dict[str, float], dict[str, float]]:
    metrics: dict[str, float] = {}
    fresh: dict[str, float] = {}
    if session.eval_loader is not None:
        step, metrics, *setup = state.last_eval  # a checkpoint from before 2026-12-06 saved no setup: evaluated
        # reused where this run's evaluation would be the one stored: a run resumed at its last step with another
        # evaluation batch, set, precision or number of processes (verify's evaluation check) evaluates its own
        if step != state.step or setup != [evaluation_setup(session.accelerator, session.eval_loader)]:
            metrics = evaluate_with_average(session.accelerator, session.model, session.eval_loader,
                                            session.eval_loss_fn, session.metrics_fn, session.average)
            fresh.update(metrics)
    metrics = dict(metrics)
    for name, loader in session.final_eval_loaders.items():
        fresh.update(evaluate_with_average(session.accelerator, session.model, loader, session.eval_loss_fn,
                                           session.metrics_fn, session.average, prefix=name))
    metrics.update(fresh)
    return metrics, fresh


def training_figures(session: Any, state: TrainState, meter: StepMeter, runtime: float) -> dict[str, float]:
    """train_loss, runtime (this session's loop), the whole run's training seconds (train_seconds: its sessions'
    logged intervals, evaluations, checkpoints and set-up excluded), steps, this session's samples/s (not a resumed
    run's; none where it trained nothing), epoch, peak memory, skipped steps (fp16 overflow, non-finite, spikes), and
    the model FLOP/s and MFU as means over the logged intervals (evaluations excluded; none where an interval proved
    the peak stale, meter.FlopCount.within_peak)."""
    samples = state.samples_seen - session.start_samples
    figures: dict[str, float] = dict(
        train_loss=state.train_loss, train_runtime=round(runtime, 3), train_seconds=round(state.train_seconds, 3),
        train_steps=state.step, epoch=session.epoch_float(state))
    if samples > 0 and runtime:
        figures["train_samples_per_second"] = round(samples / runtime, 3)
    figures.update({f"train_{k}": v for k, v in peak_memory(session.accelerator.device).items()})
    if state.skipped_steps:
        figures["train_skipped_steps"] = state.skipped_steps
    if state.nonfinite_skips:
        figures["train_nonfinite_skips"] = state.nonfinite_skips
    if state.spike_skips:
        figures["train_spike_skips"] = state.spike_skips
    if state.spike_rollbacks:
        figures["train_spike_rollbacks"] = state.spike_rollbacks
    throughput = session.throughput
    if throughput and meter.flops.peak and not meter.flops.stale:  # stale: a model above the peak, no MFU
        figures.update(train_model_tflops=sum(t for t, _ in throughput) / len(throughput),
                       train_mfu=sum(m for _, m in throughput) / len(throughput),
                       train_peak_tflops=meter.flops.peak / 1e12)
    return figures


def failure_message(session: Any, hook: Any, error: Exception, metrics: dict[str, float]) -> str:
    """The one-paragraph message of a failed finish seam: what failed, what is saved, what to do (a hook's
    `finish_advice`, when it has one)."""
    out, rank = Path(session.config.output_dir), session.accelerator.process_index
    measured = ", ".join(f"{k} {short(v)}" for k, v in metrics.items()
                         if k.startswith(("eval_", "test_")) and k.endswith(("_loss", "_accuracy")))
    advice = getattr(hook, "finish_advice", None)
    return (f"training finished and nothing it trained is lost: the final model is saved in {out} (weights, "
            f"config and tokenizer) and {out / RESULTS} holds what was measured"
            + (f" ({measured})" if measured else "") + f", but {type(hook).__name__}.on_finish failed with "
            f"{type(error).__name__}: {error}. The traceback is in {out}/crash_rank{rank}.json "
            f"(`accel-train report {out}` shows it)." + (f" {advice}" if advice else ""))


def short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else str(value)
