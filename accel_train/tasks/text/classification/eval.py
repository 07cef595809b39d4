"""What the text-classification recipe measures: its metrics, the training batches' padding, and the test split's
predictions written with label names at the end of a run (the finish seam)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ....config import TrainConfig
from ....core.data import make_loader
from ....core.evaluation import gather_outputs
from ....rundir.layout import TEST_PREDICTIONS
from ...metrics import load_metric
from ..buckets import LengthBuckets, padded_batches_reason, round_up
from .data import Labels, padding_ratio


def classification_metrics(labels: Labels):
    """Regression: mse / mae / pearson; classification: accuracy, macro and micro F1, precision, recall, MCC (and
    binary F1 for two classes), from the shipped evaluate modules. Each lists what it returns (`metric_names`), so a
    --metric_for_best_model it never reports is refused before training, not at the first evaluation."""
    if labels.is_regression:
        def regression(outputs):
            pred, ref = outputs["logits"].float().squeeze(-1).numpy(), outputs["labels"].float().numpy()
            return {"mse": float(np.mean((pred - ref) ** 2)), "mae": float(np.mean(np.abs(pred - ref))),
                    "pearson": float(np.corrcoef(pred, ref)[0, 1])}
        regression.metric_names = ("mse", "mae", "pearson")
        return regression
    modules = {name: load_metric(name) for name in ("accuracy", "f1", "precision", "recall", "matthews_correlation")}

    def classification(outputs):
        pred, ref = outputs["logits"].argmax(-1).tolist(), outputs["labels"].tolist()
        scores = modules["accuracy"].compute(predictions=pred, references=ref)
        for name in ("f1", "precision", "recall"):
            scores[name] = modules[name].compute(predictions=pred, references=ref, average="macro")[name]
        scores["f1_micro"] = modules["f1"].compute(predictions=pred, references=ref, average="micro")["f1"]
        if labels.num_labels == 2:
            scores["f1_binary"] = modules["f1"].compute(predictions=pred, references=ref, average="binary")["f1"]
        scores.update(modules["matthews_correlation"].compute(predictions=pred, references=ref))
        return scores
    classification.metric_names = ("accuracy", "f1", "precision", "recall", "f1_micro",
                                   *(["f1_binary"] if labels.num_labels == 2 else []), "matthews_correlation")
    return classification


def loader_lengths(lengths: Sequence[int], config: TrainConfig, group_by_length: bool, pad_to: int | None,
                   multiple: int | None, buckets: LengthBuckets | None = None) -> list[int] | None:
    """The lengths make_loader plans the training batches with: the widths the collator pads each example to with
    --max_tokens_per_batch (`pad_to` a static width, a length bucket's, a multiple's: the budget bounds what is
    padded); the real lengths when length-grouped; else None."""
    if config.max_tokens_per_batch:
        return [pad_to or (buckets.width(n) if buckets else round_up(n, multiple)) for n in lengths]
    return list(lengths) if group_by_length else None


def fixed_batches_reason(args) -> str | None:
    """Why this run trains on batches of --per_device_train_batch_size examples rather than the recipe's default
    token budget (core/token_batches.py: default_budget), or None."""
    if args.pad_to_max_length:
        return "--pad_to_max_length pads every row to --max_seq_length"
    return padded_batches_reason(args.length_buckets, args.group_by_length)


def train_padding(lengths: Sequence[int], config: TrainConfig, loader: Any, group_by_length: bool,
                  pad_to: int | None, buckets: LengthBuckets | None = None) -> float:
    """Share of pad tokens in epoch 0's training batches: `pad_to` (static shapes) pads every row to that length;
    with --max_tokens_per_batch, the plan's batches; otherwise each batch pads to its longest (to its length bucket
    with `buckets`), in the sampler's order when length-grouped (its own seeded generator), in a seeded random order
    when not."""
    if pad_to:
        return 1 - sum(lengths) / (len(lengths) * pad_to)
    if config.max_tokens_per_batch:
        return loader.batch_sampler.padding_share(lengths)
    sampler = loader.sampler
    order = (list(sampler) if group_by_length
             else torch.randperm(len(lengths), generator=torch.Generator().manual_seed(config.seed)).tolist())
    return padding_ratio(lengths, order, config.per_device_train_batch_size, buckets.width if buckets else None)


class PredictionFinish:
    """The finish seam: the training batches' padding ratio and, for a test split, predictions written with label
    names (predict_results.jsonl) plus test_* metrics when it has labels, added to the run's results."""

    def __init__(self, test_set, collator, config: TrainConfig, labels: Labels, metrics_fn, padding: float):
        self.test_set, self.collator, self.config = test_set, collator, config
        self.labels, self.metrics_fn, self.padding = labels, metrics_fn, padding

    def on_finish(self, session, metrics: dict) -> None:
        metrics["train_padding_ratio"] = round(self.padding, 4)
        if self.test_set is None:
            return
        acc = session.accelerator
        loader = acc.prepare(make_loader(self.test_set, self.config, train=False, collate_fn=self.collator))

        def step(model, batch):
            return {"logits": model(**{k: v for k, v in batch.items() if k != "labels"}).logits}

        outputs = gather_outputs(acc, session.model, loader, step)
        if acc.is_main_process:
            logits = outputs["logits"].float()
            names = self.labels.names
            preds = logits.squeeze(-1).tolist() if self.labels.is_regression else [names[i] for i in logits.argmax(-1)]
            rows = [{"index": i, "prediction": p} for i, p in enumerate(preds)]
            (Path(self.config.output_dir) / TEST_PREDICTIONS).write_text("".join(json.dumps(r) + "\n" for r in rows))
        if "labels" in outputs:
            metrics.update({f"test_{k}": float(v) for k, v in self.metrics_fn(outputs).items()})
