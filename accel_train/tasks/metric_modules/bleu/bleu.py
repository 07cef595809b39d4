"""BLEU (Papineni et al., 2002): corpus-level, up to 4-grams, with the brevity penalty, on a 0-1 scale.

Shipped with accel_train so that `accel_train.load_metric("bleu")` works offline. The hub module imports a helper
file it downloads at load time; this one computes BLEU itself, in `corpus_bleu` below. Texts are tokenised with
sacrebleu's 13a tokenizer by default (the hub module's choice too), every Chinese or Japanese character set apart
first (`accel_train.tasks.text_units.bleu_tokens`; a Chinese sentence was one "word", so its BLEU was 0 unless
identical), or by any callable given as `tokenizer`. The reference length of a prediction is the length of its
closest reference (the shorter one on a tie). `smooth=True` adds one to the matches and candidates of every order
(Lin & Och, 2004), the hub module's smoothing.
"""

import math
from collections import Counter

import datasets
import evaluate

from accel_train.tasks.text_units import bleu_tokens


def ngram_counts(tokens, order):
    return Counter(tuple(tokens[i:i + order]) for i in range(len(tokens) - order + 1))


def corpus_bleu(predictions, references, max_order=4, smooth=False):
    """BLEU of tokenised `predictions` (lists of tokens) against `references` (a list of token lists each)."""
    matches, possible = [0] * max_order, [0] * max_order
    prediction_length = reference_length = 0
    for prediction, refs in zip(predictions, references, strict=True):
        prediction_length += len(prediction)
        reference_length += min((abs(len(r) - len(prediction)), len(r)) for r in refs)[1]
        for order in range(1, max_order + 1):
            counts = ngram_counts(prediction, order)
            best = Counter()
            for ref in refs:
                best |= ngram_counts(ref, order)  # clip each n-gram by its largest count in one reference
            matches[order - 1] += sum((counts & best).values())
            possible[order - 1] += max(len(prediction) - order + 1, 0)
    if smooth:
        precisions = [(m + 1.0) / (p + 1.0) for m, p in zip(matches, possible, strict=True)]
    else:
        precisions = [m / p if p else 0.0 for m, p in zip(matches, possible, strict=True)]
    geo_mean = math.exp(sum(math.log(p) for p in precisions) / max_order) if min(precisions) > 0 else 0.0
    ratio = prediction_length / reference_length if reference_length else 0.0
    penalty = 1.0 if ratio > 1.0 else (math.exp(1 - 1 / ratio) if ratio > 0 else 0.0)
    return {"bleu": geo_mean * penalty, "precisions": precisions, "brevity_penalty": penalty,
            "length_ratio": ratio, "translation_length": prediction_length, "reference_length": reference_length}


class Bleu(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Corpus BLEU with the brevity penalty (0-1).",
            citation="Papineni et al., BLEU: a Method for Automatic Evaluation of Machine Translation, 2002.",
            inputs_description="predictions: list of str; references: list of str or list of lists of str; "
                               "tokenizer (callable, default 13a); max_order (4); smooth (False).",
            features=[
                datasets.Features({"predictions": datasets.Value("string"),
                                   "references": datasets.Sequence(datasets.Value("string"))}),
                datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
            ],
        )

    def _compute(self, predictions, references, tokenizer=None, max_order=4, smooth=False):
        split = tokenizer or bleu_tokens
        refs = [[ref] if isinstance(ref, str) else list(ref) for ref in references]
        return corpus_bleu([split(p) for p in predictions], [[split(r) for r in rs] for rs in refs],
                           max_order=max_order, smooth=smooth)
