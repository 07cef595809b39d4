"""Precision: the fraction of predicted positives that are correct (scikit-learn's precision_score).

Shipped with accel_train so that `accel_train.load_metric("precision")` works offline. `average` is
"binary" (default, for two classes), "macro", "micro" or "weighted", as in scikit-learn.
"""

import datasets
import evaluate
from sklearn.metrics import precision_score


class Precision(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Precision: the fraction of predicted positives that are correct.",
            citation="",
            inputs_description="predictions, references: lists of int labels; average; labels; pos_label.",
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references, labels=None, pos_label=1, average="binary", sample_weight=None,
                 zero_division=0):
        score = precision_score(references, predictions, labels=labels, pos_label=pos_label, average=average,
                    sample_weight=sample_weight, zero_division=zero_division)
        return {"precision": float(score) if getattr(score, "size", 1) == 1 else score.tolist()}
