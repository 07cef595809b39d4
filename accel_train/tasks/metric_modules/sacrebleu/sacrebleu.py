"""SacreBLEU: corpus BLEU with standard tokenisation (the `sacrebleu` package), on a 0-100 scale.

Shipped with accel_train so that `accel_train.load_metric("sacrebleu")` works offline. References are one
string per prediction, or a list of strings per prediction (every prediction needs the same number).
`tokenize` defaults to 13a, or to `zh` when a reference holds Chinese or Japanese characters (what the sacrebleu
command line picks for a Chinese target; 13a would make each such sentence one token); the result's `tokenize`
says which ran.
"""

import datasets
import evaluate
import sacrebleu as scb

from accel_train.tasks.text_units import has_unspaced_script


class SacreBleu(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Corpus BLEU computed by sacrebleu (0-100).",
            citation="Post, A Call for Clarity in Reporting BLEU Scores, 2018.",
            inputs_description="predictions: list of str; references: list of str or list of lists of str; "
                               "smooth_method (exp, floor, add-k, none); tokenize (13a, intl, char, none, ...); "
                               "lowercase.",
            features=[
                datasets.Features({"predictions": datasets.Value("string"),
                                   "references": datasets.Sequence(datasets.Value("string"))}),
                datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
            ],
        )

    def _compute(self, predictions, references, smooth_method="exp", tokenize=None, lowercase=False):
        refs = [[ref] if isinstance(ref, str) else list(ref) for ref in references]
        if tokenize is None:
            tokenize = "zh" if has_unspaced_script(r for rs in refs for r in rs) else "13a"
        counts = {len(r) for r in refs}
        if len(counts) > 1:
            raise ValueError(f"sacrebleu needs the same number of references for every prediction, got {counts}")
        streams = [list(stream) for stream in zip(*refs, strict=True)] if refs else [[]]
        result = scb.corpus_bleu(predictions, streams, smooth_method=smooth_method, tokenize=tokenize,
                                 lowercase=lowercase)
        return {"score": result.score, "counts": result.counts, "totals": result.totals,
                "precisions": result.precisions, "bp": result.bp, "sys_len": result.sys_len,
                "ref_len": result.ref_len, "tokenize": tokenize}
