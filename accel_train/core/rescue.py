"""An evaluation that fails during training does not cost the steps before it: the training state is saved first.

When the metrics function raises (or returns what is not a number) at an evaluation between optimizer steps — on any
process: evaluation.agreed_metrics raises a MetricsError on every process together — the loop saves a checkpoint of
the step just taken, as it stood *before* the evaluation: its random number states are put back to the step boundary
(the evaluation's loader draws a seed from them), and the checkpoint is marked `evaluation_pending`. A run resumed
from it (`--resume_from_checkpoint latest`, once the metric is fixed) runs that evaluation first — its logging, a
plateau schedule's step, the best checkpoint, the hooks' on_evaluate — and then the next step: it continues as the
run that never failed (tests/core/test_rescue.py: bitwise, 1 and 2 processes, with accumulation).

Not saved: under --save_strategy no (no checkpoints asked for). The final evaluation needs nothing of this: finish()
saves the last step before it.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from ..errors import MetricsError
from ..rundir.layout import checkpoint_name, checkpoints_dir
from .hooks import call_hooks


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


def after_step_saving_on_error(session, state, meter, epoch_end: bool, grad_norm=None) -> bool:
    """`session.after_step`; a MetricsError there saves this step's training state first (module docstring)."""
    state.evaluation_pending = False  # a rollback to a checkpoint saved by a failed evaluation must not carry it on
    before = random_states()  # a few kB copied per optimizer step: the evaluation draws from them
    try:
        return session.after_step(state, meter, epoch_end, grad_norm)
    except MetricsError as error:
        raise saved_before(session, state, meter, before, error) from error


def saved_before(session, state, meter, before: dict, error: MetricsError) -> MetricsError:
    """Save the step's state as it was before the failed evaluation (collective: every process raised it); the
    error to raise, saying where it is."""
    config = session.config
    if config.save_strategy == "no":
        return MetricsError(f"{error} Nothing was saved (--save_strategy no): the run stops at step {state.step}.")
    path = checkpoints_dir(config.output_dir) / checkpoint_name(state.step)
    if session.last_save != state.step:
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
