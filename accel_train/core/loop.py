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
from contextlib import closing
from typing import Any

import torch

from ..errors import DataError
from .control import any_rank
from .data import take_examples, take_real_tokens
from .guard import SpikeWatch, StepGuard, on_nonfinite, on_spike
from .loss import Window, as_loss_output, batch_size_of, weigh_by_examples
from .meter import StepMeter
from .objects import fused_kernel, steps_each_epoch, steps_each_optimizer_step
from .rescue import StepBoundary, pending_evaluation, preempt
from .seeding import data_seed, seeded_generator
from .session import Session
from .state import TrainState
from .token_batches import round_examples


def run_loop(session: Session, state: TrainState, meter: StepMeter, probe: Any | None = None,
             stop: bool = False) -> None:
    """Train from `state` until the plan's last step or a stop agreed by every rank (`stop`: the hooks' answer to
    on_train_start, which the caller runs). `probe` (opt-in diagnostics: None unless a diagnostics flag is set) is
    told when a step's gradients are complete and when it is taken."""
    acc, model, plan = session.accelerator, session.model, session.plan
    window = Window(acc)  # what this accumulation window fed back: micro-batches, items of a sum loss
    # a token budget's micro-batches differ in size: where a step spans several, a mean loss is weighed by examples
    weigh = bool(session.config.max_tokens_per_batch) and acc.gradient_accumulation_steps * acc.num_processes > 1
    rounds = round_examples(session.train_loader, acc.num_processes)  # a budget's ranks feed unequal micro-batches
    model.train()
    spike = SpikeWatch(session.config.spike_window, session.config.spike_threshold,
                       state.spike_losses) if session.config.spike_window else None
    restored = session.position_restored  # a stream's loader that starts at its saved position skips nothing
    meter.hold()  # an evaluation, not training time
    stop = pending_evaluation(session, state) or state.stopped or stop  # resumed where a fault saved (rescue.py)
    meter.release()
    boundary = StepBoundary(session, state, meter)  # an error between steps saves the last step first (rescue.py)
    with StepGuard(acc, check_gradients=acc.scaler is None, spike=spike) as guard:
        while state.step < plan.total_steps and not stop:
            boundary.take()  # an epoch's start, or a rollback's: the next window's first batch is not fetched yet
            skip = 0 if restored else state.batch_in_epoch
            restored = False  # later epochs, and a rollback's replay, start where their state says
            with closing(epoch_batches(session, state, skip, rounds)) as batches:  # closed: Accelerate's pass ends
                for batch, waited in batches:
                    n = take_examples(batch, batch_size_of(batch))  # a padding-free row holds several examples
                    tokens = take_real_tokens(batch)  # before the loss: a packed batch's count is no model input
                    with boundary.kept(), acc.accumulate(model), meter.flops.measure(n, _positions(batch)):  # MFU once
                        out = as_loss_output(session.loss_fn(model, batch), session.loss_fn)
                        out = weigh_by_examples(out, n) if weigh else out
                        acc.backward(out["objective"])  # Accelerate divides by the accumulation count
                    window.add(out)
                    guard.watch(out["objective"], out["loss"])
                    meter.add_micro_batch(out, n, tokens, waited)
                    _advance(state, rounds(state.epoch, state.batch_in_epoch) if rounds else n * acc.num_processes)
                    if not acc.sync_gradients:  # Accelerate also syncs at the loader's real end: a short last window
                        continue
                    grad_norm, verdict, back_to = optimizer_step(session, state, meter, window, guard, probe)
                    if back_to is not None:  # --on_spike rollback: re-enter the epoch at the checkpoint's position
                        state.train_seconds += meter.running()  # the clock goes on: the dropped steps were paid
                        session.roll_back(state, back_to)
                        stop = back_to.stop  # asked when its checkpoint landed: the run ends there
                        meter.resume_interval(state.pending_loss, clock=False)  # the checkpoint's unlogged interval
                        if spike is not None:
                            spike.losses = state.spike_losses  # the checkpoint's window
                        break
                    if verdict.drops_update:  # skipped: the update, and its losses in the log, are dropped
                        boundary.drop_window()
                    state.step += 1
                    if probe is not None:
                        probe.after_step(state.step)  # profiler step, memory snapshot
                    epoch_end = acc.gradient_state.end_of_dataloader  # the loader's real end, whatever its __len__
                    if epoch_end:
                        _next_epoch(session, state)
                    # session.after_step: log, evaluate, save (SIGTERM: the evaluation left to the resumed run)
                    stop = boundary.after_step(epoch_end, grad_norm, verdict.preempt)
                    if verdict.preempt:
                        preempt(session, state, meter, stop)
                    if stop or state.step >= plan.total_steps:
                        break
        # received after the last step's verdict, or the stop's: the finish is the resumed run's (a stop before the
        # first step has nothing to save: it finishes)
        if (state.step >= plan.total_steps or stop and state.step > 0) and any_rank(acc, guard.sigterm):
            preempt(session, state, meter, stop)
    session.control.close()  # no step boundary is left: a request from now on (on_finish, on_train_end) is refused


def optimizer_step(session: Session, state: TrainState, meter: StepMeter, window: Window, guard: StepGuard,
                   probe: Any | None):
    """The window's gradients are complete: rescale them (loss.py), clip, judge (non-finite, empty, spike, SIGTERM:
    agreed by every rank), then step — or drop the update — and step the schedule. (grad norm, verdict, the checkpoint
    an --on_spike rollback goes back to or None)."""
    acc, config = session.accelerator, session.config
    items = window.scale_gradients(session.model)  # the mean over the window's micro-batches, or sums over its items
    window.reset()
    if probe is not None:
        probe.before_clip(state.step + 1)  # per-layer gradient norms, activation statistics
    # Clip (or, with max_grad_norm <= 0, only measure): the norm also reveals non-finite gradients.
    max_norm = config.max_grad_norm if config.max_grad_norm > 0 else math.inf
    grad_norm = acc.clip_grad_norm_(session.model.parameters(), max_norm)
    verdict = guard.verdict(grad_norm, items)
    if verdict.nonfinite:
        on_nonfinite(session, state, verdict)  # stop: report and raise; skip: count it
    # stop: report and raise; skip: count it; rollback: the checkpoint to go back to
    back_to = on_spike(session, state, verdict, meter) if verdict.spike else None
    # fp16: the scaler halves its scale on an overflow. Accelerate infers a skipped step from step() not being called,
    # and a fused kernel is called anyway and skips inside (huggingface/accelerate#4242): there the scale tells (read
    # on the host before and after the step: fp16 with a fused kernel only)
    fused = acc.scaler is not None and not verdict.drops_update and fused_kernel(session.optimizer)
    scale = acc.scaler.get_scale() if fused else None
    if verdict.drops_update:
        _skip_optimizer_step(acc)
    else:
        session.optimizer.step()
    overflow = acc.optimizer_step_was_skipped or scale is not None and acc.scaler.get_scale() < scale
    if back_to is None and overflow and not verdict.drops_update:
        state.skipped_steps += 1  # the fp16 loss scaler skipped it (overflow)
    elif back_to is None and steps_each_optimizer_step(session.scheduler, config):
        session.scheduler.step()
    session.optimizer.zero_grad(set_to_none=True)
    return grad_norm, verdict, back_to


def epoch_batches(session: Session, state: TrainState, skip: int, rounds=None):
    """The batches of the epoch in progress, from `skip` (the micro-batches it had consumed), with the time each was
    waited for; those an --on_spike rollback excluded are passed over (counted in the data position, never fed; a
    token budget's `rounds` count their examples on every process). Raises when the epoch yields no batch. Closing it
    mid-epoch (a rollback) ends Accelerate's pass."""
    loader = session.train_loader
    _seed_epoch(loader, session.config, state.epoch)
    batches = session.accelerator.skip_first_batches(loader, skip) if skip else loader
    fed, finished, epoch = False, False, state.epoch
    try:
        for batch, waited in _timed(batches):
            fed = True
            if [state.epoch, state.batch_in_epoch] in state.excluded_batches:
                _advance(state, rounds(state.epoch, state.batch_in_epoch) if rounds else
                         take_examples(batch, batch_size_of(batch)) * session.accelerator.num_processes, False)
                if session.accelerator.gradient_state.end_of_dataloader:  # it was the epoch's last
                    _next_epoch(session, state)
                continue
            yield batch, waited
        finished = True
    finally:
        if not finished:
            getattr(batches, "end", lambda: None)()  # Accelerate's loader: the abandoned pass is over
    if not fed:
        raise DataError(f"the training loader yielded no batch in epoch {epoch} (after {skip} batches of it were "
                        "consumed): an iterable dataset that ran dry, or a loader whose length is wrong. Check the "
                        "dataset, or set --max_steps to what it can feed.")


def _advance(state: TrainState, examples: int, fed: bool = True) -> None:
    """One micro-batch consumed, or passed over (not fed): the data position, and the examples of the epoch."""
    state.batch_in_epoch += 1
    state.samples_in_epoch += examples
    state.samples_seen += examples if fed else 0


def _next_epoch(session: Session, state: TrainState) -> None:
    """The epoch in progress ended: the data position moves to the next one; a scheduler of the user's that runs on
    epochs (--scheduler_interval epoch) steps, before the step's checkpoint is saved."""
    state.epoch, state.batch_in_epoch, state.samples_in_epoch = state.epoch + 1, 0, 0
    if steps_each_epoch(session.scheduler, session.config):
        session.scheduler.step()


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
    dataset = getattr(loader, "dataset", None)
    if hasattr(dataset, "set_epoch"):  # Accelerate tells the dataset only when the sampler cannot be told (SeededItems)
        dataset.set_epoch(epoch)
    seed = data_seed(config)
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
