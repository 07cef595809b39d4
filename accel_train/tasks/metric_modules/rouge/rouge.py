"""ROUGE-1, ROUGE-2, ROUGE-L and ROUGE-Lsum F-measures (Google's `rouge_score`, Porter stemming by default).

Shipped with accel_train so that `accel_train.load_metric("rouge")` works offline. Two differences from the
hub module, both on purpose:

* the corpus score is the plain mean of the per-item F-measures: the hub module's bootstrap aggregator
  resamples with an unseeded generator, so two calls on the same outputs can return different numbers;
* ROUGE-Lsum needs one sentence per line: sentences are split at ``.``, ``!`` or ``?`` followed by white
  space (newlines already in a text are kept), so no NLTK data has to be downloaded.

Scores are fractions in [0, 1]; `use_aggregator=False` returns the per-item lists.
"""

import re

import datasets
import evaluate
import numpy as np
from rouge_score import rouge_scorer

SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
DEFAULT_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")


def one_sentence_per_line(text):
    lines = [part.strip() for line in text.splitlines() for part in SENTENCE_END.split(line)]
    return "\n".join(line for line in lines if line)


class Rouge(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="ROUGE F-measures, averaged over items (deterministic).",
            citation="Lin, ROUGE: A Package for Automatic Evaluation of Summaries, 2004.",
            inputs_description="predictions: list of str; references: list of str, or list of lists of str "
                               "(several references: the best-scoring one counts); rouge_types; use_stemmer; "
                               "use_aggregator (False: per-item scores).",
            features=[
                datasets.Features({"predictions": datasets.Value("string"),
                                   "references": datasets.Sequence(datasets.Value("string"))}),
                datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
            ],
        )

    def _compute(self, predictions, references, rouge_types=None, use_stemmer=True, use_aggregator=True):
        types = list(rouge_types or DEFAULT_TYPES)
        scorer = rouge_scorer.RougeScorer(types, use_stemmer=use_stemmer)
        per_item = {name: [] for name in types}
        for prediction, reference in zip(predictions, references, strict=True):
            refs = [reference] if isinstance(reference, str) else list(reference)
            prediction = one_sentence_per_line(prediction)
            refs = [one_sentence_per_line(ref) for ref in refs]
            scores = scorer.score_multi(refs, prediction) if len(refs) > 1 else scorer.score(refs[0], prediction)
            for name in types:
                per_item[name].append(float(scores[name].fmeasure))
        if not use_aggregator:
            return per_item
        return {name: float(np.mean(values)) if values else 0.0 for name, values in per_item.items()}
