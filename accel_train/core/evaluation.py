"""Evaluation on gathered predictions.

`evaluate_model` runs the loss function (loss.py has the contract) on every evaluation batch, gathers what it
returns from every process with `gather_for_metrics` (which drops the samples the sampler duplicated to even out
the last batch), and hands the concatenated tensors to a metrics function. Every process gets the same numbers, so
decisions taken on them (best model, early stopping) agree across ranks.

`gather_for_metrics` knows where the last batch is from the loader Accelerate is iterating. A loader it did not
prepare is not tracked: inside a training loop at the last batch of a prepared training loader, it would cut every
evaluation batch to that loader's remainder (a Trainer's evaluation at its last step scored 32 of 200 items). Such a
loader is evaluated whole on one process, and refused on several (each would evaluate every item).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.data_loader import DataLoaderStateMixin
from accelerate.utils import gather_object

from ..config import TrainConfig
from ..errors import ConfigError, DataError, MetricsError
from .accelerator import precision_in_effect
from .data import dataset_size, take_examples, take_real_tokens
from .loss import as_loss_output, batch_size_of, tuple_target
from .seeding import seeded_generator

MetricsFn = Callable[[dict[str, torch.Tensor]], Mapping[str, float]]
EVAL_DRAWS = -1  # the counter of the evaluation loaders' generator (a generator object of their own)
LOSS_METRICS = ("eval_loss", "eval_perplexity", "eval_items", "eval_samples")  # what evaluate_model reports itself


def check_monitored_metric(config: TrainConfig, metrics_fn: MetricsFn | None, has_eval_loader: bool) -> None:
    """Refuse, before training, a --metric_for_best_model that no evaluation will report (it would fail at the first
    evaluation, an epoch in). Checked where the names are known: without a metrics function (only the loss entries),
    or with one that lists what it returns in a `metric_names` attribute."""
    name = config.best_metric_name
    if name is None or not has_eval_loader or (metrics_fn is not None and not hasattr(metrics_fn, "metric_names")):
        return
    known = [*LOSS_METRICS, *(metric_name(n, "eval") for n in getattr(metrics_fn, "metric_names", ()))]
    if config.ema_decay:  # the average is evaluated beside the live weights: eval_ema_*
        known += [metric_name(n, "eval_ema") for n in known]
    if name not in known:
        raise ConfigError(f"--metric_for_best_model {config.metric_for_best_model}: the evaluations of this run "
                          f"report only {', '.join(known)}; choose one of them.")


@torch.no_grad()
def gather_outputs(accelerator: Accelerator, model: torch.nn.Module, loader,
                   step_fn: Callable) -> dict[str, torch.Tensor]:
    """Run `step_fn(model, batch) -> dict` over `loader` in eval mode and gather every per-sample tensor from
    every process, in dataset order, without the duplicates that even out the last batch. Per-token tensors
    whose length differs between batches or processes (dynamic padding) are padded at the end of dim 1: integer
    ones with -100 (the ignore index), float ones with NaN. A loader Accelerate did not prepare: its batches as they
    are on one process, a ConfigError on several (module docstring)."""
    prepared = check_prepared(accelerator, loader)
    was_training = model.training
    model.eval()
    collected: dict[str, list[torch.Tensor]] = defaultdict(list)
    for batch in loader:
        out = step_fn(model, batch)
        n = batch_size_of(batch)
        labels = batch.get("labels") if isinstance(batch, Mapping) else tuple_target(batch)
        if labels is not None and "labels" not in out:  # a tuple batch's target, as a dict's labels
            out["labels"] = labels
        tensors = {k: v.detach() for k, v in sorted(out.items())
                   if isinstance(v, torch.Tensor) and v.ndim > 0 and v.shape[0] == n}
        if accelerator.num_processes > 1:  # collective, the same keys in the same order on every rank
            tensors = {k: accelerator.pad_across_processes(v, dim=1, pad_index=_pad_value(v)) if v.ndim > 1 else v
                       for k, v in tensors.items()}
        for key, value in (accelerator.gather_for_metrics(tensors) if prepared else tensors).items():
            collected[key].append(value.cpu())
    model.train(was_training)
    if not collected:
        raise DataError("the evaluation data loader is empty: check the validation split or file.")
    return {key: _cat_padded(values) for key, values in collected.items()}


def check_prepared(accelerator: Accelerator, loader) -> bool:
    """Whether `loader` came from accelerator.prepare (on XLA wrapped once more); a ConfigError where it did not
    and several processes would each evaluate every item."""
    prepared = isinstance(getattr(loader, "_loader", loader), DataLoaderStateMixin)
    if not prepared and accelerator.num_processes > 1:
        raise ConfigError(f"evaluation on {accelerator.num_processes} processes with a {type(loader).__name__} that "
                          "accelerator.prepare did not shard: every process would evaluate every item, and the "
                          "duplicates that even out the last batch could not be told apart. Pass a "
                          "torch.utils.data.DataLoader (train() prepares it), or accelerator.prepare(loader) to "
                          "evaluate_model.")
    return prepared


def evaluation_setup(accelerator: Accelerator, loader) -> list:
    """What tells one evaluation of the same weights from another: [processes, the evaluation batch of all processes,
    the evaluation examples, the precision in effect]. Saved with a checkpoint's last evaluation: a run resumed at its
    last step reuses that evaluation only where its own would be this one (core/results.py)."""
    return [accelerator.num_processes, getattr(loader, "total_batch_size", None), dataset_size(loader),
            precision_in_effect(accelerator)]


def prepare_for_evaluation(accelerator: Accelerator, loader, seed: int = 0):
    """accelerator.prepare(loader) (None stays None), refused before training rather than at the first evaluation
    where it would not be sharded (`check_prepared`: an iterable that is not a DataLoader comes back unchanged), or
    where it is a stream on several processes (no exact, once-each evaluation of it exists there).

    A DataLoader without a generator of its own draws its workers' base seed from torch's global generator at every
    iter(): each evaluation would move every later dropout mask of training, so how often a run is evaluated would
    change what it trains. Such a loader gets a generator of (seed, EVAL_DRAWS), held for the run (a shuffled one's
    RandomSampler gets a generator of its own from accelerator.prepare): it still draws anew at each evaluation (a
    second evaluation that depends on its draws gives other numbers, as verify checks). Not checkpointed: after a
    resume, random transforms in evaluation workers draw other numbers than the uninterrupted run's (training's are
    unaffected)."""
    if loader is None:
        return None
    if accelerator.num_processes > 1 and isinstance(getattr(loader, "dataset", None), torch.utils.data.IterableDataset):
        raise ConfigError(f"the evaluation set is a stream (an iterable dataset) on {accelerator.num_processes} "
                          "processes: each reads its own part, of a length no process knows, so the processes would "
                          "reach the gather of a batch the others never have (a hang), or count the items that fill "
                          "the last round twice. Evaluate a map-style dataset (a stream's first N items: "
                          "datasets.Dataset.from_list(list(stream.take(N)))), or on one process.")
    prepared = accelerator.prepare(loader)
    check_prepared(accelerator, prepared)
    drawing = getattr(prepared, "base_dataloader", prepared)  # the DataLoader that draws, under Accelerate's wrapper
    if isinstance(drawing, torch.utils.data.DataLoader) and drawing.generator is None:
        drawing.generator = seeded_generator(seed, EVAL_DRAWS)
    return prepared


def _pad_value(tensor: torch.Tensor):
    return float("nan") if tensor.is_floating_point() else -100


def _cat_padded(values: list[torch.Tensor]) -> torch.Tensor:
    longest = max(v.shape[1] for v in values) if values[0].ndim > 1 else None
    if longest is not None:
        values = [torch.nn.functional.pad(v, (0, 0) * (v.ndim - 2) + (0, longest - v.shape[1]), value=_pad_value(v))
                  for v in values]
    return torch.cat(values)


def evaluate_model(
    accelerator: Accelerator,
    model: torch.nn.Module,
    loader,
    loss_fn: Callable,
    metrics_fn: MetricsFn | None = None,
    prefix: str = "eval",
) -> dict[str, float]:
    """The loss over the whole evaluation set (exact under N processes) plus `metrics_fn` on the gathered
    outputs: the mean over samples for mean losses; for sums, Σ sums / Σ items over the set, with the perplexity
    exp(loss) beside it."""
    outputs = gather_outputs(accelerator, model, loader, lambda m, batch: loss_outputs(loss_fn, m, batch))
    if "num_items" in outputs:
        samples = len(outputs["num_items"])
        items = outputs.pop("num_items").sum().item()
        loss = outputs.pop("loss_sum").sum().item() / items if items else math.nan
        metrics = {f"{prefix}_loss": loss, f"{prefix}_perplexity": math.exp(min(loss, 700.0)),
                   f"{prefix}_items": items}
    else:
        losses = outputs.pop("per_sample_loss")
        metrics = {f"{prefix}_loss": losses.mean().item()}
        samples = losses.numel()
    metrics[f"{prefix}_samples"] = float(samples)
    if metrics_fn is not None:
        metrics.update(agreed_metrics(accelerator, metrics_fn, outputs, prefix))
    return metrics


def agreed_metrics(accelerator: Accelerator, metrics_fn: MetricsFn, outputs: dict[str, torch.Tensor],
                   prefix: str) -> dict[str, float]:
    """`metrics_fn` on the gathered outputs, its values as numbers. A failure on any process is a MetricsError on
    every process (one gather of each process's error or None): a process that went on to the next collective while
    another raised would wait forever for it."""
    failure: Exception | None = None
    try:
        values = {metric_name(key, prefix): one_number(key, value) for key, value in metrics_fn(outputs).items()}
    except Exception as err:  # noqa: BLE001 - raised below, on every process alike
        failure = err
    said = None if failure is None else f"{type(failure).__name__}: {failure}"
    told = gather_object([said]) if accelerator.num_processes > 1 else [said]
    if all(t is None for t in told):
        return values
    own = getattr(metrics_fn, "metrics_fn", metrics_fn)  # the user's, inside train()'s confusion recorder
    name = getattr(own, "__qualname__", None) or type(own).__name__
    ranks = [rank for rank, t in enumerate(told) if t is not None]
    where = f" on process(es) {ranks}" if len(told) > 1 else ""
    cause = said or told[ranks[0]]
    raise MetricsError(f"the metrics function {name} failed{where} in the {prefix} evaluation ({cause}).") from failure


def loss_outputs(loss_fn: Callable, model: torch.nn.Module, batch) -> dict[str, torch.Tensor]:
    """What one evaluation batch contributes: the loss function's per-sample tensors, with the loss per sample
    ("per_sample_loss", or "loss_sum" and "num_items" for sums); a per_sample_loss of the wrong length is refused."""
    take_real_tokens(batch)  # a packed batch's token count is no model input
    take_examples(batch, 0)  # nor its count of examples
    out = as_loss_output(loss_fn(model, batch), loss_fn)
    n = batch_size_of(batch)
    if "items" in out:  # sums: per sample where given, else the batch's shared equally by its samples
        sums, items = out.pop("loss_sum"), out.pop("num_items")
        per_sample = isinstance(items, torch.Tensor) and sums.ndim == 1 and items.ndim == 1
        out["loss_sum"] = sums.detach().float() if per_sample else out["objective"].detach().float().expand(n) / n
        out["num_items"] = items.float() if per_sample else out["items"].expand(n) / n
    else:
        # Per-sample losses make eval_loss exact under N processes: gathering drops the samples the sampler
        # duplicated to even out the last batch. Without them the batch mean stands for each sample (exact
        # except in that last, padded batch).
        per_sample = out.pop("per_sample_loss", None)
        if per_sample is not None and tuple(per_sample.shape) != (n,):
            raise ConfigError(f"loss_fn returned per_sample_loss of shape {tuple(per_sample.shape)} for a batch of "
                              f"{n} samples: it must hold one loss per sample, shape ({n},) (e.g. "
                              "cross_entropy(..., reduction='none'), averaged over each sample's tokens).")
        mean = out["loss"].detach().float().reshape(1).expand(n)
        out["per_sample_loss"] = per_sample.float() if per_sample is not None else mean
    for key in ("loss", "objective", "items", "log"):
        out.pop(key, None)
    return out


def one_number(key: str, value) -> float:
    """A metric's value as a float; a vector, a string or None is refused naming the metric."""
    shape = tuple(value.shape) if hasattr(value, "shape") else None
    if shape not in (None, (), (1,)) or isinstance(value, (str, bytes)) or value is None:
        raise ConfigError(f"metrics_fn returned {key!r} = {type(value).__name__}"
                          f"{f' of shape {shape}' if shape else ''}: each metric must be one number (a float or a "
                          f"0-d tensor). Return per-class values under names of their own ({key}_0, {key}_1, ...).")
    try:
        return float(value)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"metrics_fn returned {key!r} = {value!r}, which is not a number ({err}).") from None


def metric_name(key: str, prefix: str) -> str:
    """A metric's name in an evaluation under `prefix`: "accuracy", "eval_accuracy" -> "<prefix>_accuracy" (a metrics
    function that names its results for the evaluation split keeps their names under another prefix: eval_ema_rouge1,
    test_rouge1, not eval_ema_eval_rouge1)."""
    return f"{prefix}_{key.removeprefix(f'{prefix}_').removeprefix('eval_')}"


def confusion_matrix(labels, predictions, num_classes: int) -> np.ndarray:
    """Counts [true class, predicted class] over 0..num_classes-1; labels outside that range are left out."""
    labels = torch.as_tensor(labels).long().reshape(-1).cpu()
    predictions = torch.as_tensor(predictions).long().reshape(-1).cpu()
    keep = (labels >= 0) & (labels < num_classes) & (predictions >= 0) & (predictions < num_classes)
    pairs = labels[keep] * num_classes + predictions[keep]
    return torch.bincount(pairs, minlength=num_classes**2).reshape(num_classes, num_classes).numpy()
