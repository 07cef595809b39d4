"""The hook protocol: plain objects with any of these optional methods (docs/hooks.md: every method, when it runs,
on which ranks, what it may change).

    attach(run)                     once at the start: `run` is the RunControl (control.py): the prepared model,
                                    optimizer, scheduler, plateau, accelerator and config, the trackers' names,
                                    and request_stop() / request_save() / request_evaluate()
    on_train_start(state)           before the first step
    on_log(state, logs)             at each logging step (logs: what metrics.jsonl got)
    on_evaluate(state, metrics)     after each evaluation
    on_save(state, checkpoint_dir)  after each checkpoint
    on_finish(session, metrics)     the finish seam: after the final evaluation and the final model, may add metrics
    on_train_end(state, metrics)    last
    state_dict() / load_state_dict(d)   the hook's own state, in every checkpoint

A hook steers only through its requests, carried out at the next optimizer-step boundary on every rank (the loop
agrees them across processes, so every rank evaluates, saves and stops at the same step). Returning ``True`` from
on_train_start, on_log, on_evaluate or on_save asks for a stop too, as hooks did before RunControl.

    class StopAtTarget:
        def attach(self, run):
            self.run = run

        def on_evaluate(self, state, metrics):
            if metrics["eval_accuracy"] >= 0.9:
                self.run.request_stop()
"""

from __future__ import annotations

import math
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Hook(Protocol):
    """All methods are optional; implement the ones you need. Return True to ask the loop to stop."""

    def attach(self, run) -> None:
        """Once, when the run starts (fresh or resumed), before load_state_dict and on_train_start, on every rank that
        has the hook: keep `run` (a RunControl) to read the prepared objects and make requests."""

    def on_train_start(self, state) -> bool | None: ...

    def on_log(self, state, logs: dict[str, float]) -> bool | None: ...

    def on_evaluate(self, state, metrics: dict[str, float]) -> bool | None: ...

    def on_save(self, state, checkpoint_dir) -> bool | None: ...

    def on_finish(self, session, metrics: dict[str, float]) -> bool | None:
        """After the final evaluation, on every process, with the prepared session (model, accelerator, config):
        add entries to `metrics` (test predictions, generated text) and write files; all_results.json and the
        report are written after every hook's on_finish. Collective work is allowed: every rank calls it."""

    def on_train_end(self, state, metrics: dict[str, float]) -> bool | None: ...


HOOK_EVENTS = ("attach", "on_train_start", "on_log", "on_evaluate", "on_save", "on_finish", "on_train_end")


def call_hooks(hooks, event: str, *args) -> bool:
    """Call `event` on every hook that has it; True if any hook asked to stop."""
    stop = False
    for hook in hooks:
        method = getattr(hook, event, None)
        if method is not None and method(*args):
            stop = True
    return stop


def hook_keys(hooks) -> list[str]:
    """A stable name for each hook's checkpointed state: its `state_key` attribute, else its class name (the
    second hook of a class gets "#2", and so on). Adding another hook does not move any other hook's state."""
    keys, seen = [], {}
    for hook in hooks:
        base = getattr(hook, "state_key", None) or type(hook).__name__
        seen[base] = seen.get(base, 0) + 1
        keys.append(base if seen[base] == 1 else f"{base}#{seen[base]}")
    return keys


def hook_states(hooks) -> dict[str, Any]:
    """Each hook's own state (its state_dict), keyed by `hook_keys`: what a checkpoint saves of the hooks."""
    return {key: hook.state_dict() for key, hook in zip(hook_keys(hooks), hooks, strict=True)
            if hasattr(hook, "state_dict")}


def saved_hook_state(saved: dict[str, Any], key: str) -> Any:
    """The state saved under `key`, also from checkpoints that keyed hooks by position ("<index>:<class>")."""
    if key in saved:
        return saved[key]
    base, _, nth = key.partition("#")
    legacy = [v for k, v in saved.items() if k.partition(":")[2] == base and k.partition(":")[0].isdigit()]
    position = int(nth or 1) - 1
    return legacy[position] if position < len(legacy) else None


class EarlyStopping:
    """Stop when `metric` has not improved by more than `min_delta` for `patience` evaluations.

    The metric is computed from predictions gathered across processes, so every rank sees the same value
    and takes the same decision; the loop additionally agrees the stop across ranks.
    """

    def __init__(self, metric: str = "eval_loss", mode: str = "min", patience: int = 3, min_delta: float = 0.0,
                 say=None):
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping mode must be 'min' or 'max', not {mode!r}")
        self.metric, self.mode, self.patience, self.min_delta = metric, mode, patience, min_delta
        self.say = say  # say(message): where the stop is announced (train() passes the run's log; None: silent)
        self.best: float | None = None
        self.bad_evaluations = 0
        self.stopped_at: int | None = None

    def improved(self, value: float) -> bool:
        if self.best is None or math.isnan(self.best):
            return not math.isnan(value)
        if self.mode == "max":
            return value > self.best + self.min_delta
        return value < self.best - self.min_delta

    def on_evaluate(self, state, metrics: dict[str, float]) -> bool:
        if self.metric not in metrics:
            raise KeyError(
                f"early stopping watches '{self.metric}' but the evaluation returned {sorted(metrics)}; "
                "set --metric_for_best_model to one of them."
            )
        value = float(metrics[self.metric])
        if self.improved(value):
            self.best, self.bad_evaluations = value, 0
        else:
            self.bad_evaluations += 1
        if self.bad_evaluations >= self.patience:
            self.stopped_at = state.step
            if self.say is not None:
                self.say(f"early stopping: {self.metric} has not improved by more than {self.min_delta:g} for "
                         f"{self.bad_evaluations} evaluation(s) (best {self.best:.6g}, last {value:.6g}); the run "
                         f"stops at step {state.step}")
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "bad_evaluations": self.bad_evaluations, "stopped_at": self.stopped_at,
                "metric": self.metric, "mode": self.mode}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved best and count, when they were kept for the same metric in the same direction (a state saved
        without them, before 2026-12-05, is taken as it is); otherwise early stopping starts afresh, as the run's
        best does (restore.check_best)."""
        if (state.get("metric", self.metric), state.get("mode", self.mode)) != (self.metric, self.mode):
            return
        self.best = state["best"]
        self.bad_evaluations = state["bad_evaluations"]
        self.stopped_at = state["stopped_at"]


def ended(hooks, step: int) -> dict[str, str]:
    """{"ended_by": "EarlyStopping"} where early stopping ended the run at `step`, for run_files' record of a
    finished run: `auto` leaves such a run finished, where another hook's stop (a pause) is continued."""
    if any(isinstance(hook, EarlyStopping) and hook.stopped_at == step for hook in hooks):
        return {"ended_by": "EarlyStopping"}
    return {}
