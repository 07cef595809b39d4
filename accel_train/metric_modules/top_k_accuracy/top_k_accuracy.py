"""Top-k accuracy: the fraction of samples whose reference is among the k highest-scored classes
(scikit-learn's top_k_accuracy_score).

Shipped with accel_train so that `accel_train.load_metric("top_k_accuracy")` works offline. Predictions
are score rows (logits or probabilities), one per sample; with k >= the number of classes every sample
counts as a hit, by definition.
"""

import datasets
import evaluate
import numpy as np
from sklearn.metrics import top_k_accuracy_score


class TopKAccuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Fraction of samples whose reference label is among the k top-scored classes.",
            citation="",
            inputs_description="predictions: a list of score rows (one float per class); references: int labels; "
            "k (int, default 5).",
            features=datasets.Features(
                {"predictions": datasets.Sequence(datasets.Value("float32")), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references, k=5):
        scores = np.asarray(predictions, dtype=np.float64)
        if k >= scores.shape[1]:
            return {"top_k_accuracy": 1.0}
        labels = np.arange(scores.shape[1])  # the classes are the score columns, seen in references or not
        return {"top_k_accuracy": float(top_k_accuracy_score(references, scores, k=k, labels=labels))}
