"""An error between two optimizer steps does not cost the steps before it: the training state is saved first.

* A metrics function that raises (or returns what is not a number) at an evaluation during training — on any
  process: evaluation.agreed_metrics raises a MetricsError on every process together — makes the loop save a
  checkpoint of the step just taken as it stood *before* the evaluation (its random states put back: the
  evaluation's loader draws a seed from them), marked `evaluation_pending`. A run resumed from it
  (`--resume_from_checkpoint latest`, the metric fixed) runs that evaluation first — its log, a plateau schedule's
  step, the best checkpoint, the hooks' on_evaluate — then the next step, as the run that never failed did.
* An error in a micro-batch's loss or backward (a loss that fails on the last, short batch of an epoch: a batch of
  one) on a single process makes the loop save the last step boundary: the weights, optimizer and schedule are still
  those of the last step, and the data position, the random states and the logging interval are put back to where
  that step left them (`StepBoundary`: a few kB copied at each step boundary). The error is re-raised
  as it was, with a note saying where the state is. Not on several processes: a rank whose loss raised cannot tell
  whether the others are waiting in the gradient all-reduce, and a checkpoint is a collective. Not for a stream (its
  saved position is the loader's, past the window's batches), nor before the first step (nothing to keep).

* SIGTERM (agreed at a step boundary, `preempt`) saves that step and stops; an evaluation due or asked at that step
  is not run first (it could outlast the grace period a scheduler gives) but saved as pending, as above, and a stop
  agreed there (early stopping) is saved too: the resumed run trains no step and finishes. A stop or an evaluation
  asked in the on_save of a background checkpoint (--async_save) that lands in the SIGTERM's save is saved alike.

* SIGTERM in the finish (`FinishGuard`): agreed before the final evaluation and after it, before the final model is
  written; then as a SIGTERM at the last step: that step saved (under --save_strategy no too), exit 0, the finish the
  resumed run's. Once the final model is written a SIGTERM is held and the finish goes on (nothing left to save).

The first two save nothing under --save_strategy no. A resumed run ends bitwise where the run that never failed ends
(tests/core/test_rescue.py: 1 and 2 processes, with accumulation).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Iterator

import numpy as np
import torch

from ..errors import MetricsError, Preempted
from ..rundir import checkpoint as ckpt
from ..rundir.layout import checkpoint_name, checkpoints_dir
from ..rundir.run_files import end_attempt
from .control import any_rank
from .guard import SigtermFlag
from .hooks import call_hooks, hook_states


def random_states() -> dict:
    """The random number states a checkpoint saves (Accelerate's save_state: Python, NumPy, torch, CUDA)."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_random_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


def saved_before(session, state, meter, before: dict | None, error: MetricsError) -> MetricsError:
    """Save the step's state as it was before the failed evaluation (collective: every process raised it); the
    error to raise, saying where it is."""
    config = session.config
    if config.save_strategy == "no":
        return MetricsError(f"{error} Nothing was saved (--save_strategy no): the run stops at step {state.step}.")
    path = checkpoints_dir(config.output_dir) / checkpoint_name(state.step)
    if session.last_save != state.step:
        if before is not None:
            set_random_states(before)
        session.keep_interval(state, meter)
        state.evaluation_pending = True
        try:
            session.save(state)
        finally:
            state.evaluation_pending = False
    return MetricsError(f"{error} The training state of step {state.step} was saved first, before this evaluation, "
                        f"in {path}: fix the metrics function and resume with --resume_from_checkpoint latest; the "
                        "resumed run runs this evaluation first, then goes on as if it had never failed.")


def preempt(session, state, meter, stop: bool = False) -> None:
    """SIGTERM: save a checkpoint at this step boundary and stop on purpose (every rank agreed). An evaluation left
    pending at this step (Session.after_step, control.settle) is in it, and `stop` (the run stops at this step: its
    finish, which could outlast the grace period, is the resumed run's), also where they became known after the
    step's checkpoint was written: its train state is then amended to the state the step ended with (an evaluation
    asked after the checkpoint: its metrics, the best, the hooks' state: early stopping's stop, which `auto` reads).
    The resumed run evaluates first, then finishes or trains on.

    A checkpoint written in the background (--async_save) lands here: what its on_save hooks ask is carried out at
    this step (a stop saved, an evaluation left pending; a save adds nothing), as a synchronous run does where it
    writes that checkpoint (the uninterrupted --async_save run asks it at its next save; that on_save ran, and a
    resumed run does not call it again). Where this step had no checkpoint, the one written here is one the
    uninterrupted run never writes: what its on_save asks is dropped, and the run resumed from it, its hooks' state
    taken before that on_save, goes on as the uninterrupted run."""
    path = checkpoints_dir(session.config.output_dir) / checkpoint_name(state.step)
    written = session.last_save == state.step  # before the step's later work, which the amendment adds
    session.keep_interval(state, meter)
    asked = session.control.agree(session.settle_writes(state))  # collective: every rank preempts here
    stop = stop or "stop" in asked
    state.evaluation_pending |= "evaluate" in asked and state.last_eval[0] != state.step
    state.stopped = stop
    session.save(state)  # writes the state above; nothing where this step's checkpoint was written already
    if written:  # (it waited for a background one): that one gets the state the step ended with
        state.hooks = hook_states(session.hooks)
        ckpt.amend_train_state(session.accelerator, path, dataclasses.asdict(state))
    if session.accelerator.is_main_process:
        end_attempt(session.config.output_dir)
    session.log.close()
    raise Preempted(f"SIGTERM received: stopped at step {state.step} after saving {path}. "
                    "Resume with --resume_from_checkpoint latest (or auto).")


class FinishGuard:
    """SIGTERM during Session.finish, which the loop's StepGuard no longer watches: a flag set by the handler and
    agreed at the finish's boundaries (`agree`: one all-reduce on every rank), where it preempts as at the last
    step. The final evaluation (its test splits too) can outlast a scheduler's grace period, and under
    --save_strategy no nothing else keeps the trained weights. Once the final model is written, a
    SIGTERM is held (no agreement follows) and the finish goes on: the model is on disk, and the weights in memory
    may no longer be the last step's (the weight average, the best checkpoint's), so no checkpoint could stand for
    the run. The previous handler is back when the finish ends (the `with` around it, in train.py)."""

    def __init__(self, session, state, meter):
        self.session, self.state, self.meter = session, state, meter
        self.term = SigtermFlag()  # the loop's StepGuard holds one too
        self.random = random_states()  # at the last agreement: a save after the final evaluation puts them back

    def __enter__(self):
        self.term.__enter__()
        return self

    def __exit__(self, *exc):
        return self.term.__exit__(*exc)

    def agree(self) -> None:
        """A finish boundary: a SIGTERM received on any rank saves the last step and raises Preempted. The random
        states are put back to the first boundary's (the final evaluation's loader draws a seed): where this saves
        after it, the resumed run's finish draws what the uninterrupted run's drew."""
        session, state = self.session, self.state
        if not any_rank(session.accelerator, self.term.raised) or state.step == 0:  # step 0: nothing trained to keep
            self.random = random_states()
            return
        set_random_states(self.random)
        preempt(session, state, self.meter, stop=state.step < session.plan.total_steps)  # stopped early: kept


def pending_evaluation(session, state) -> bool:
    """A run resumed from a checkpoint that a failed evaluation saved: that evaluation, and what follows it in
    `after_step` (on_evaluate, the best checkpoint), before the first step. True when the run should stop."""
    if not state.evaluation_pending:
        return False
    state.evaluation_pending = False
    if session.eval_loader is None:
        return False
    metrics, improved = session.evaluate(state)
    stop = call_hooks(session.hooks, "on_evaluate", state, metrics)
    if improved and session.config.save_strategy != "no":
        stop |= session.save(state, best=True)  # this step's checkpoint exists: it becomes the best one
    if stop:  # agreed across ranks, as after_step agrees
        session.accelerator.set_trigger()
    return session.accelerator.check_trigger()


class StepBoundary:
    """The run as the last optimizer step left it: the data position, the random states and the logging interval,
    taken at each step boundary (after the step's log, evaluation and checkpoint, before the next batch is fetched:
    a transform in the loader may draw random numbers), for a micro-batch that fails (module docstring). Its
    `after_step` is the session's, with a failed evaluation's rescue around it."""

    METER = ("loss_sum", "items", "micro_batches", "samples", "tokens", "data_wait")  # the interval's figures

    def __init__(self, session, state, meter):
        self.session, self.state, self.meter = session, state, meter
        self.take()

    def take(self) -> None:
        """Where the run stands now is a step boundary (the loop's start, an epoch's, a rollback's, a step's end)."""
        state, meter = self.state, self.meter
        self.position = (state.batch_in_epoch, state.samples_in_epoch, state.samples_seen)
        self.random = random_states()  # a few kB copied per step
        # references, not copies: the meter replaces its tensors (x = x + loss), it never adds in place
        self.figures = {name: getattr(meter, name) for name in self.METER} | {"terms": dict(meter.terms)}

    def after_step(self, epoch_end: bool, grad_norm=None, preempt: bool = False) -> bool:
        """`session.after_step`; a MetricsError there saves this step's training state first, as it was before the
        evaluation (module docstring). True when the run should stop."""
        session, state = self.session, self.state
        state.evaluation_pending = False  # a rollback to a checkpoint a failed evaluation saved must not carry it on
        before = random_states() if session.eval_loader is not None else None  # the evaluation draws from them
        try:
            stop = session.after_step(state, self.meter, epoch_end, grad_norm, preempt)
        except MetricsError as error:
            raise saved_before(session, state, self.meter, before, error) from error
        self.take()
        return stop

    def drop_window(self) -> None:
        """A skipped step (--on_nonfinite skip, --on_spike skip): its micro-batches' losses leave the logging interval
        (a non-finite one made the interval's loss NaN, and train_loss left its steps out; a spike's dominated it, where
        a rollback drops it), as its update left the weights. Its examples, tokens and wait stay: they were fed."""
        for name in ("loss_sum", "items", "micro_batches"):
            setattr(self.meter, name, self.figures[name])
        self.meter.terms = dict(self.figures["terms"])
        self.meter.dropped += 1  # nor does it weigh in train_loss

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """Around a micro-batch's loss and backward: an error there saves the last step boundary first."""
        try:
            yield
        except Exception as error:
            path = self.save()
            if path is not None:
                error.add_note(f"accel_train: the training state of step {self.state.step}, the last optimizer step "
                               f"before this error, was saved first in {path}: fix the cause and resume with "
                               "--resume_from_checkpoint latest.")
            raise

    def save(self):
        """Put the boundary back and save it; the checkpoint's path, or None where nothing is saved."""
        session, state = self.session, self.state
        if (state.step == 0 or session.config.save_strategy == "no" or session.accelerator.num_processes > 1
                or session.stream is not None):
            return None
        path = checkpoints_dir(session.config.output_dir) / checkpoint_name(state.step)
        if session.last_save != state.step:  # else that checkpoint is this boundary already
            state.batch_in_epoch, state.samples_in_epoch, state.samples_seen = self.position
            set_random_states(self.random)
            for name, value in self.figures.items():
                setattr(self.meter, name, value)
            session.optimizer.zero_grad(set_to_none=True)  # the failed window's partial gradients are not the state
            session.keep_interval(state, self.meter)
            session.save(state)
        return None if session.writer.wait_alone() else path  # --async_save: once its write landed
