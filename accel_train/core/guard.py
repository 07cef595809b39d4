"""Step guard and diagnosis: non-finite losses and gradients, and preemption (SIGTERM).

`StepGuard` watches every micro-batch's loss on the device (no host sync) and, once per optimizer step,
turns "any non-finite loss in this window, a non-finite gradient norm, a SIGTERM received" into one small
tensor, reduced across processes, read with one sync. Every rank therefore takes the same decision at the
same step. `on_nonfinite` applies --on_nonfinite (skip the step, or stop with a report); `locate_nonfinite` re-runs
a batch with hooks to name the first module whose output or gradient went non-finite.
"""

from __future__ import annotations

import json
import math
import signal
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, send_to_device

from ..config import TrainConfig
from ..errors import ConfigError, TrainingDiverged
from ..rundir.checkpoint import list_checkpoints
from .accelerator import holds_whole_model
from .control import any_rank
from .loss import as_loss_output


@dataclass
class Verdict:
    nonfinite_loss: bool = False
    nonfinite_grad: bool = False
    preempt: bool = False
    empty: bool = False  # a sum loss counted no item in the whole window: there is nothing to step on
    bad_micro_batches: list[int] = field(default_factory=list)  # positions in the window, this rank
    spike: bool = False  # the step's loss is a spike (--spike_window): `loss` against the window's `reference`
    loss: float = math.nan  # the step's loss, the mean over its micro-batches on every process
    reference: float = math.nan  # the spike window's mean loss

    @property
    def nonfinite(self) -> bool:
        return self.nonfinite_loss or self.nonfinite_grad

    @property
    def drops_update(self) -> bool:
        """The step's update is not applied: non-finite, nothing to step on (empty), or a spike."""
        return self.nonfinite or self.empty or self.spike


class SpikeWatch:
    """--spike_window W --spike_threshold T: a step whose loss exceeds T x the mean of the last W steps' losses is a
    spike. `losses` is the train state's list (checkpointed, so a resumed run judges by the same window); a spike
    never enters it, so one bad step cannot raise the bar for the next."""

    def __init__(self, window: int, threshold: float, losses: list[float]):
        self.window, self.threshold, self.losses = window, threshold, losses

    def judge(self, loss: float) -> tuple[bool, float]:
        """(is `loss` a spike, the window's mean); a full window is needed before anything is a spike."""
        reference = sum(self.losses) / len(self.losses) if self.losses else math.nan
        spike = len(self.losses) >= self.window and math.isfinite(loss) and loss > self.threshold * reference
        if not spike and math.isfinite(loss):
            self.losses.append(loss)
            del self.losses[:-self.window]
        return spike, reference


class SigtermFlag:
    """SIGTERM as a flag while a `with` holds it: the handler only sets `raised` (one that printed or saved could
    re-enter a write it interrupted), agreed across ranks where the caller chooses; the previous handler is back at
    the exit. Off the main thread no handler can be set: no preemption handling there."""

    def __init__(self):
        self.raised = False
        self.previous = None

    def __enter__(self):
        try:
            self.previous = signal.signal(signal.SIGTERM, self.handle)
        except ValueError:  # not the main thread
            self.previous = None
        return self

    def __exit__(self, *exc):
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
        return False

    def handle(self, signum, frame) -> None:
        self.raised = True


class StepGuard:
    """Non-finite detection, the loss-spike guard and SIGTERM agreement, one device sync per optimizer step."""

    def __init__(self, accelerator: Accelerator, check_gradients: bool, spike: SpikeWatch | None = None):
        self.accelerator = accelerator
        # Under fp16 the loss scaler owns non-finite gradients: it skips those steps and lowers the scale. DeepSpeed's
        # fp16 engine has its own (Accelerate's scaler is None there) and reports an inf norm for each step it skipped.
        engine_scaled = _deepspeed(accelerator) and accelerator.mixed_precision == "fp16"
        self.check_gradients = check_gradients and not engine_scaled
        self.spike = spike
        self.window: list[torch.Tensor] = []
        self.losses: list[torch.Tensor] = []  # the window's micro-batch losses, for the spike guard
        self.term = SigtermFlag()

    @property
    def sigterm(self) -> bool:
        return self.term.raised

    def __enter__(self):
        self.term.__enter__()
        return self

    def __exit__(self, *exc):
        return self.term.__exit__(*exc)

    def watch(self, objective: torch.Tensor, loss: torch.Tensor | None = None) -> None:
        """A micro-batch's objective (checked for non-finite values) and its displayed loss (the spike guard's)."""
        self.window.append(torch.isfinite(objective.detach().float()).all())
        if self.spike is not None and loss is not None:
            self.losses.append(loss.detach().float().reshape(()))

    def verdict(self, grad_norm: torch.Tensor | None, items: torch.Tensor | None = None) -> Verdict:
        """The step's decision, agreed by every rank. `grad_norm`: the clipped gradients' norm; `items`: a sum
        loss's item count over the whole window and all processes (None for mean losses)."""
        finite = torch.stack(self.window) if self.window else torch.ones(1, dtype=torch.bool)
        self.window = []
        device = self.accelerator.device
        grad_bad = torch.zeros((), device=device)
        if self.check_gradients and isinstance(grad_norm, (torch.Tensor, float, int)):  # DeepSpeed's is a float
            if hasattr(grad_norm, "full_tensor"):  # FSDP2 returns the norm as a DTensor
                grad_norm = grad_norm.full_tensor()
            grad_bad = (~torch.isfinite(torch.as_tensor(grad_norm).detach().float())).float().to(device)
        empty = (items <= 0).float().to(device) if items is not None else torch.zeros((), device=device)
        losses, self.losses = self.losses, []
        loss_sum = torch.stack(losses).sum().to(device) if losses else torch.zeros((), device=device)
        flags = torch.stack([(~finite).any().float().to(device), grad_bad,
                             torch.tensor(float(self.sigterm), device=device), empty.reshape(()),
                             loss_sum, torch.tensor(float(len(losses)), device=device)])
        if self.accelerator.num_processes > 1:
            flags = self.accelerator.reduce(flags, reduction="sum")
        values = flags.tolist()  # the step's one host sync
        loss_bad, grad_bad_any, preempt, nothing = (v > 0 for v in values[:4])
        bad = [i for i, ok in enumerate(finite.tolist()) if not ok] if loss_bad else []
        verdict = Verdict(loss_bad, grad_bad_any, preempt, nothing, bad)
        if self.spike is not None and values[5] and not verdict.nonfinite:  # the same numbers on every rank
            verdict.loss = values[4] / values[5]
            verdict.spike, verdict.reference = self.spike.judge(verdict.loss)
        return verdict


def _deepspeed(accelerator: Any) -> bool:
    """DeepSpeed steps inside `accelerator.backward`: the update is applied before the loop judges the step."""
    return getattr(getattr(accelerator, "distributed_type", None), "value", None) == "DEEPSPEED"


def micro_batch_indices(loader, batch_index: int) -> list[int] | None:
    """Dataset indices of this process's micro-batch number `batch_index` of the current epoch (the prepared
    loader's batch sampler replays the epoch's order, seeded by the epoch)."""
    sampler = getattr(loader, "batch_sampler", None)
    if sampler is None:
        return None
    for i, indices in enumerate(sampler):
        if i == batch_index:
            return [int(j) for j in indices]
    return None


def _nonfinite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() and not bool(torch.isfinite(value).all())
    if isinstance(value, (list, tuple)):
        return any(_nonfinite(v) for v in value)
    if isinstance(value, dict):
        return any(_nonfinite(v) for v in value.values())
    if hasattr(value, "to_tuple"):  # transformers ModelOutput
        return any(_nonfinite(v) for v in value.to_tuple())
    return False


def locate_nonfinite(accelerator: Accelerator, model: torch.nn.Module, batch: Any, loss_fn: Callable) -> dict:
    """Re-run `batch` forward and backward on the bare model with hooks on every module; report the first
    module (in execution order) whose output, and the first whose gradient, is non-finite. Runs locally on
    this rank (no collectives), leaves no gradients behind."""
    bare = accelerator.unwrap_model(model)
    names = {module: name or type(bare).__name__ for name, module in bare.named_modules()}
    found: dict[str, str | None] = {"forward": None, "backward": None}

    def forward_hook(module, inputs, output):
        if found["forward"] is None and _nonfinite(output):
            found["forward"] = f"{names[module]} ({type(module).__name__})"

    def backward_hook(module, grad_input, grad_output):
        if found["backward"] is None and (_nonfinite(grad_output) or _nonfinite(grad_input)):
            found["backward"] = f"{names[module]} ({type(module).__name__})"

    handles = [m.register_forward_hook(forward_hook) for m in bare.modules()]
    handles += [m.register_full_backward_hook(backward_hook) for m in bare.modules() if not list(m.children())]
    report: dict[str, Any] = {}
    try:
        with accelerator.autocast():
            loss = as_loss_output(loss_fn(bare, send_to_device(batch, accelerator.device)))["objective"]
        report["loss_on_rerun"] = float(loss.detach().float())
        if loss.requires_grad:
            with warnings.catch_warnings():  # inputs that need no gradient are fine here
                warnings.simplefilter("ignore", UserWarning)
                loss.backward()
    except RuntimeError as err:  # e.g. an autograd anomaly; the forward finding still stands
        report["rerun_error"] = str(err)
    finally:
        for handle in handles:
            handle.remove()
        bare.zero_grad(set_to_none=True)
    report["first_nonfinite_output"] = found["forward"]
    report["first_nonfinite_gradient"] = found["backward"]
    report["nonfinite_parameters"] = [n for n, p in bare.named_parameters() if not torch.isfinite(p).all()][:20]
    return report


def fetch_batch(loader, indices: list[int]) -> Any:
    """Rebuild a micro-batch from its dataset indices with the loader's own collate function."""
    return loader.collate_fn([loader.dataset[i] for i in indices])


def write_nonfinite_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    def plain(value):
        return None if isinstance(value, float) and math.isnan(value) else str(value)

    path.write_text(json.dumps(report, indent=2, default=plain))


def on_nonfinite(session, state, verdict: Verdict) -> None:
    """--on_nonfinite skip: count and log the step (its gradients are dropped); stop after the limit.
    --on_nonfinite stop, or the limit reached: write a report that locates the first non-finite module, keep the
    last good checkpoint, and raise TrainingDiverged. `session` is the run's core.session.Session."""
    step, cfg, log = state.step + 1, session.config, session.log
    what = "loss" if verdict.nonfinite_loss else "gradient"
    if cfg.on_nonfinite == "skip" and state.nonfinite_skips < cfg.max_nonfinite_skips:
        state.nonfinite_skips += 1
        log.log({"nonfinite_skipped_step": step, "nonfinite": what, "nonfinite_skips": state.nonfinite_skips}, step)
        log.write(f"step {step}: non-finite {what}, step skipped ({state.nonfinite_skips}/{cfg.max_nonfinite_skips})")
        return
    report = diagnose_nonfinite(session, state, verdict)
    session.settle_writes(state)  # a checkpoint still being written (--async_save) lands first: it is the last good
    latest = list_checkpoints(cfg.output_dir)
    raise TrainingDiverged(
        f"non-finite {what} at step {step} (epoch {state.epoch}); first non-finite output: "
        f"{report.get('first_nonfinite_output')}, gradient: {report.get('first_nonfinite_gradient')}. "
        f"Report: {report['path']}. The last good checkpoint is "
        f"{latest[-1] if latest else 'none (no checkpoint was saved yet)'}. Lower --learning_rate, check the "
        "data at the reported sample indices, or use --on_nonfinite skip."
        + (f" ({state.nonfinite_skips} steps were skipped before)" if state.nonfinite_skips else "")
    )


def window_batches(state, config) -> list[int]:
    """The epoch's batch numbers of the accumulation window that just ended (its last one is batch_in_epoch - 1)."""
    last, gas = state.batch_in_epoch - 1, config.gradient_accumulation_steps
    return list(range(last - (last % gas), last + 1))


@dataclass(frozen=True)
class Rollback:
    """Where an --on_spike rollback goes back to, and the record that marks it in the run's history."""

    checkpoint: Path
    record: dict[str, Any]
    stop: bool = False  # a hook asked to stop when that checkpoint landed (--async_save): the run stops there


def on_spike(session, state, verdict: Verdict, meter) -> Rollback | None:
    """--on_spike skip: count and log the step (its update is dropped). --on_spike rollback: return the checkpoint to
    go back to and the record that marks it (the loop calls roll_back once the step is dropped). Either stops after
    --max_spike_skips. --on_spike stop, the limit reached, or no checkpoint to return to: raise TrainingDiverged with
    the step, its loss, the window's mean and the sample indices of the step's micro-batches on this process; the
    last checkpoint is as it was (under DeepSpeed, whose engine stepped inside backward, the weights hold the update:
    the message says so, and skip is refused before the run, by core/sharded.py)."""
    step, cfg, log = state.step + 1, session.config, session.log
    ratio = verdict.loss / verdict.reference
    what = (f"loss spike at step {step} (epoch {state.epoch}): loss {verdict.loss:.4g} is {ratio:.1f}x the mean "
            f"{verdict.reference:.4g} of the last {cfg.spike_window} steps (--spike_threshold {cfg.spike_threshold})")
    record = {"spike_loss": verdict.loss, "spike_reference": verdict.reference}
    if cfg.on_spike == "skip" and state.spike_skips < cfg.max_spike_skips:
        state.spike_skips += 1
        log.log({"spike_skipped_step": step, **record, "spike_skips": state.spike_skips}, step)
        log.write(f"{what}: step skipped ({state.spike_skips}/{cfg.max_spike_skips})")
        return None
    # a checkpoint still being written (--async_save) lands first: it may be the last; a stop its on_save hooks ask
    # for is kept (the rollback drops the requests of the dropped step): a synchronous run stopped at that checkpoint.
    # The wait is saving, not training: the `meter` (core/meter.py) holds its clock, as around every other save
    meter.hold()
    landed_stop = session.settle_writes(state) or "stop" in session.control.pending
    meter.release()
    landed_stop = any_rank(session.accelerator, landed_stop)
    latest = list_checkpoints(cfg.output_dir)
    if cfg.on_spike == "rollback":  # every rank goes back to the checkpoint the main process sees (as `auto` does)
        latest = [Path(p) for p in broadcast_object_list([[str(p) for p in latest]])[0]]
    if cfg.on_spike == "rollback" and latest and state.spike_rollbacks < cfg.max_spike_skips:
        log.write(f"{what}: back to {latest[-1].name}, to replay without the step's micro-batches "
                  f"({state.spike_rollbacks + 1}/{cfg.max_spike_skips})")
        return Rollback(latest[-1], {"spike_rollback_step": step, **record, "rolled_back_to": latest[-1].name,
                                     "spike_rollbacks": state.spike_rollbacks + 1}, landed_stop)
    indices = [micro_batch_indices(session.train_loader, b) for b in window_batches(state, cfg)]
    why = ""  # why skip or rollback did not apply here
    if cfg.on_spike == "skip":
        why = f" (--max_spike_skips: {state.spike_skips} spikes were skipped before)"
    elif cfg.on_spike == "rollback":
        why = (f" (--max_spike_skips: {state.spike_rollbacks} rollbacks before)" if latest else
               " (--on_spike rollback: no checkpoint to return to yet; save earlier with --save_steps)")
    applied = _deepspeed(session.accelerator)  # its engine stepped inside backward, before the verdict
    update = ("DeepSpeed applied the update inside backward (the weights in memory hold it; no checkpoint does)"
              if applied else "The update was not applied")
    raise TrainingDiverged(
        f"{what}; its samples on rank {session.accelerator.process_index}: {indices}. {update}; the last checkpoint "
        f"is {latest[-1] if latest else 'none (no checkpoint was saved yet)'}. Check those samples, lower "
        f"--learning_rate, raise --spike_threshold, or use --on_spike {'rollback' if applied else 'skip or rollback'}."
        + why)


def diagnose_nonfinite(session, state, verdict: Verdict) -> dict:
    """The sample indices of the window's failing micro-batches and, where each process holds the whole model, the
    first module whose output and whose gradient went non-finite; written to nonfinite_step<N>_rank<R>.json."""
    acc, loader = session.accelerator, session.train_loader
    window = window_batches(state, session.config)
    positions = verdict.bad_micro_batches or [len(window) - 1]
    report: dict[str, Any] = {"step": state.step + 1, "epoch": state.epoch, "rank": acc.process_index,
                              "nonfinite_loss": verdict.nonfinite_loss, "nonfinite_gradient": verdict.nonfinite_grad,
                              "micro_batches": []}
    for pos in positions:
        indices = micro_batch_indices(loader, window[min(pos, len(window) - 1)])
        entry: dict[str, Any] = {"sample_indices": indices}
        if indices is not None and holds_whole_model(acc):
            entry.update(locate_nonfinite(acc, session.model, fetch_batch(loader, indices), session.loss_fn))
        report["micro_batches"].append(entry)
    first = report["micro_batches"][0] if report["micro_batches"] else {}
    report["first_nonfinite_output"] = first.get("first_nonfinite_output")
    report["first_nonfinite_gradient"] = first.get("first_nonfinite_gradient")
    path = Path(session.config.output_dir) / f"nonfinite_step{state.step + 1}_rank{acc.process_index}.json"
    write_nonfinite_report(path, report)
    report["path"] = str(path)
    return report


def refuse_rollback_on_a_stream(config: TrainConfig, train_loader) -> None:
    """--on_spike rollback on a stream is refused before training: exclusions are positions in an epoch."""
    if config.on_spike == "rollback" and config.spike_window and isinstance(
            getattr(train_loader, "dataset", None), torch.utils.data.IterableDataset):
        raise ConfigError("--on_spike rollback takes the spiked step's batches out by their position in the "
                          "epoch, which needs a dataset with a length; this training set is a stream. Use "
                          "--on_spike skip (drop the update) or stop.")
