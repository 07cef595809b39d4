"""What a run writes as it goes: the metrics history (metrics.jsonl), the trackers and the progress bar.
Files are written on the main process only; the trackers are Accelerate's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from tqdm.auto import tqdm

from .layout import HISTORY


class RunLog:
    """Appends records to `metrics.jsonl`, sends them to the trackers and drives the progress bar.

    Constructing it touches nothing; `open` (once every check has passed) trims a resumed run's history, starts
    the trackers, prints the start-up report and only then opens the progress bar."""

    def __init__(self, accelerator: Accelerator, output_dir: str | Path, total_steps: int, project_name: str,
                 disable_bar: bool = False):
        self.accelerator = accelerator
        self.path = Path(output_dir) / HISTORY
        self.main = accelerator.is_main_process
        self.total_steps, self.project_name, self.disable_bar = total_steps, project_name, disable_bar
        self.bar: tqdm | None = None

    def open(self, initial_step: int, hparams: dict[str, Any], startup_report: str) -> None:
        if self.main:
            truncate_history(self.path, initial_step)
        if self.accelerator.log_with:
            self.accelerator.init_trackers(self.project_name, config=_flat_hparams(hparams))
        self.write(startup_report)
        self.bar = tqdm(total=self.total_steps, initial=initial_step, disable=not self.main or self.disable_bar,
                        dynamic_ncols=True, desc="train")

    def log(self, record: dict[str, Any], step: int) -> None:
        record = {"step": step, **record}
        if self.main:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")
        self.accelerator.log({k: v for k, v in record.items() if k != "step"}, step=step)
        if "loss" in record and self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4g}", lr=f"{record['learning_rate']:.3g}",
                                 samples_s=f"{record.get('samples_per_second', 0):.1f}", refresh=False)

    def advance(self) -> None:
        if self.bar is not None:
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
            self.accelerator.end_training()
        elif self.main:
            for tracker in self.accelerator.trackers:
                tracker.finish()


def say(message: str) -> None:
    """Print a line for the user without breaking the progress bar (call it on the main process)."""
    tqdm.write(message)


def truncate_history(path: Path, step: int) -> None:
    """On resume, drop records the interrupted run wrote after the checkpoint it resumes from."""
    if not path.exists() or step == 0:
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in kept))


def _flat_hparams(config: dict[str, Any]) -> dict[str, Any]:
    """Trackers (TensorBoard's hparams in particular) accept only scalars and strings."""
    out = {}
    for key, value in config.items():
        if isinstance(value, (int, float, str, bool)):
            out[key] = value
        elif value is not None:
            out[key] = str(value)
    return out
