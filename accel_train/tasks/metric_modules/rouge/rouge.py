"""ROUGE-1, ROUGE-2, ROUGE-L and ROUGE-Lsum F-measures (Google's `rouge_score`, Porter stemming by default).

Shipped with accel_train so that `accel_train.load_metric("rouge")` works offline. Three differences from the
hub module, all on purpose:

* words are counted in every script (`accel_train.tasks.text_units.words`: Unicode letters and digits, one unit per
  Chinese or Japanese character), where `rouge_score`'s default tokenizer keeps `[a-z0-9]` only, so identical
  Russian, Arabic or Chinese texts scored 0; Porter stemming (`use_stemmer`) applies to ASCII words only;
* the corpus score is the plain mean of the per-item F-measures: the hub module's bootstrap aggregator
  resamples with an unseeded generator, so two calls on the same outputs can return different numbers;
* ROUGE-Lsum needs one sentence per line: sentences are split at ``.``, ``!`` or ``?`` followed by white
  space, and after ``。``, ``！`` or ``？`` (newlines already in a text are kept), so no NLTK data has to be
  downloaded.

Scores are fractions in [0, 1]; `use_aggregator=False` returns the per-item lists.
"""

import re

import datasets
import evaluate
import numpy as np
from nltk.stem import porter
from rouge_score import rouge_scorer

from accel_train.tasks.text_units import words

SENTENCE_END = re.compile(r"(?<=[.!?])\s+|(?<=[。！？])\s*")  # Chinese / Japanese full stops need no space
DEFAULT_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")


def one_sentence_per_line(text):
    lines = [part.strip() for line in text.splitlines() for part in SENTENCE_END.split(line)]
    return "\n".join(line for line in lines if line)


class UnicodeWords:
    """A `rouge_score` tokenizer: `words(text)`, ASCII words of more than 3 letters Porter-stemmed when asked (the
    rule of `rouge_score`'s own tokenizer)."""

    def __init__(self, use_stemmer):
        self.stemmer = porter.PorterStemmer() if use_stemmer else None

    def tokenize(self, text):
        units = words(text)
        if self.stemmer is None:
            return units
        return [self.stemmer.stem(u) if len(u) > 3 and u.isascii() and u.isalpha() else u for u in units]


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
        scorer = rouge_scorer.RougeScorer(types, tokenizer=UnicodeWords(use_stemmer))
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
