"""Evaluation on gathered predictions, and metric loading with `evaluate` (offline).

`evaluate_model` runs the loss function on every evaluation batch, gathers what it returns from every
process with `gather_for_metrics` (which drops the samples the sampler duplicated to even out the last
batch), and hands the concatenated tensors to a metrics function. Every process gets the same numbers,
so decisions taken on them (best model, early stopping) agree across ranks.

The `evaluate` metric modules the recipes use ship inside this package (`accel_train/metric_modules/`) and
load by path, so no Hub access is needed; any other name is passed to `evaluate.load` unchanged.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch
from accelerate import Accelerator

from .errors import DataError

MetricsFn = Callable[[dict[str, torch.Tensor]], Mapping[str, float]]
METRIC_MODULES = Path(__file__).parent / "metric_modules"
METRIC_DIRS = (METRIC_MODULES, Path(__file__).parent / "tasks" / "metric_modules")  # text generation's live in tasks/


def shipped_metrics() -> list[str]:
    return sorted(p.name for d in METRIC_DIRS for p in d.iterdir() if (p / f"{p.name}.py").is_file())


def load_metric(name: str, **kwargs):
    """`evaluate.load` for a metric shipped with accel_train (offline) or any other name/path (may need the Hub)."""
    import evaluate

    local = next((d / name / f"{name}.py" for d in METRIC_DIRS if (d / name / f"{name}.py").is_file()), None)
    return evaluate.load(str(local) if local else name, **kwargs)


def batch_size_of(batch: Any) -> int:
    """The leading dimension of the first tensor in a batch (dict, list/tuple or tensor)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, Mapping) else batch
    for value in values:
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            return value.shape[0]
        if isinstance(value, (Mapping, list, tuple)):
            return batch_size_of(value)
    raise ValueError("cannot find the batch size: the batch holds no tensor")


def as_loss_output(output: Any) -> dict[str, Any]:
    """The loss contract: a loss function returns a scalar tensor or a mapping with a 'loss' entry."""
    if isinstance(output, torch.Tensor):
        return {"loss": output}
    if isinstance(output, Mapping) and "loss" in output:
        return dict(output)
    raise TypeError(
        "a loss function must return a scalar tensor or a mapping with a 'loss' key, "
        f"got {type(output).__name__}"
    )


@torch.no_grad()
def gather_outputs(accelerator: Accelerator, model: torch.nn.Module, loader, step_fn: Callable) -> dict[str, torch.Tensor]:
    """Run `step_fn(model, batch) -> dict` over `loader` in eval mode and gather every per-sample tensor from
    every process, in dataset order, without the duplicates that even out the last batch."""
    was_training = model.training
    model.eval()
    collected: dict[str, list[torch.Tensor]] = defaultdict(list)
    for batch in loader:
        out = step_fn(model, batch)
        n = batch_size_of(batch)
        if isinstance(batch, Mapping) and "labels" in batch and "labels" not in out:
            out["labels"] = batch["labels"]
        tensors = {k: v.detach() for k, v in out.items()
                   if isinstance(v, torch.Tensor) and v.ndim > 0 and v.shape[0] == n}
        for key, value in accelerator.gather_for_metrics(tensors).items():
            collected[key].append(value.cpu())
    model.train(was_training)
    if not collected:
        raise DataError("the evaluation data loader is empty: check the validation split or file.")
    return {key: torch.cat(values) for key, values in collected.items()}


def evaluate_model(
    accelerator: Accelerator,
    model: torch.nn.Module,
    loader,
    loss_fn: Callable,
    metrics_fn: Optional[MetricsFn] = None,
    prefix: str = "eval",
) -> dict[str, float]:
    """Mean loss over all samples (exact under N processes) plus `metrics_fn` on the gathered outputs."""

    def step(model, batch):
        out = as_loss_output(loss_fn(model, batch))
        # Per-sample losses make eval_loss exact under N processes: gathering drops the samples the sampler
        # duplicated to even out the last batch. Without them the batch mean stands for each sample (exact
        # except in that last, padded batch).
        mean = out.pop("loss").detach().float().reshape(1).expand(batch_size_of(batch))
        per_sample = out.pop("per_sample_loss", None)
        out["loss"] = per_sample.float() if per_sample is not None else mean
        return out

    outputs = gather_outputs(accelerator, model, loader, step)
    losses = outputs.pop("loss")
    metrics = {f"{prefix}_loss": losses.mean().item(), f"{prefix}_samples": float(losses.numel())}
    if metrics_fn is not None:
        for key, value in metrics_fn(outputs).items():
            name = key if key.startswith(f"{prefix}_") else f"{prefix}_{key}"
            metrics[name] = float(value)
    return metrics
