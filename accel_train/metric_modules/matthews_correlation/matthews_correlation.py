"""Matthews correlation coefficient, for binary and multi-class labels (scikit-learn's matthews_corrcoef).

Shipped with accel_train so that `accel_train.load_metric("matthews_correlation")` works offline.
"""

import datasets
import evaluate
from sklearn.metrics import matthews_corrcoef


class MatthewsCorrelation(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Correlation between predicted and true labels, in [-1, 1]; robust to class imbalance.",
            citation="",
            inputs_description="predictions, references: lists of int labels; sample_weight.",
            features=datasets.Features(
                {"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}
            ),
        )

    def _compute(self, predictions, references, sample_weight=None):
        return {"matthews_correlation": float(matthews_corrcoef(references, predictions, sample_weight=sample_weight))}
