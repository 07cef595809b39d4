"""Targets the tokenizer cannot write: does each target come back from decode(encode(target)) as written?

A model can only write what its tokenizer decodes. A WordPiece decoder (BERT's, MiniLM's) puts spaces around
punctuation and an uncased one drops capitals: "1,024" comes back as "1, 024", "U.S." as "u. s.". Exact match
against the raw target then fails however right the model is, so the share of targets that survive the round trip
is the ceiling of exact match on the raw strings. Checked before training, on every target of each split (an evenly
spaced sample of `ROUND_TRIP_LIMIT` in a larger one), with the same decoding the evaluation applies to the model's
outputs (`decode_output`: special tokens skipped, the tokenizer's own `clean_up_tokenization_spaces`, then
`normalise_text`), so the check and the scores cannot drift apart.

The evaluation then scores the outputs twice: against the raw references (`eval_exact_match`, ...) and against the
references' own round trip (`eval_exact_match_vs_round_trip`, ...): the score of the strings this tokenizer can
write, which is the model's score where the raw one is capped by the tokenizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...text_units import normalise_text

ROUND_TRIP_LIMIT = 20_000  # targets checked per split: a fast tokenizer round-trips 7,600 titles in 0.5 s
SHOWN = 3  # examples in the start-up line
ROUND_TRIP_SCORES = ("rouge1", "rouge2", "rougeL", "rougeLsum", "bleu", "sacrebleu", "exact_match")
REMEDY = ("To score the raw strings, normalise the targets to what the tokenizer writes (its case, its spacing), or "
          "train a model whose tokenizer writes them back (--model_name_or_path of a model with a cased byte-level "
          "BPE tokenizer, as GPT-2's; for a model built from a config, --train_tokenizer_vocab_size trains a "
          "byte-level BPE; the start-up report says whether it does). Meanwhile read the *_vs_round_trip scores.")


def decode_output(tokenizer, ids: Sequence[int]) -> str:
    """Token ids as the generation metrics read them: special tokens skipped, the tokenizer's own clean-up of the
    spaces around punctuation (its `clean_up_tokenization_spaces`), then `normalise_text`."""
    return normalise_text(tokenizer.decode(list(ids), skip_special_tokens=True))


def round_trips(tokenizer, texts: Sequence[str], seq2seq: bool) -> list[str]:
    """decode(encode(text)) for each text, encoded as training encodes targets (a seq2seq target with
    `text_target`, a completion or chat reply without special tokens) and decoded as outputs are."""
    if not texts:
        return []
    ids = (tokenizer(text_target=list(texts)) if seq2seq else tokenizer(list(texts), add_special_tokens=False))
    return [decode_output(tokenizer, row) for row in ids["input_ids"]]


@dataclass(frozen=True)
class RoundTrip:
    """What the check found in one split: `survived` of `checked` targets (of `total`) came back as written."""

    checked: int
    total: int
    survived: int
    examples: tuple[tuple[str, str], ...]  # (target, what the tokenizer writes), the first that do not survive

    @property
    def pct(self) -> float:
        return 100.0 * self.survived / self.checked if self.checked else 100.0


def check_round_trip(tokenizer, references: Sequence[str], seq2seq: bool,
                     limit: int = ROUND_TRIP_LIMIT) -> RoundTrip:
    """The round trip of every reference, or of `limit` evenly spaced ones in a larger split (deterministic: every
    process checks the same targets and finds the same share)."""
    total = len(references)
    picked = [references[i * total // limit] for i in range(limit)] if total > limit else list(references)
    written = round_trips(tokenizer, picked, seq2seq)
    lost = [(t, w) for t, w in zip(picked, written, strict=True) if normalise_text(t) != w]
    return RoundTrip(len(picked), total, len(picked) - len(lost), tuple(lost[:SHOWN]))


def round_trip_metrics(checks: dict[str, RoundTrip]) -> dict[str, float]:
    """all_results.json's keys: data_{split}_targets_round_trip_pct (0-100) and _checked (targets checked)."""
    out = {}
    for split, check in checks.items():
        out[f"data_{split}_targets_round_trip_pct"] = check.pct
        out[f"data_{split}_targets_round_trip_checked"] = float(check.checked)
    return out


def round_trip_line(checks: dict[str, RoundTrip]) -> str | None:
    """The start-up report's line: the share per split, and where it is below 100%, examples and the remedy."""
    if not checks:
        return None

    def share(split: str, c: RoundTrip) -> str:
        sampled = f", an evenly spaced sample of {c.total:,}" if c.checked < c.total else ""
        return f"{split} {c.pct:.1f}% ({c.survived:,} of {c.checked:,}{sampled})"
    shares = ", ".join(share(split, c) for split, c in checks.items())
    if all(c.survived == c.checked for c in checks.values()):
        return f"targets: the tokenizer writes every target back as written (decode(encode(target))): {shares}"
    examples = [e for c in checks.values() for e in c.examples][:SHOWN]
    shown = "; ".join(f"{t!r} -> {w!r}" for t, w in examples)
    return (f"targets the tokenizer cannot write: decode(encode(target)) gives back the target as written for "
            f"{shares} -- the ceiling of exact match on the raw strings. E.g. {shown}. The outputs are scored "
            f"against the raw targets (eval_exact_match, ...) and against their round trip "
            f"(eval_exact_match_vs_round_trip, ...: what this tokenizer can write). {REMEDY}")


def round_trip_warning(split: str, check: RoundTrip, scores: dict[str, float], prefix: str) -> str | None:
    """At the end, when some targets of the scored split cannot be written: both exact matches side by side."""
    raw, trip = scores.get(f"{prefix}_exact_match"), scores.get(f"{prefix}_exact_match_vs_round_trip")
    if check.survived == check.checked or raw is None or trip is None:
        return None
    return (f"only {check.pct:.1f}% of the {split} targets come back from the tokenizer's round trip "
            f"(decode(encode(target))), the ceiling of {prefix}_exact_match ({raw:.1f}); against the references' "
            f"own round trip the outputs score {trip:.1f} ({prefix}_exact_match_vs_round_trip). {REMEDY}")
