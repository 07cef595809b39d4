"""The step loop: one explicit loop on Accelerate, the same on 1 CPU process or many GPUs.

A "step" is an optimizer step. Everything that varies with the hardware (device placement, DDP/FSDP/DeepSpeed
wrapping, mixed precision, gradient sync) is done by `accelerator.prepare`, `accumulate` and `backward`; the
loop itself has no `if distributed` branch. What happens between steps (log, evaluate, save, hooks) is the
session's (session.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import DataError
from .data import seeded_generator, take_real_tokens
from .guard import SpikeWatch, StepGuard, on_nonfinite, on_spike
from .loss import Window, as_loss_output, batch_size_of
from .meter import StepMeter
from .optim import steps_on_evaluation
from .restore import roll_back
from .session import Session
from .state import TrainState


def run_loop(session: Session, state: TrainState, meter: StepMeter, probe: Any | None = None,
             stop: bool = False) -> None:
    """Train from `state` until the plan's last step or a stop agreed by every rank (`stop`: the hooks' answer to
    on_train_start, which the caller runs). `probe` (opt-in diagnostics: None unless a diagnostics flag is set) is
    told when a step's gradients are complete and when it is taken."""
    acc, model, optimizer, scheduler = session.accelerator, session.model, session.optimizer, session.scheduler
    config, plan, loader = session.config, session.plan, session.train_loader
    window = Window(acc)  # what this accumulation window fed back: micro-batches, items of a sum loss
    model.train()
    spike = SpikeWatch(config.spike_window, config.spike_threshold, state.spike_losses) if config.spike_window else None
    restored = session.position_restored  # a stream's loader that starts at its saved position skips nothing
    with StepGuard(acc, check_gradients=acc.scaler is None, spike=spike) as guard:
        while state.step < plan.total_steps and not stop:
            _seed_epoch(loader, config, state.epoch)
            skip = 0 if restored else state.batch_in_epoch
            restored = False  # later epochs start from their beginning
            batches = acc.skip_first_batches(loader, skip) if skip else loader
            fed = rolled_back = False
            for batch, waited in _timed(batches):
                fed, n = True, batch_size_of(batch)
                if [state.epoch, state.batch_in_epoch] in state.excluded_batches:  # --on_spike rollback took it out
                    _pass_over(acc, state, n)
                    continue
                tokens = take_real_tokens(batch)  # before the loss: a packed batch's count is no model input
                with acc.accumulate(model), meter.flops.measure(n, _positions(batch)):  # MFU: counted once
                    out = as_loss_output(session.loss_fn(model, batch), session.loss_fn)
                    acc.backward(out["objective"])  # Accelerate divides by the accumulation count
                window.add(out)
                guard.watch(out["objective"], out["loss"])
                meter.add_micro_batch(out, n, tokens, waited)
                state.batch_in_epoch += 1
                state.samples_in_epoch += n * acc.num_processes
                state.samples_seen += n * acc.num_processes
                if not acc.sync_gradients:  # Accelerate also syncs at the loader's real end: a short last window
                    continue
                # The step gradient: the mean over this window's micro-batches, or sums over all its items (loss.py).
                items = window.scale_gradients(model)
                window.reset()
                if probe is not None:
                    probe.before_clip(state.step + 1)  # per-layer gradient norms, activation statistics
                # Clip (or, with max_grad_norm <= 0, only measure): the norm also reveals non-finite gradients.
                max_norm = config.max_grad_norm if config.max_grad_norm > 0 else math.inf
                grad_norm = acc.clip_grad_norm_(model.parameters(), max_norm)
                verdict = guard.verdict(grad_norm, items)  # agreed by every rank: non-finite, empty, SIGTERM
                if verdict.nonfinite:
                    on_nonfinite(session, state, verdict)  # stop: report and raise; skip: count it
                # stop: report and raise; skip: count it; rollback: the checkpoint to go back to
                back_to = on_spike(session, state, verdict) if verdict.spike else None
                if verdict.drops_update:
                    _skip_optimizer_step(acc)
                else:
                    optimizer.step()
                if back_to is not None:  # the run resumes at the checkpoint, from its data position
                    optimizer.zero_grad(set_to_none=True)
                    roll_back(session, state, back_to)
                    meter.reset()
                    if spike is not None:
                        spike.losses = state.spike_losses  # the checkpoint's window
                    rolled_back = True
                    break
                if acc.optimizer_step_was_skipped and not verdict.drops_update:
                    state.skipped_steps += 1  # the fp16 loss scaler skipped it (overflow)
                elif not steps_on_evaluation(scheduler):
                    scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                state.step += 1
                if probe is not None:
                    probe.after_step(state.step)  # profiler step, memory snapshot
                epoch_end = acc.gradient_state.end_of_dataloader  # the loader's real end, whatever its __len__
                if epoch_end:
                    state.epoch, state.batch_in_epoch, state.samples_in_epoch = state.epoch + 1, 0, 0
                stop = session.after_step(state, meter, epoch_end, grad_norm)
                if verdict.preempt:
                    session.preempt(state)
                if stop or state.step >= plan.total_steps:
                    break
            if rolled_back:
                getattr(batches, "end", lambda: None)()  # Accelerate's loader: the abandoned pass is over
                continue
            if not fed:
                raise DataError(f"the training loader yielded no batch in epoch {state.epoch} (after "
                                f"{state.batch_in_epoch} batches of it were consumed): an iterable dataset that "
                                "ran dry, or a loader whose length is wrong. Check the dataset, or set --max_steps "
                                "to what it can feed.")


def _pass_over(accelerator, state: TrainState, samples: int) -> None:
    """A micro-batch an --on_spike rollback excluded: it keeps its place in the epoch (the data position counts it)
    but is never fed. Exclusions are whole accumulation windows, so the following windows stay aligned."""
    state.batch_in_epoch += 1
    state.samples_in_epoch += samples * accelerator.num_processes
    if accelerator.gradient_state.end_of_dataloader:  # it was the epoch's last
        state.epoch, state.batch_in_epoch, state.samples_in_epoch = state.epoch + 1, 0, 0


def _skip_optimizer_step(accelerator) -> None:
    """Drop this step's update. Under fp16 the loss scaler unscaled the gradients for clipping and must still be
    updated, or its next unscale_() fails ("unscale_() has already been called")."""
    if accelerator.scaler is not None:
        accelerator.scaler.update()


def _seed_epoch(loader, config, epoch: int) -> None:
    """Make the epoch's data order and worker seeds depend only on (seed, epoch), so a resumed run sees
    exactly the batches an uninterrupted one would. A DataLoader without its own generator draws its worker
    base seed from the global RNG at every `iter()`, which would shift dropout after a mid-epoch resume."""
    loader.set_epoch(epoch)
    seed = config.data_seed if config.data_seed is not None else config.seed
    # On Accelerate's prepared loader, an attribute set lands on the wrapper; the DataLoader that draws the
    # base seed is the wrapped one.
    getattr(loader, "base_dataloader", loader).generator = seeded_generator(seed, epoch)


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


def _positions(batch: Any) -> int:
    """Token positions of a text batch, padding included (B x L): of its attention mask, or of a packed batch's
    position ids; 0 for other batches."""
    if not isinstance(batch, Mapping):
        return 0
    mask = batch.get("attention_mask", batch.get("position_ids"))
    return mask.numel() if isinstance(mask, torch.Tensor) else 0
