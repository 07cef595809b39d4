"""The run's observability, as one built-in hook of the loop plus the opt-in diagnostics probe.

    Observer(session, recorder)  before anything is written: the pre-flight check (refuses a broken run)
    on_train_start               run facts (report/run_info.json), the findings, the simulated schedule and its plot
    observer.probe(step)         the diagnostics probe around the loop (None, and free, when no flag asks for one)
    on_train_end                 the overfit verdict, then report.md and its plots (main process)

Files (all inside output_dir): report.md; report/ (plots and the data they are drawn from); diagnostics/
(gradient flow, activation statistics, memory snapshots); profiler/ (traces). A fresh run removes those of a
previous run in the same directory; a resumed run keeps them and appends.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import time
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..core.accelerator import precision_in_effect
from ..core.data import dataset_size
from ..core.evaluation import confusion_matrix
from ..rundir.checkpoint import parameter_numel
from ..rundir.layout import OBSERVABILITY_FILES, REPORT_DIR
from ..rundir.metrics_log import say
from .overfit import OverfitCheck
from .preflight import PreflightResult, run_preflight
from .probes import Diagnostics
from .report import plot_schedule, write_report

MAX_CONFUSION_CLASSES = 100


class ConfusionRecorder:
    """Wraps a run's `metrics_fn`: every evaluation also keeps its confusion matrix when the outputs are a
    classification (2-D logits of at most 100 classes, 1-D integer labels). The metrics are the wrapped
    function's, unchanged."""

    def __init__(self, metrics_fn):
        self.metrics_fn = metrics_fn
        self.confusion: np.ndarray | None = None
        self.classes: tuple[int, int] | None = None  # (classes present, classes of the model), last evaluation
        self.average: ConfusionRecorder | None = None  # the weight average's evaluations (--ema_decay), kept apart

    def for_average(self) -> ConfusionRecorder:
        """The recorder of the weight average's evaluations (core/ema.py asks for it), over the metrics function's
        own twin where it has one (a function that keeps what it saw, such as ClassificationMetrics' confusion)."""
        if self.average is None:
            twin = getattr(self.metrics_fn, "for_average", None)
            self.average = ConfusionRecorder(twin() if twin is not None else self.metrics_fn)
        return self.average

    def __call__(self, outputs: dict[str, torch.Tensor]):
        logits, labels = outputs.get("logits"), outputs.get("labels")
        if (isinstance(logits, torch.Tensor) and isinstance(labels, torch.Tensor) and logits.ndim == 2
                and logits.shape[1] >= 2 and labels.ndim == 1 and not labels.is_floating_point()
                and len(labels) == len(logits)):
            self.classes = (int(torch.unique(labels[labels >= 0]).numel()), logits.shape[1])
            if logits.shape[1] <= MAX_CONFUSION_CLASSES:
                self.confusion = confusion_matrix(labels, logits.argmax(-1), logits.shape[1])
        return self.metrics_fn(outputs) if self.metrics_fn is not None else {}


class Observer:
    """Pre-flight, run facts, overfit check and report for one run (see the module docstring)."""

    def __init__(self, session, recorder: ConfusionRecorder):
        """`session`: the run's prepared core.session.Session (nothing written yet). Runs the pre-flight check
        (unless --no_preflight): raises `ConfigError` listing every error, before anything is written."""
        self.session, self.config, self.recorder = session, session.config, recorder
        self.accelerator, self.model = session.accelerator, session.model
        self.main = session.accelerator.is_main_process
        self.out = Path(self.config.output_dir)
        self.overfit = OverfitCheck(self.config, write=self._say) if self.config.overfit_batches else None
        self.preflight: PreflightResult | None = run_preflight(session) if self.config.preflight else None
        self.started = time.time()
        self.warned_evaluation = False

    def _say(self, message: str) -> None:
        if self.main:
            say(message)

    def probe(self, step: int):
        """The diagnostics probe to enter around the loop, or a context yielding None when none is asked."""
        if not Diagnostics.wanted(self.config):
            return contextlib.nullcontext(None)
        return Diagnostics(self.accelerator, self.config, self.model, self.session.optimizer, step)

    # ----------------------------------------------------------------------------------------- hook methods
    def on_train_start(self, state) -> None:
        if not self.main:
            return
        if self.session.resume_path is None:  # a fresh start: no report or diagnostics of an older run
            for name in OBSERVABILITY_FILES:
                target = self.out / name
                shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
        report = self.out / REPORT_DIR
        report.mkdir(parents=True, exist_ok=True)
        (report / "run_info.json").write_text(json.dumps(self.run_info(state), indent=2))
        if self.preflight is not None:
            (report / "preflight.json").write_text(json.dumps(self.preflight.to_dict()))
            warned = self.preflight.warnings
            self._say(f"pre-flight check: {len(self.preflight.findings)} findings, no error, {len(warned)} warning(s)"
                      f" ({self.preflight.seconds:.2f} s)" + "".join(f"\n  {f.line()}" for f in warned))
            if self.preflight.schedule and self.config.run_report:
                plot_schedule(self.preflight.schedule, report / "lr_schedule.png", self.config.lr_scheduler_type)

    def on_log(self, state, logs) -> bool:
        return bool(self.overfit and self.overfit.on_log(state, logs))

    def on_evaluate(self, state, metrics: dict) -> None:
        self._check_evaluation(metrics)

    def _check_evaluation(self, metrics: dict) -> None:
        """Say once when an evaluation cannot mean much: it holds one class (or misses classes), or a metric's
        chance level is 50% or more (a retrieval among too few candidates), as a small or class-sorted
        --max_eval_samples gives."""
        if self.warned_evaluation:
            return
        problems = []
        if self.recorder.classes is not None:
            present, total = self.recorder.classes
            if present < total:
                problems.append(f"it holds {'a single class' if present == 1 else f'only {present} classes'} of the "
                                f"model's {total}: accuracy and F1 on it say little, per-class metrics of the "
                                "missing classes are undefined")
        chance = {k: v for k, v in metrics.items() if "chance" in k and isinstance(v, (int, float)) and v >= 0.5}
        if chance:
            problems.append("chance level is 50% or more (" + ", ".join(f"{k} {v:.0%}" for k, v in chance.items())
                            + "): too few candidates for those metrics to mean anything")
        if problems:
            self.warned_evaluation = True
            samples = metrics.get("eval_samples")
            what = f"the evaluation ({int(samples)} samples)" if isinstance(samples, (int, float)) else "the evaluation"
            self.session.log.warn(f"{what}: " + "; ".join(problems) + ". Evaluate on more samples (--max_eval_samples "
                                  "draws a seeded, stratified subset) or a larger validation split.")

    def on_train_end(self, state, metrics: dict) -> None:
        self._check_evaluation(metrics)
        if self.overfit:
            self.overfit.on_train_end(state, metrics)
        if not self.main:
            return
        report = self.out / REPORT_DIR
        info_path = report / "run_info.json"
        info = json.loads(info_path.read_text()) if info_path.exists() else {}
        info.update(finished_at=_now(), wall_seconds=round(time.time() - self.started, 3), final_step=state.step)
        report.mkdir(parents=True, exist_ok=True)
        info_path.write_text(json.dumps(info, indent=2))
        # the confusion matrix of the weights saved as the final model: the average's with --save_ema_as_final
        recorder = self.recorder.average if self.config.save_ema_as_final and self.recorder.average else self.recorder
        if recorder.confusion is not None:
            names = _class_names(self.accelerator.unwrap_model(self.model), recorder.metrics_fn,
                                 len(recorder.confusion))
            (report / "confusion_matrix.json").write_text(
                json.dumps({"labels": names, "matrix": recorder.confusion.tolist(),
                            "weights": "weight average" if recorder is not self.recorder else "live"}))
        if self.config.run_report:
            try:
                path = write_report(self.out, results=metrics)
                self._say(f"run report: {path}")
            except Exception as err:  # the run's results are saved; a plotting failure must not lose them
                self._say(f"warning: the run report failed ({type(err).__name__}: {err}); rebuild it with "
                          f"`accel-train report {self.out}`.")

    def run_info(self, state) -> dict[str, Any]:
        """Hardware, software, topology, precision and the plan of this run (report/run_info.json)."""
        import accelerate
        import transformers

        acc = self.accelerator
        bare = acc.unwrap_model(self.model)
        hardware: dict[str, Any] = {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                                    "device": str(acc.device)}
        if torch.cuda.is_available():
            hardware["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            hardware["gpu_memory_gb"] = round(torch.cuda.get_device_properties(acc.device).total_memory / 2**30, 1)
        return {
            "started_at": _now(), "resumed_from_step": state.step,
            "world_size": acc.num_processes, "distributed_type": acc.distributed_type.value,
            "mixed_precision": acc.mixed_precision, "precision": precision_in_effect(acc),
            "hardware": hardware,
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "accelerate": accelerate.__version__, "transformers": transformers.__version__,
                         "accel_train": metadata.version("accel_train")},
            "model": {"class": type(bare).__name__, "parameters": sum(parameter_numel(p) for p in bare.parameters()),
                      "trainable": sum(parameter_numel(p) for p in bare.parameters() if p.requires_grad)},
            "plan": asdict(self.session.plan), "num_train_samples": dataset_size(self.session.train_loader),
            "preflight_seconds": round(self.preflight.seconds, 3) if self.preflight else None,
        }


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")


def _class_names(model, metrics_fn, classes: int) -> list[str]:
    """The metrics function's class names (accel_train.tasks.vision's ClassificationMetrics), else the model's id2label,
    else the class indices."""
    named = list(getattr(metrics_fn, "class_names", None) or [])
    if len(named) == classes:
        return [str(n) for n in named]
    id2label = getattr(getattr(model, "config", None), "id2label", None) or {}
    names = [id2label.get(i, id2label.get(str(i))) for i in range(classes)]
    return [str(n) if n is not None else str(i) for i, n in enumerate(names)]
