"""The loss contract and evaluation on gathered predictions.

A loss function returns a scalar tensor or a mapping with "loss" (see `as_loss_output`). `evaluate_model` runs
it on every evaluation batch, gathers what it returns from every process with `gather_for_metrics` (which drops
the samples the sampler duplicated to even out the last batch), and hands the concatenated tensors to a metrics
function. Every process gets the same numbers, so decisions taken on them (best model, early stopping) agree
across ranks.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator

from ..errors import DataError

MetricsFn = Callable[[dict[str, torch.Tensor]], Mapping[str, float]]


def default_loss(label_smoothing: float = 0.0) -> Callable:
    """Loss for models that take the batch as keyword arguments (transformers): the model's own loss, or
    cross-entropy with label smoothing on its logits."""

    def loss_fn(model, batch):
        labels = batch.get("labels")
        classification = labels is not None and not labels.is_floating_point() and labels.ndim == 1
        if label_smoothing and classification:
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
            per_sample = torch.nn.functional.cross_entropy(
                logits.float(), labels, label_smoothing=label_smoothing, reduction="none"
            )
            return {"loss": per_sample.mean(), "per_sample_loss": per_sample, "logits": logits}
        out = model(**batch)
        result = {"loss": out.loss, "logits": out.logits}
        if classification and out.logits.ndim == 2 and out.logits.shape[-1] > 1:
            result["per_sample_loss"] = torch.nn.functional.cross_entropy(
                out.logits.detach().float(), labels, reduction="none"
            )
        return result

    return loss_fn


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
def gather_outputs(accelerator: Accelerator, model: torch.nn.Module, loader,
                   step_fn: Callable) -> dict[str, torch.Tensor]:
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
    metrics_fn: MetricsFn | None = None,
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


def confusion_matrix(labels, predictions, num_classes: int) -> np.ndarray:
    """Counts [true class, predicted class] over 0..num_classes-1; labels outside that range are left out."""
    labels = torch.as_tensor(labels).long().reshape(-1).cpu()
    predictions = torch.as_tensor(predictions).long().reshape(-1).cpu()
    keep = (labels >= 0) & (labels < num_classes) & (predictions >= 0) & (predictions < num_classes)
    pairs = labels[keep] * num_classes + predictions[keep]
    return torch.bincount(pairs, minlength=num_classes**2).reshape(num_classes, num_classes).numpy()
