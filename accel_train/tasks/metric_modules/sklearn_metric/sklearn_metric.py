"""Classification metrics from scikit-learn as one `evaluate` module, shipped with accel_train so that they load
offline: `accel_train.load_metric(name)` loads this file with `config_name=name`.

    name                   inputs                                         keyword arguments (as scikit-learn's)
    accuracy               int predictions, int references                normalize, sample_weight
    f1 / precision / recall                                               average ("binary", "macro", "micro",
                                                                          "weighted"), labels, pos_label, ...
    matthews_correlation                                                  sample_weight
    top_k_accuracy         score rows (one float per class), int refs     k (default 5)

The result is {name: value}; a per-class score (average=None) is a list.
"""

import datasets
import evaluate
import numpy as np
from sklearn import metrics

DESCRIPTIONS = {
    "accuracy": "Fraction of predictions that equal their reference label.",
    "f1": "F1: the harmonic mean of precision and recall.",
    "precision": "Precision: the fraction of predicted positives that are correct.",
    "recall": "Recall: the fraction of true positives that are predicted.",
    "matthews_correlation": "Correlation between predicted and true labels, in [-1, 1]; robust to class imbalance.",
    "top_k_accuracy": "Fraction of samples whose reference label is among the k top-scored classes.",
}


class SklearnMetric(evaluate.Metric):
    def _info(self):
        if self.config_name not in DESCRIPTIONS:
            raise KeyError(f"unknown metric {self.config_name!r}; this module computes {sorted(DESCRIPTIONS)}")
        scores = datasets.Sequence(datasets.Value("float32")) if self.config_name == "top_k_accuracy" else None
        return evaluate.MetricInfo(
            description=DESCRIPTIONS[self.config_name],
            citation="",
            inputs_description="predictions, references: int labels (top_k_accuracy: score rows as predictions).",
            features=datasets.Features({"predictions": scores or datasets.Value("int64"),
                                        "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references, **kwargs):
        name = self.config_name
        if name == "accuracy":
            return {name: float(metrics.accuracy_score(references, predictions, **kwargs))}
        if name == "matthews_correlation":
            return {name: float(metrics.matthews_corrcoef(references, predictions, **kwargs))}
        if name == "top_k_accuracy":
            return {name: _top_k(predictions, references, **kwargs)}
        score_fn = {"f1": metrics.f1_score, "precision": metrics.precision_score, "recall": metrics.recall_score}[name]
        score = score_fn(references, predictions, **{"zero_division": 0, **kwargs})
        return {name: float(score) if getattr(score, "size", 1) == 1 else score.tolist()}


def _top_k(predictions, references, k=5):
    scores = np.asarray(predictions, dtype=np.float64)
    if k >= scores.shape[1]:  # every sample counts as a hit, by definition
        return 1.0
    labels = np.arange(scores.shape[1])  # the classes are the score columns, seen in references or not
    return float(metrics.top_k_accuracy_score(references, scores, k=k, labels=labels))
