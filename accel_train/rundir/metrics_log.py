"""What a run writes as it goes: the metrics history (metrics.jsonl), the trackers and the progress bar.
Files are written on the main process only; the trackers are Accelerate's."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from tqdm.auto import tqdm

from ..errors import ConfigError
from .layout import HISTORY, MLFLOW_DB, WANDB_DIR, aside


class RunLog:
    """Appends records to `metrics.jsonl`, sends them to the trackers and drives the progress bar.

    Constructing it touches nothing; `open` (once every check has passed) trims a resumed run's history, starts
    the trackers and prints the start-up report; the progress bar opens at the first step, so that what the hooks
    print before it (the pre-flight check) comes before the bar too, in a terminal as in a log file."""

    def __init__(self, accelerator: Accelerator, output_dir: str | Path, total_steps: int, project_name: str,
                 disable_bar: bool = False):
        self.accelerator = accelerator
        self.path = Path(output_dir) / HISTORY
        self.main = accelerator.is_main_process
        self.total_steps, self.project_name, self.disable_bar = total_steps, project_name, disable_bar
        self.bar: tqdm | None = None
        self.initial_step = self.last_step = 0
        self.replayed = 0  # steps an --on_spike rollback abandoned: the trackers' steps count on past them
        # a hook's names for the trackers ({"loss": "Loss/train"}, RunControl.tracker_names); metrics.jsonl, the
        # report and all_results.json keep the loop's names, which they (and accel-train report / compare) read back
        self.tracker_names: dict[str, str] = {}

    def open(self, initial_step: int, hparams: dict[str, Any], startup_report: str, replayed: int = 0,
             evaluation: bool = False, interval: bool = False) -> None:
        """`replayed`: the steps rollbacks abandoned before the checkpoint a run resumes from (TrainState);
        `evaluation`, `interval`: what this run logs again at that checkpoint's step (truncate_history)."""
        if self.main:
            truncate_history(self.path, initial_step, evaluation, interval)
        self.replayed = replayed
        store = local_mlflow_store(self.accelerator, self.path.parent)
        if self.accelerator.log_with:
            self.accelerator.init_trackers(self.project_name, config=_flat_hparams(hparams), init_kwargs=tracker_kwargs(
                self.accelerator, self.path.parent, initial_step + replayed if initial_step else None))
        self.write(startup_report + (f"\n  mlflow           {store}" if store else ""))
        self.initial_step = initial_step

    def log(self, record: dict[str, Any], step: int, final: bool = False) -> None:
        """Append `record` at `step` to metrics.jsonl (non-finite numbers as null) and send it to the trackers; an
        evaluation (eval_* / test_* keys) also prints one line. `final`: the evaluation after training, marked
        "final": true in the file (the report's curves leave it out)."""
        self.last_step = step
        if self.main:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(json_safe({"step": step, **record, **({"final": True} if final else {})})) + "\n")
            if any(k.startswith(("eval_", "test_")) for k in record):
                self.write(evaluation_line(record, step, final))
        self.to_trackers(record, step)
        if "loss" in record and self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4g}", lr=f"{record['learning_rate']:.3g}",
                                 samples_s=f"{record.get('samples_per_second', 0):.1f}", refresh=False)

    def summary(self, metrics: dict[str, Any], step: int) -> None:
        """The run's summary to the trackers, at its last step, as the Trainer logs its own: train_loss,
        train_runtime, train_samples_per_second, train_mfu, ... (what all_results.json holds of training;
        metrics.jsonl keeps the intervals, all_results.json the summary)."""
        numbers = {k: v for k, v in metrics.items()
                   if k.startswith("train_") and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numbers and self.accelerator.log_with:
            self.to_trackers(numbers, step)

    def to_trackers(self, record: dict[str, Any], step: int) -> None:
        """`record` to the trackers, under the names of `tracker_names` (the others as they are)."""
        named: dict[str, Any] = {}
        for key, value in record.items():
            name = self.tracker_names.get(key, key)
            if name in named:  # a tracker would keep one of the two values under that name
                raise ConfigError(f"tracker_names {self.tracker_names}: two logged names reach the trackers as "
                                  f"{name!r} (in {sorted(record)}); give each its own name.")
            named[name] = value
        self.accelerator.log(named, step=step + self.replayed)

    def rewind(self, step: int, record: dict[str, Any]) -> int:
        """--on_spike rollback: the run goes on from `step`, with `record` marking where and why. metrics.jsonl keeps
        one timeline: the abandoned steps' records are dropped and the mark stands at `step`. Trackers refuse a step
        that goes back (W&B drops it), so they get the replay at steps counted on past the abandoned ones: a
        tracker's step is the run's step plus the steps replayed so far (the mark carries both; returned, for the
        train state: a resumed run goes on counting from it)."""
        abandoned = max(self.last_step - step, 0)
        if self.main:
            truncate_history(self.path, step)
        self.replayed += abandoned
        self.log({**record, "rollback_replays_steps": abandoned}, step)
        if self.bar is not None:  # the bar counts steps of the run, not steps taken
            self.bar.n = step
            self.bar.refresh()
        return self.replayed

    def warn(self, message: str) -> None:
        """A warning: printed on the main process and kept in metrics.jsonl as {"step", "warning"} at the step last
        logged, where the run report lists it (its "Warnings" section)."""
        if self.main:
            with open(self.path, "a") as fh:
                fh.write(json.dumps({"step": self.last_step, "warning": message}) + "\n")
            self.write(f"warning: {message}")

    def advance(self) -> None:
        if self.bar is None:
            self.bar = tqdm(total=self.total_steps, initial=self.initial_step, dynamic_ncols=True, desc="train",
                            disable=not self.main or self.disable_bar)
        self.bar.update(1)

    def write(self, message: str) -> None:
        """A line for the user on the main process, above the progress bar once it is open."""
        if self.main:
            say(message)

    def close(self, end_training: bool = True) -> None:
        """Close the bar; `end_training` also finishes the trackers and destroys the process group."""
        if self.bar is not None:
            self.bar.close()
        if end_training:
            end_training_safely(self.accelerator)
        elif self.main:
            for tracker in self.accelerator.trackers:
                tracker.finish()


def fail_trackers(accelerator) -> None:
    """A run that failed: its trackers are finished as failed (MLflow's run FAILED, where its exit handler would end
    it FINISHED and a next run in this process could not start its own; W&B's with exit code 1; TensorBoard's events
    flushed), on the main process, without a collective (a peer may be gone). Never raises: the run's error is the
    one to see."""
    if not accelerator.is_main_process:
        return
    for tracker in accelerator.trackers:
        with contextlib.suppress(Exception):
            name = str(getattr(tracker, "name", "")).lower()
            if name == "mlflow":
                import mlflow

                mlflow.end_run(status="FAILED")
            elif name == "wandb":
                tracker.run.finish(exit_code=1)
            else:
                tracker.finish()


def end_training_safely(accelerator) -> None:
    """`accelerator.end_training()` (trackers finished, process group destroyed), after a pause on several processes.

    Why the pause: gloo's worker threads free a finished collective's tensors under the GIL, and a process group
    destroyed while one of them waits for it deadlocks — the destructor joins that thread while holding the GIL.
    It happens when the group goes (DDP's reducer holds it) within moments of the last collective, e.g. as a script
    returns right after training: seen in CI as a launched process that never exited after writing its results.
    Sleeping lets the threads take the GIL and finish first; nothing is gathered after this point."""
    if accelerator.num_processes > 1:
        time.sleep(0.2)
    accelerator.end_training()


def say(message: str) -> None:
    """Print a line for the user without breaking the progress bar (call it on the main process). Flushed: into a
    log file stdout is block-buffered, and the bar (stderr) would otherwise come first."""
    tqdm.write(message)
    sys.stdout.flush()


def json_safe(value: Any) -> Any:
    """`value` with NaN and infinities as None, so the JSON written is standard (null), never `NaN`."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


EVAL_LINE_METRICS = 8  # the rest of a long evaluation (per-class accuracies) stays in metrics.jsonl


def evaluation_line(record: dict[str, Any], step: int, final: bool = False) -> str:
    """One line per evaluation: `eval step 120 (epoch 1.5): loss 0.4211, accuracy 0.8125, ...`."""
    shown = [(k, v) for k, v in record.items() if k.startswith(("eval_", "test_")) and isinstance(v, (int, float))
             and not k.endswith(("_samples", "_items", "_runtime"))]
    parts = [f"{k.removeprefix('eval_')} {_number(v)}" for k, v in shown[:EVAL_LINE_METRICS]]
    if len(shown) > EVAL_LINE_METRICS:
        parts.append(f"... ({len(shown) - EVAL_LINE_METRICS} more in metrics.jsonl)")
    epoch = f" (epoch {record['epoch']:g})" if isinstance(record.get("epoch"), (int, float)) else ""
    return f"{'final evaluation' if final else 'eval'} step {step}{epoch}: " + ", ".join(parts)


def _number(value: float) -> str:
    return "nan" if isinstance(value, float) and math.isnan(value) else f"{value:.4g}"


def truncate_history(path: Path, step: int, evaluation: bool = False, interval: bool = False) -> None:
    """On resume (and a rollback), drop records the interrupted run wrote after the checkpoint it resumes from, and a
    last line a crash cut short (a killed process or machine mid-write: it raised on the main process alone, and every
    restart hung the others). Also the records at the checkpoint's step that the resumed run writes again, which an
    earlier attempt from the same checkpoint wrote before it was cut (each was logged twice): the evaluation the
    checkpoint left pending (`evaluation`), the logging interval it fell inside (`interval`: the finish logs it at the
    last step), and an earlier finish's final records (a resumed run finishes again). Written aside and renamed into
    place: a kill mid-rewrite loses no history, and a reader that follows the file (a sweep's pruner) sees another
    file, not a shorter one under its read position; an aside a kill left is the next attempt's to remove
    (run_files.begin_attempt), not a file of the user's."""
    if not path.exists() or step == 0:
        return
    lines = [line for line in path.read_text().splitlines() if line]
    records = [json.loads(line) for line in lines[:-1]]
    try:
        records += [json.loads(lines[-1])] if lines else []
    except json.JSONDecodeError:
        pass

    def again(record: dict[str, Any]) -> bool:
        evaluated = any(key.startswith("eval_") for key in record)
        return record.get("final", False) or record.get("step") == step and (
            evaluation and evaluated or interval and "loss" in record and not evaluated)

    # a torn last line has no record: zip leaves it out
    kept = [line for line, record in zip(lines, records, strict=False)
            if record.get("step", 0) <= step and not again(record)]
    written = path.with_name(aside(path.name))
    written.write_text("".join(line + "\n" for line in kept))
    os.replace(written, path)


def _flat_hparams(config: dict[str, Any]) -> dict[str, Any]:
    """Trackers (TensorBoard's hparams in particular) accept only scalars and strings."""
    out = {}
    for key, value in config.items():
        if isinstance(value, (int, float, str, bool)):
            out[key] = value
        elif value is not None:
            out[key] = str(value)
    return out


def local_mlflow_store(accelerator: Accelerator, output_dir: Path) -> str | None:
    """With --report_to mlflow and no MLFLOW_TRACKING_URI: the run's own SQLite store, output_dir/mlflow.db (MLflow's
    default store is a SQLite file in the current directory, and its file store is legacy); its URI, else None.
    Open it with `mlflow ui --backend-store-uri sqlite:///OUT/mlflow.db` or `mlflow.MlflowClient(that URI)`."""
    names = {str(getattr(tracker, "name", tracker)).lower() for tracker in accelerator.log_with}
    given = os.environ.get("MLFLOW_TRACKING_URI")
    # mlflow.set_tracking_uri also sets the environment variable (child processes inherit it): a URI this function
    # set for an earlier run in the same process is not the user's choice, and must not collect this run too.
    if "mlflow" not in names or (given and given not in _OWN_MLFLOW_STORES):
        return None
    import mlflow

    uri = f"sqlite:///{(Path(output_dir) / MLFLOW_DB).resolve()}"
    mlflow.set_tracking_uri(uri)
    _OWN_MLFLOW_STORES.add(uri)
    return uri


_OWN_MLFLOW_STORES: set[str] = set()  # the stores local_mlflow_store chose in this process


def tracker_kwargs(accelerator: Accelerator, output_dir: Path, resumed_at: int | None = None
                   ) -> dict[str, dict[str, Any]]:
    """Accelerate's init_kwargs per tracker: W&B writes into output_dir/wandb (its default is ./wandb in the current
    directory) unless WANDB_DIR names a place; an offline run's files are then beside the run's other records.
    `resumed_at` (the tracker step a resumed run starts at): TensorBoard, which reads every event file of its folder,
    hides the earlier attempts' events after it (purge_step), as metrics.jsonl drops their records."""
    names = {str(getattr(tracker, "name", tracker)).lower() for tracker in accelerator.log_with}
    kwargs: dict[str, dict[str, Any]] = {}
    if "wandb" in names and not os.environ.get("WANDB_DIR"):
        (Path(output_dir) / WANDB_DIR).mkdir(parents=True, exist_ok=True)
        kwargs["wandb"] = {"dir": str(Path(output_dir).resolve())}
    if "tensorboard" in names and resumed_at is not None:
        kwargs["tensorboard"] = {"purge_step": resumed_at + 1}
    return kwargs
