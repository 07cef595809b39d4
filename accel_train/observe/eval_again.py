"""A second evaluation of the final weights: what `accel-train verify`'s evaluation check compares with the first.

Opt-in, free when off: with ACCEL_TRAIN_EVAL_AGAIN=1 in the environment (verify sets it on its evaluation variant)
train() adds an `EvaluateAgain` hook. At the finish seam (after the final evaluation, with the same weights) it
evaluates the evaluation loader once more, with the run's own evaluation loss and metrics function, and adds the
results as eval_again_* to the run's metrics (all_results.json). An evaluation that depends on anything but the
weights and the data (dropout left on, a generator drawn in eval mode, state kept between evaluations) gives other
numbers the second time.
"""

from __future__ import annotations

import os
from typing import Any

from ..core.ema import evaluate_with_average

VARIABLE = "ACCEL_TRAIN_EVAL_AGAIN"
PREFIX = "eval_again"


def evaluate_again(session: Any) -> list:
    """[an EvaluateAgain hook] when ACCEL_TRAIN_EVAL_AGAIN=1 and the run has an evaluation loader, else []."""
    if os.environ.get(VARIABLE) != "1" or session.eval_loader is None:
        return []
    return [EvaluateAgain()]


class EvaluateAgain:
    """The hook (module docstring): on_finish evaluates again and adds eval_again_* to the metrics."""

    def on_finish(self, session: Any, metrics: dict[str, float]) -> None:
        own = getattr(session.metrics_fn, "metrics_fn", session.metrics_fn)  # the user's, not the observer's recorder
        metrics.update(evaluate_with_average(session.accelerator, session.model, session.eval_loader,
                                             session.eval_loss_fn, own, session.average, prefix=PREFIX))
