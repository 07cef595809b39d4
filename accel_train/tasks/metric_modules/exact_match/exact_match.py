"""Exact match: the fraction of predictions equal to their reference, after optional normalisation.

Shipped with accel_train so that `accel_train.load_metric("exact_match")` works offline. White space is
always collapsed (runs of spaces, tabs and newlines count as one space; both ends stripped);
`ignore_case` and `ignore_punctuation` normalise further.
"""

import string

import datasets
import evaluate

PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalise(text, ignore_case, ignore_punctuation):
    if ignore_case:
        text = text.lower()
    if ignore_punctuation:
        text = text.translate(PUNCTUATION)
    return " ".join(text.split())


class ExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Fraction of predictions identical to their reference (white space collapsed).",
            citation="",
            inputs_description="predictions, references: lists of str; ignore_case; ignore_punctuation.",
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}),
        )

    def _compute(self, predictions, references, ignore_case=False, ignore_punctuation=False):
        if not predictions:
            return {"exact_match": 0.0}
        same = sum(normalise(p, ignore_case, ignore_punctuation) == normalise(r, ignore_case, ignore_punctuation)
                   for p, r in zip(predictions, references, strict=True))
        return {"exact_match": same / len(predictions)}
