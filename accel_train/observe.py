"""The run's observability, as one built-in hook of the loop plus the opt-in diagnostics session.

    Observer.start(...)  before step 0: the pre-flight check (refuses a broken run before anything is written)
    on_train_start       run facts (report/run_info.json), the findings, the simulated schedule and its plot
    observer.diagnose()  the diagnostics session around the loop (None, and free, when no flag asks for one)
    on_train_end         the overfit verdict, then report.md and its plots (main process)

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
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from .diagnostics import (LOCAL_GRADIENTS, ActivationStats, _profiler_schedule, flag_layers, layer_grad_norms,
                          memory_breakdown)
from .overfit import OverfitCheck
from .preflight import PreflightResult, run_preflight
from .runtime import precision_in_effect
from .tracking import _truncate_history

REPORT_DIR, DIAGNOSTICS_DIR, PROFILER_DIR = "report", "diagnostics", "profiler"
MAX_CONFUSION_CLASSES = 100


def _write(message: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(message)  # keeps the progress bar intact


class ConfusionRecorder:
    """Wraps a run's `metrics_fn`: every evaluation also keeps its confusion matrix when the outputs are a
    classification (2-D logits of at most 100 classes, 1-D integer labels). The metrics are the wrapped
    function's, unchanged."""

    def __init__(self, metrics_fn):
        self.metrics_fn = metrics_fn
        self.confusion: Optional[np.ndarray] = None

    def __call__(self, outputs: dict[str, torch.Tensor]):
        logits, labels = outputs.get("logits"), outputs.get("labels")
        if (isinstance(logits, torch.Tensor) and isinstance(labels, torch.Tensor) and logits.ndim == 2
                and 2 <= logits.shape[1] <= MAX_CONFUSION_CLASSES and labels.ndim == 1
                and not labels.is_floating_point() and len(labels) == len(logits)):
            classes = logits.shape[1]
            keep = (labels >= 0) & (labels < classes)
            pairs = labels[keep].long() * classes + logits[keep].argmax(-1).long()
            self.confusion = torch.bincount(pairs.cpu(), minlength=classes**2).reshape(classes, classes).numpy()
        return self.metrics_fn(outputs) if self.metrics_fn is not None else {}


class Observer:
    """Pre-flight, run facts, overfit check and report for one run (see the module docstring)."""

    def __init__(self, accelerator, config, plan, model, optimizer, metrics_fn, preflight: Optional[PreflightResult],
                 num_train_samples: Optional[int]):
        self.accelerator, self.config, self.plan = accelerator, config, plan
        self.model, self.optimizer = model, optimizer
        self.recorder = ConfusionRecorder(metrics_fn)
        self.preflight = preflight
        self.overfit = OverfitCheck(config, write=self._say) if config.overfit_batches else None
        self.out = Path(config.output_dir)
        self.main = accelerator.is_main_process
        self.num_train_samples = num_train_samples
        self.started = time.time()

    @classmethod
    def start(cls, accelerator, config, plan, model, optimizer, scheduler, train_loader, eval_loader, loss_fn,
              metrics_fn) -> "Observer":
        """Run the pre-flight check (unless --no_preflight): raises `ConfigError` on any error, writes nothing."""
        preflight = (run_preflight(accelerator, config, plan, model, optimizer, scheduler, train_loader, eval_loader,
                                   loss_fn) if config.preflight else None)
        try:
            samples = len(train_loader.dataset)
        except (TypeError, AttributeError):
            samples = None
        return cls(accelerator, config, plan, model, optimizer, metrics_fn, preflight, samples)

    @property
    def metrics_fn(self) -> ConfusionRecorder:
        """The metrics function the loop should use: the run's, recording confusion matrices on the way."""
        return self.recorder

    def _say(self, message: str) -> None:
        if self.main:
            _write(message)

    def diagnose(self, step: int):
        """The diagnostics session to enter around the loop, or a context yielding None when none is asked."""
        if not Diagnostics.wanted(self.config):
            return contextlib.nullcontext(None)
        return Diagnostics(self.accelerator, self.config, self.model, self.optimizer, step)

    # ----------------------------------------------------------------------------------------- hook methods
    def on_train_start(self, state) -> None:
        if not self.main:
            return
        if not self.config.resume_from_checkpoint:  # a fresh run: no report or diagnostics of an older one
            for name in ("report.md", REPORT_DIR, DIAGNOSTICS_DIR, PROFILER_DIR):
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
                from .report import plot_schedule

                plot_schedule(self.preflight.schedule, report / "lr_schedule.png", self.config.lr_scheduler_type)

    def on_log(self, state, logs) -> bool:
        return bool(self.overfit and self.overfit.on_log(state, logs))

    def on_train_end(self, state, metrics: dict) -> None:
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
        if self.recorder.confusion is not None:
            names = _class_names(self.accelerator.unwrap_model(self.model), self.recorder.metrics_fn,
                                 len(self.recorder.confusion))
            (report / "confusion_matrix.json").write_text(
                json.dumps({"labels": names, "matrix": self.recorder.confusion.tolist()}))
        if self.config.run_report:
            from .report import write_report

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

        from . import __version__

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
                         "accel_train": __version__},
            "model": {"class": type(bare).__name__, "parameters": sum(p.numel() for p in bare.parameters()),
                      "trainable": sum(p.numel() for p in bare.parameters() if p.requires_grad)},
            "plan": asdict(self.plan), "num_train_samples": self.num_train_samples,
            "preflight_seconds": round(self.preflight.seconds, 3) if self.preflight else None,
        }


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")


def _class_names(model, metrics_fn, classes: int) -> list[str]:
    """The metrics function's class names (accel_train.vision's ClassificationMetrics), else the model's id2label,
    else the class indices."""
    named = list(getattr(metrics_fn, "class_names", None) or [])
    if len(named) == classes:
        return [str(n) for n in named]
    id2label = getattr(getattr(model, "config", None), "id2label", None) or {}
    names = [id2label.get(i, id2label.get(str(i))) for i in range(classes)]
    return [str(n) if n is not None else str(i) for i, n in enumerate(names)]


class Diagnostics:
    """The opt-in diagnostics of one training session, entered around the loop. The loop calls
    `before_clip(step)` once the gradients of optimizer step `step` are complete, and `after_step(step)` once
    the step is taken. Gradient norms and activation statistics are recorded on the main process; every process
    writes its own profiler trace and memory snapshot."""

    def __init__(self, accelerator, config, model, optimizer, initial_step: int):
        self.acc, self.config, self.optimizer = accelerator, config, optimizer
        self.model = accelerator.unwrap_model(model)  # hooks and gradients of the bare model
        self.rank, self.main = accelerator.process_index, accelerator.is_main_process
        self.dir = Path(config.output_dir) / DIAGNOSTICS_DIR
        self.initial_step = initial_step
        self.local = accelerator.distributed_type.value in LOCAL_GRADIENTS
        self.activations = ActivationStats(self.model) if config.activation_stats_steps and self.main else None
        self.armed = False
        self.profiler = None
        self.cuda_history = False
        self.anomaly: Optional[bool] = None
        self.warned: set[tuple[str, str]] = set()
        self.grad_history: dict[str, list[float]] = {}  # RMS per layer: explosion is judged against the past

    @staticmethod
    def wanted(config) -> bool:
        return bool(config.grad_flow_steps or config.activation_stats_steps or config.profile_steps
                    or config.memory_snapshot_step or config.detect_anomaly)

    def __enter__(self) -> "Diagnostics":
        # Folders are made when first written to: the main process may still be clearing an older run's.
        if self.main and self.initial_step:  # resumed: drop what the interrupted run recorded after its checkpoint
            for name in ("grad_flow.jsonl", "activations.jsonl"):
                _truncate_history(self.dir / name, self.initial_step)
        if self.config.detect_anomaly:
            self.anomaly = torch.is_anomaly_enabled()
            torch.autograd.set_detect_anomaly(True)
        if self.config.profile_range and self.config.profile_range[1] > self.initial_step:
            self.profiler = self._profiler(*self.config.profile_range)
            self.profiler.start()
        if self.config.memory_snapshot_step > self.initial_step and self.acc.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self.cuda_history = True
        self._arm(self.initial_step + 1)
        if self.config.grad_flow_steps and not self.local and self.main:
            _write(f"note: --grad_flow_steps needs whole gradients on each process; under "
                   f"{self.acc.distributed_type.value} they are sharded, so no gradient flow is recorded.")
        return self

    def __exit__(self, *exc) -> bool:
        if self.profiler is not None:
            self.profiler.stop()
        if self.anomaly is not None:
            torch.autograd.set_detect_anomaly(self.anomaly)
        if self.cuda_history:
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.activations is not None:
            self.activations.collect()  # removes the hooks
        return False

    def _due(self, every: int, step: int) -> bool:
        return bool(every) and step % every == 0

    def _arm(self, step: int) -> None:
        if self.activations is not None and self._due(self.config.activation_stats_steps, step):
            self.activations.install()
            self.armed = True

    def before_clip(self, step: int) -> None:
        if self.main and self.local and self._due(self.config.grad_flow_steps, step):
            scaler = self.acc.scaler
            norms, sizes = layer_grad_norms(self.model, scaler.get_scale() if scaler is not None else 1.0)
            flags = flag_layers(norms, sizes, self.grad_history)
            self._append("grad_flow.jsonl", {"step": step, "norms": norms, "sizes": sizes, "flags": flags})
            self._warn(step, "gradient", flags)
        if self.armed:
            stats = self.activations.collect()
            self.armed = False
            flags = {"dead": [n for n, s in stats.items() if s["zero_fraction"] >= 0.99],
                     "nonfinite": [n for n, s in stats.items() if s["nonfinite_fraction"] > 0]}
            self._append("activations.jsonl", {"step": step, "stats": stats, "flags": flags})
            self._warn(step, "activation", flags)

    def after_step(self, step: int) -> None:
        if self.profiler is not None:
            self.profiler.step()
        if step == self.config.memory_snapshot_step:
            self._snapshot(step)
        self._arm(step + 1)

    def _append(self, name: str, record: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / name, "a") as fh:
            fh.write(json.dumps(record, default=lambda v: None) + "\n")

    def _warn(self, step: int, what: str, flags: dict[str, list[str]]) -> None:
        for kind, layers in flags.items():
            new = [n for n in layers if (kind, n) not in self.warned]
            self.warned.update((kind, n) for n in new)
            if new:
                _write(f"diagnostics, step {step}: {kind.replace('_', ' ')} {what}s in {len(new)} layer(s): "
                       f"{', '.join(new[:5])}{' ...' if len(new) > 5 else ''} (see report.md)")

    def _profiler(self, first: int, last: int):
        from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

        folder = Path(self.config.output_dir) / PROFILER_DIR
        trace = tensorboard_trace_handler(str(folder), worker_name=f"rank{self.rank}")
        offset = self.initial_step + 1  # profiler step n (ProfilerStep#n in the trace) is optimizer step n + offset

        def ready(prof) -> None:
            trace(prof)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            (folder / f"key_averages_rank{self.rank}.txt").write_text(
                f"optimizer steps {first}-{last}; ProfilerStep#n in the trace is optimizer step n + {offset}\n{table}")

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        return profile(activities=activities, schedule=_profiler_schedule(first, last, offset), on_trace_ready=ready,
                       record_shapes=True, profile_memory=True)

    def _snapshot(self, step: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"memory_step{step}_rank{self.rank}"
        record = {"step": step, "rank": self.rank, "device": str(self.acc.device),
                  **memory_breakdown(self.model, self.optimizer)}
        if self.cuda_history:
            torch.cuda.memory._dump_snapshot(str(path.with_suffix(".pickle")))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.cuda_history = False
            record["cuda_snapshot"] = path.with_suffix(".pickle").name
            record["gpu_peak_allocated_mb"] = round(torch.cuda.max_memory_allocated(self.acc.device) / 2**20, 1)
        else:
            record["note"] = ("CPU: PyTorch keeps no allocation history, so this is the breakdown by category and "
                              "the resident memory of the process; --profile_steps records memory per operator.")
        path.with_suffix(".json").write_text(json.dumps(record, indent=2))
        if self.main:
            _write(f"memory snapshot at step {step}: {path.with_suffix('.json')}"
                   + (f" and {path.with_suffix('.pickle').name} (open at pytorch.org/memory_viz)" if self.cuda_history
                      or "cuda_snapshot" in record else ""))
