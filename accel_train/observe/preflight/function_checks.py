"""The pre-flight check of the user's functions: `loss_fn` and `metrics_fn` run on the first training samples before
the first step, so that a wrong return is named before training, not an epoch in.

* the loss: an exception, a result outside the loss contract (core/loss.py), a loss that is not one number, a
  non-finite loss, or a per_sample_loss of the wrong length is an **error** naming the function, the batch's
  structure and what it returned;
* the metrics, on that one batch's evaluation outputs: a metric that is not one number (a vector, a string) or a
  result that is not a mapping is an **error**; an exception is a **warning** (a metric can legitimately need more
  than one batch: every class, several samples), with its message.

Both run in evaluation mode (no dropout: no random number drawn), on the model Accelerate prepared, under its
autocast; the loss keeps its graph (a loss may take gradients itself), which is dropped before training.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from accelerate.utils import send_to_device
from torch.utils.data import IterableDataset

from ...core.accelerator import holds_whole_model
from ...core.evaluation import LOSS_METRICS, loss_outputs, metric_name, one_number
from ...core.guard import fetch_batch
from ...core.loss import as_loss_output, tuple_target
from ...errors import ConfigError
from .findings import Finding, loader_batch


def structure(value: Any, depth: int = 0) -> str:
    """A batch or a result in a few words: dict(x: float32[8, 4], labels: int64[8]), tuple(float32[8, 4], ...)."""
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if depth > 1:
        return type(value).__name__
    if isinstance(value, Mapping):
        return "dict(" + ", ".join(f"{k}: {structure(v, depth + 1)}" for k, v in list(value.items())[:8]) + ")"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}(" + ", ".join(structure(v, depth + 1) for v in value[:8]) + ")"
    return f"{type(value).__name__} {value!r}"[:80]


def name_of(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def check_functions(f) -> list[Finding]:
    loader = f.train_loader
    if isinstance(loader.dataset, IterableDataset) or not holds_whole_model(f.accelerator):
        return [Finding("functions", "ok", "loss_fn and metrics_fn not run before training (a stream, or a sharded "
                        "model): the first step runs them.")]
    if getattr(f.loss_fn, "hooks", ()):
        return [Finding("functions", "ok", "loss_fn and metrics_fn not run before training: the loss declares hooks "
                        "(its state comes from the run, set from on_train_start); the first step runs them.")]
    size = min(loader_batch(loader) or 1, len(loader.dataset))
    batch = send_to_device(fetch_batch(loader, list(range(size))), f.accelerator.device)  # no sampler, no RNG
    model = f.accelerator.unwrap_model(f.model)
    was_training = model.training
    model.eval()
    try:
        with f.accelerator.autocast():
            out = _loss_findings(f.loss_fn, model, batch)
            evaluated = f.eval_loader is not None or f.final_eval_loaders
            if not any(x.level == "error" for x in out) and evaluated and f.declared_metrics:
                with torch.no_grad():
                    out += _metric_findings(f, model, batch)
    finally:
        model.train(was_training)
    return out


def _loss_findings(loss_fn, model, batch) -> list[Finding]:
    name, shape = name_of(loss_fn), structure(batch)
    fix = "make loss_fn(model, batch) return the micro-batch's mean loss as a 0-d tensor (or a mapping with 'loss')."
    try:
        raw = loss_fn(model, batch)
    except Exception as err:  # noqa: BLE001 - named with the batch it failed on
        return [Finding("functions", "error", f"the loss function {name} raised {type(err).__name__}: {err} on the "
                        f"first training batch, {shape}.", "fix the loss for batches of this structure (a tuple "
                        "batch is (inputs..., targets): model(*batch[:-1]), targets batch[-1]).")]
    try:
        result = as_loss_output(raw, loss_fn)
    except TypeError as err:
        return [Finding("functions", "error", f"{str(err).rstrip('.')} (on the first training batch, {shape}; it "
                        f"returned {structure(raw)}).", fix)]
    loss = result["loss"]
    if loss.numel() != 1:
        return [Finding("functions", "error", f"the loss function {name} returned a loss of shape "
                        f"{list(loss.shape)} on the first training batch, {shape}: the optimizer steps on one number.",
                        "reduce it: .mean() over the micro-batch (per-sample values go under 'per_sample_loss').")]
    if not math.isfinite(float(loss.detach().float())):
        return [Finding("functions", "error", f"the loss function {name} returned {float(loss.detach())} on the first "
                        f"training batch, {shape}, before any update.", "look for a log of 0, a division by a zero "
                        "count, or inputs that hold NaN.")]
    value = float(loss.detach())
    return [Finding("functions", "ok", f"the loss function {name} returned a finite loss ({value:.4g}) on the first "
                    f"training batch, {shape}.")]


def _metric_findings(f, model, batch) -> list[Finding]:
    name = name_of(f.declared_metrics)
    try:
        outputs = loss_outputs(f.eval_loss_fn, model, batch)
    except ConfigError as err:  # a per_sample_loss of the wrong length, named by loss_outputs
        return [Finding("functions", "error", f"evaluating the first training batch: {err}", "fix the evaluation "
                        "loss's per-sample outputs.")]
    except Exception as err:  # noqa: BLE001 - a training batch may differ from an evaluation batch: not proven wrong
        return [Finding("functions", "warning", f"the evaluation loss could not run on the first training batch "
                        f"({type(err).__name__}: {err}); the metrics were not checked.", "if evaluation batches "
                        "differ from training batches, ignore this; else fix the evaluation loss.")]
    labels = batch.get("labels") if isinstance(batch, Mapping) else tuple_target(batch)
    if labels is not None and "labels" not in outputs:
        outputs["labels"] = labels
    try:
        metrics = f.declared_metrics(outputs)
    except Exception as err:  # noqa: BLE001 - may need more than one batch (every class): a warning
        return [Finding("functions", "warning", f"the metrics function {name} raised {type(err).__name__}: {err} on "
                        f"one batch's evaluation outputs, {structure(outputs)}.", "if it needs more than one batch "
                        "(every class present), ignore this; else fix it before the first evaluation.")]
    if not isinstance(metrics, Mapping):
        return [Finding("functions", "error", f"the metrics function {name} returned {structure(metrics)}, not a "
                        "mapping of names to numbers.", "return {'accuracy': 0.9, ...}.")]
    try:
        for key, value in metrics.items():
            one_number(key, value)
    except Exception as err:  # noqa: BLE001 - a vector or a string, named by one_number
        return [Finding("functions", "error", f"{str(err).rstrip('.')} (the metrics function {name}, on one batch's "
                        "evaluation outputs).", "return one number per name.")]
    watched = f.config.best_metric_name if f.eval_loader is not None else None
    reported = [*LOSS_METRICS, *(metric_name(key, "eval") for key in metrics)]
    reported += [metric_name(key, "eval_ema") for key in reported] if f.config.ema_decay else []
    if watched and watched not in reported:  # a warning: a name may need more than one batch (a class present)
        return [Finding("functions", "warning", f"--metric_for_best_model {watched} (best model, early stopping, a "
                        f"plateau schedule) is not among what the metrics function {name} returned on one batch's "
                        f"evaluation outputs ({', '.join(reported)}): the first evaluation would stop the run.",
                        "set --metric_for_best_model to one of them, or return it from the metrics function.")]
    return [Finding("functions", "ok", f"the metrics function {name} returned {len(metrics)} number(s) on one "
                    "batch's evaluation outputs.")]
