"""Accuracy: the fraction of predictions equal to their reference (scikit-learn's accuracy_score).

Shipped with accel_train so that `accel_train.load_metric("accuracy")` works offline.
"""

import datasets
import evaluate
from sklearn.metrics import accuracy_score


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Fraction of predictions that equal their reference label.",
            citation="",
            inputs_description="predictions, references: lists of int labels; normalize (bool); sample_weight.",
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        return {"accuracy": float(accuracy_score(references, predictions, normalize=normalize, sample_weight=sample_weight))}
