"""Recall: the fraction of actual positives that are found (scikit-learn's recall_score).

Shipped with accel_train so that `accel_train.load_metric("recall")` works offline. `average` is
"binary" (default, for two classes), "macro", "micro" or "weighted", as in scikit-learn.
"""

import datasets
import evaluate
from sklearn.metrics import recall_score


class Recall(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Recall: the fraction of actual positives that are found.",
            citation="",
            inputs_description="predictions, references: lists of int labels; average; labels; pos_label.",
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references, labels=None, pos_label=1, average="binary", sample_weight=None,
                 zero_division=0):
        score = recall_score(references, predictions, labels=labels, pos_label=pos_label, average=average,
                    sample_weight=sample_weight, zero_division=zero_division)
        return {"recall": float(score) if getattr(score, "size", 1) == 1 else score.tolist()}
