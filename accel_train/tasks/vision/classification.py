"""Classification metrics on gathered evaluation outputs: top-1 and top-k accuracy (the shipped `evaluate`
modules), per-class accuracy, and the confusion matrix as numbers and as a PNG.

Nothing here is image-specific; it lives beside the image recipe that first needed it.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ...core.evaluation import confusion_matrix
from ...rundir.layout import CONFUSION_MATRIX_PLOT
from ..metrics import load_metric


class ClassificationMetrics:
    """A `metrics_fn` for the loop: ``{"accuracy", "top5_accuracy", "accuracy_<class>"...}`` from the gathered
    "logits" and "labels". Every call also keeps its confusion matrix (rows: true class, columns: predicted)
    in `last_confusion`, so a recipe can plot the final evaluation's."""

    def __init__(self, class_names: Sequence[str], top_k: int = 5):
        self.class_names, self.top_k = list(class_names), top_k
        self.accuracy = load_metric("accuracy")
        self.top_k_accuracy = load_metric("top_k_accuracy")
        self.last_confusion: np.ndarray | None = None
        self.average: ClassificationMetrics | None = None  # the weight average's evaluations (--ema_decay)
        names = [_safe(c) for c in self.class_names]
        # a class name that cleans up to another's keeps its index, so no metric overwrites another
        self.keys = [f"accuracy_{n}" if names.count(n) == 1 else f"accuracy_{i}_{n}" for i, n in enumerate(names)]

    @property
    def metric_names(self) -> list[str]:
        """What a call returns: a --metric_for_best_model it never reports is refused before training."""
        return ["accuracy", f"top{self.top_k}_accuracy", *self.keys]

    def for_average(self) -> ClassificationMetrics:
        """The twin that evaluates the weight average (--ema_decay; core/ema.py asks for it): the same metrics with a
        `last_confusion` of its own, evaluated after this one's, which would otherwise overwrite the live weights'."""
        if self.average is None:
            self.average = copy.copy(self)
            self.average.last_confusion = None
        return self.average

    def __call__(self, outputs: dict[str, torch.Tensor]) -> dict[str, float]:
        logits = outputs["logits"].float().cpu().numpy()
        labels = outputs["labels"].cpu().numpy()
        predictions = logits.argmax(-1)
        metrics = {
            "accuracy": self.accuracy.compute(predictions=predictions, references=labels)["accuracy"],
            f"top{self.top_k}_accuracy": self.top_k_accuracy.compute(
                predictions=logits, references=labels, k=self.top_k)["top_k_accuracy"],
        }
        self.last_confusion = confusion_matrix(labels, predictions, len(self.class_names))
        for key, value in zip(self.keys, per_class_accuracy(self.last_confusion), strict=True):
            metrics[key] = value
        return metrics


def per_class_accuracy(confusion: np.ndarray) -> list[float]:
    """Recall of each class: correct / samples of that class (NaN for a class with no samples)."""
    totals = confusion.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (np.diag(confusion) / totals).tolist()


def save_confusion_matrix(confusion: np.ndarray, class_names: Sequence[str], path: str | Path, title: str = "") -> Path:
    """Write the confusion matrix as a PNG (counts in the cells up to 30 classes). Call on the main process."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt
    from sklearn.metrics import ConfusionMatrixDisplay

    n = len(class_names)
    side = min(4 + 0.45 * n, 30)
    fig, ax = plt.subplots(figsize=(side, side))
    ConfusionMatrixDisplay(confusion, display_labels=list(class_names)).plot(
        ax=ax, include_values=n <= 30, cmap="Blues", xticks_rotation="vertical", colorbar=False)
    accuracy = np.trace(confusion) / max(confusion.sum(), 1)
    ax.set_title(f"{title} accuracy {accuracy:.2%} on {confusion.sum()} samples".strip())
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def _safe(name: str) -> str:
    """A class name as a metric-key fragment (TensorBoard tags and JSON keys without spaces or slashes)."""
    return re.sub(r"[^0-9A-Za-z_.-]+", "_", str(name)).strip("_") or "class"


class ClassificationFinish:
    """The finish seam: test_* entries when test was the evaluation split, the confusion matrix PNG of the last
    evaluation (test if there is one) and a per-class accuracy table, on the main process, both of the weights saved
    as the final model: the weight average's evaluation with --save_ema_as_final, else the live weights'."""

    def __init__(self, eval_split, has_test: bool, metrics_fn: ClassificationMetrics, class_names, output_dir: str):
        self.eval_split, self.has_test, self.metrics_fn = eval_split, has_test, metrics_fn
        self.class_names, self.out = class_names, Path(output_dir)

    def on_finish(self, session, metrics: dict) -> None:
        if self.has_test and self.eval_split == "test":
            metrics.update({"test" + k[len("eval"):]: v for k, v in metrics.items() if k.startswith("eval_")})
        split = "test" if self.has_test else "eval"  # the split whose confusion matrix metrics_fn kept last
        averaged = session.config.save_ema_as_final
        prefix = f"{split}_ema" if averaged else split  # the saved weights' metrics (core/ema.py's prefix)
        confusion = (self.metrics_fn.for_average() if averaged else self.metrics_fn).last_confusion
        if not session.accelerator.is_main_process or confusion is None:
            return
        weights = " (weight average)" if averaged else ""
        save_confusion_matrix(confusion, self.class_names, self.out / CONFUSION_MATRIX_PLOT,
                              title=("test" if split == "test" else self.eval_split) + weights)
        rows = [f"  {name:<16} {metrics[f'{prefix}_{key}']:.2%}"
                for name, key in zip(self.class_names, self.metrics_fn.keys, strict=True)]
        print(f"per-class {split} accuracy{weights}:\n" + "\n".join(rows), flush=True)
        top_k = f"top{self.metrics_fn.top_k}_accuracy"
        print(f"{split} top-1 accuracy {metrics[f'{prefix}_accuracy']:.2%}, top-{self.metrics_fn.top_k} "
              f"{metrics[f'{prefix}_{top_k}']:.2%}{weights}; confusion matrix: {self.out / CONFUSION_MATRIX_PLOT}",
              flush=True)
