"""What a text-generation run checks: settings refused before training, and, after it, whether the model writes
one string whatever its input (collapse) and whether it reads its source at all.

* `check_best_metric`: a --metric_for_best_model that names a generation score is refused before training unless
  --predict_with_generate scores generations at every evaluation (without it the first evaluation, an epoch in,
  would fail).
* `refuse_deepspeed`: the token loss returns sums, which DeepSpeed cannot train; refused as soon as the accelerator
  exists, before a model is loaded.
* `output_diversity`: over the generated items, the share of distinct outputs and of the most common output.
* `source_reliance`: how much the teacher-forced token loss rises when every item is given another item's source
  (rolled by one): near 0 nats per token, the model predicts its targets without reading the source — a
  seq2seq decoder that ignores its cross-attention, or a causal LM that ignores its prompt.
* `collapse_warning`: a message when outputs collapsed (one output for at least half of many distinct sources)
  or the source is ignored, with what to try.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import datasets
from torch.utils.data import DataLoader

from ....config import TrainConfig
from ....core.evaluation import evaluate_model
from ....core.loss import IGNORE_INDEX
from ....core.sharded import refuse_sums_under_deepspeed
from ....errors import ConfigError
from .roundtrip import ROUND_TRIP_SCORES

GENERATION_SCORES = ("rouge1", "rouge2", "rougeL", "rougeLsum", "bleu", "sacrebleu", "exact_match",
                     "repeated_trigram_pct", "gen_len", "generated_items",
                     *(f"{name}_vs_round_trip" for name in ROUND_TRIP_SCORES))
COLLAPSED_TOP_SHARE = 0.5  # one output for at least half of the items ...
MIN_DISTINCT_SOURCES = 10  # ... of at least this many distinct sources, whose references are not one string
IGNORED_SOURCE_NATS = 0.05  # rolled sources raise the token loss by less than this: the source is not read
RELIANCE_ITEMS = 256


def check_best_metric(config: TrainConfig, predict_with_generate: bool) -> None:
    name = config.best_metric_name
    if name and name.removeprefix("eval_") in GENERATION_SCORES and not predict_with_generate:
        raise ConfigError(f"--metric_for_best_model {config.metric_for_best_model} is a generation score, and "
                          "evaluations during training compute only the teacher-forced token loss (eval_loss, "
                          "eval_perplexity): add --predict_with_generate to generate and score at every "
                          "evaluation, or choose by eval_loss.")


def refuse_deepspeed(accelerator) -> None:
    """Under DeepSpeed, a ConfigError: every text-generation run trains the token loss, per-token sums."""
    refuse_sums_under_deepspeed(accelerator, "text generation's loss (the token cross-entropy, normalised by the "
                                             "tokens of each whole optimizer step)")


def output_diversity(outputs: Sequence[str]) -> dict[str, float]:
    """distinct_outputs_pct: distinct outputs per item (0-100); top_output_pct: the most common output's share."""
    if not outputs:
        return {}
    top = Counter(outputs).most_common(1)[0][1]
    return {"distinct_outputs_pct": 100.0 * len(set(outputs)) / len(outputs),
            "top_output_pct": 100.0 * top / len(outputs)}


def rolled_rows(tokens: datasets.Dataset, seq2seq: bool, roll: int) -> datasets.Dataset:
    """The rows with each item's source replaced by the source `roll` items further on (wrapping round). A causal
    row is rebuilt as [prompt, masked][the item's completion]; roll=0 gives the item's own, on the same labels."""
    n = len(tokens)
    ids, labels, prompts = tokens["input_ids"], tokens["labels"], tokens["prompt_ids"]
    if seq2seq:
        return datasets.Dataset.from_dict({"input_ids": [ids[(i + roll) % n] for i in range(n)], "labels": labels})
    rows = {"input_ids": [], "labels": []}
    for i in range(n):
        source, completion = prompts[(i + roll) % n], ids[i][len(prompts[i]):]
        rows["input_ids"].append(source + completion)
        rows["labels"].append([IGNORE_INDEX] * len(source) + labels[i][len(prompts[i]):])
    return datasets.Dataset.from_dict(rows)


def source_reliance(accelerator, model, tokens: datasets.Dataset, seq2seq: bool, loss_fn, collator,
                    batch_size: int, limit: int = RELIANCE_ITEMS) -> float | None:
    """Token loss with rolled sources minus the token loss with the items' own (nats per token), over the first
    `limit` items; None with fewer than 2. Collective: every process calls it."""
    n = min(limit, len(tokens))
    if n < 2:
        return None
    subset = tokens.select(range(n))
    losses = []
    for roll in (0, 1):
        loader = accelerator.prepare(DataLoader(rolled_rows(subset, seq2seq, roll), batch_size=batch_size,
                                                collate_fn=collator))
        losses.append(evaluate_model(accelerator, model, loader, loss_fn, prefix="reliance")["reliance_loss"])
    return losses[1] - losses[0]


def collapse_warning(sources: Sequence[str], references: Sequence[str], outputs: Sequence[str],
                     reliance: float | None, seq2seq: bool) -> str | None:
    """A warning when the outputs collapsed or the source is ignored; None when neither."""
    sources_distinct = len(set(sources))
    top_output, top_count = Counter(outputs).most_common(1)[0] if outputs else ("", 0)
    top_reference = Counter(references).most_common(1)[0][1] if references else 0
    collapsed = (sources_distinct >= MIN_DISTINCT_SOURCES and top_count >= COLLAPSED_TOP_SHARE * len(outputs)
                 and top_reference < COLLAPSED_TOP_SHARE * len(references))
    ignored = reliance is not None and reliance < IGNORED_SOURCE_NATS
    if not (collapsed or ignored):
        return None
    what = []
    if collapsed:
        what.append(f"generation collapsed: {sources_distinct} distinct sources gave {len(set(outputs))} distinct "
                    f"outputs, {top_output!r} for {top_count} of {len(outputs)} items")
    if reliance is not None:
        what.append(f"giving each item another item's source raises the token loss by only {reliance:.3f} nats per "
                    f"token: the model predicts its targets without reading the source"
                    if ignored else f"the source is read (another item's source raises the token loss by "
                    f"{reliance:.2f} nats per token)")
    if seq2seq:
        advice = ("When the decoder ignores the encoder (its cross-attention), it learns only the targets' most likely "
                  "string. Try: a pretrained encoder kept frozen (--freeze_encoder; training it at the decoder's rate "
                  "made every input give one output in benchmarks/text_generation.md), dropout off (--config_overrides "
                  "hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0), more steps or a higher --learning_rate; "
                  "and check that each source belongs to its target.")
    else:
        advice = ("When a causal LM ignores its prompt, it learns only the completions' most likely string. Try: more "
                  "steps or epochs, a higher --learning_rate for a model trained from scratch (or --train_on_prompt, "
                  "so that it learns the prompts' language too); and check that each prompt belongs to its "
                  "completion.")
    return "; ".join(what) + ". " + advice
