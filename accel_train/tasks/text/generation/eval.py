"""Generation and its metrics: decode outputs on every process, gather each item exactly once, score them.

`Generator` runs `model.generate` over a prepared loader of prompts (each process its share), pads the
outputs to one width across processes and gathers them with `gather_for_metrics`, which drops the items
the sampler repeated to even out the last batch: every process ends with each item exactly once, in order.
`score_generations` turns texts into numbers with the shipped `evaluate` modules: ROUGE-1/2/L/Lsum (Porter
stemming), BLEU and sacreBLEU, exact match (all 0-100), the mean generated length in tokens, and the share of
outputs that repeat a word trigram (0-100; degenerate decoding loops show there first).

Text metrics score text: the decoded output (special tokens skipped, the tokenizer's own clean-up of the spaces
its decoder puts around punctuation) against the *raw* reference string of the data, both after one
normalisation (`tasks.text_units.normalise_text`: Unicode NFKC, white space collapsed). predictions.jsonl holds
exactly the strings scored, so `score_generations` on its rows gives all_results.json's numbers. A tokenizer that
cannot write the reference (an uncased one cannot write capitals, MiniLM's writes "1987-03-21" as
"1987 - 03 - 21") loses there: that is what the metric measures. Beside those scores, the same ones against what the
tokenizer writes of each reference (`{prefix}_exact_match_vs_round_trip`, ...; roundtrip.py): the model's score where
the raw one is capped by the tokenizer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Subset

from ....errors import ConfigError
from ...text_units import normalise_text
from .roundtrip import ROUND_TRIP_SCORES, decode_output, round_trips
from .tokens import GenerationCollator, TokenizedSplit

WORD = re.compile(r"\w+|[^\w\s]")
SHARDED = ("FSDP", "DEEPSPEED")  # engines whose processes hold a shard of the weights each


@dataclass(frozen=True)
class GenerationArguments:
    """How outputs are generated and scored."""

    generation_max_new_tokens: int = field(default=64, metadata={"help": "Tokens generated at most per item."})
    generation_num_beams: int = field(default=1, metadata={"help": "1: greedy decoding; > 1: beam search."})
    no_repeat_ngram_size: int = field(default=0, metadata={"help": "> 0: never repeat an n-gram of this size."})
    max_generate_samples: int | None = field(default=256, metadata={
        "help": "Generate for the first N validation items at the end of training (None: all; 0: none)."})
    predict_with_generate: bool = field(default=False, metadata={
        "help": "Also generate (and score) at every evaluation during training, not only at the end."})
    lead_baseline_words: int = field(default=0, metadata={
        "help": "> 0: also score the first N words of each source as its output (the lead-N baseline)."})

    def __post_init__(self):
        if self.predict_with_generate and self.max_generate_samples == 0:
            raise ConfigError("--predict_with_generate with --max_generate_samples 0: every evaluation would generate "
                              "for no item and have nothing to score (the metrics fail at the first one). Drop one: "
                              "--max_generate_samples N (or unset: 256) to generate, or --predict_with_generate to "
                              "evaluate the loss alone.")


def repeated_ngram_share(texts: Sequence[str], n: int = 3) -> float:
    """Share (0-100) of texts in which some n-gram of words occurs more than once. Words and punctuation marks
    count separately (lower-cased), so a loop of punctuation ("B.........") counts as repeating too."""
    def repeats(text: str) -> bool:
        words = WORD.findall(text.lower())
        grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
        return len(grams) != len(set(grams))
    return 100.0 * sum(map(repeats, texts)) / len(texts) if texts else 0.0


def score_generations(predictions: Sequence[str], references: Sequence[str], metrics: Mapping[str, Any],
                      lengths: Sequence[int] | None = None) -> dict[str, float]:
    """ROUGE, BLEU, sacreBLEU, exact match (0-100), repeated-trigram share (0-100), mean generated tokens, of the
    texts after `normalise_text` (NFKC, white space collapsed; idempotent, so scoring predictions.jsonl again gives
    the same numbers).

    `metrics` holds loaded `evaluate` modules by name (rouge, bleu, sacrebleu, exact_match); missing ones
    are skipped. Empty predictions are scored as they are (zero)."""
    predictions, references = [normalise_text(p) for p in predictions], [normalise_text(r) for r in references]
    scores: dict[str, float] = {}
    if "rouge" in metrics:
        rouge = metrics["rouge"].compute(predictions=predictions, references=references, use_stemmer=True)
        scores.update({name: 100 * value for name, value in rouge.items()})
    if "bleu" in metrics:
        bleu = metrics["bleu"].compute(predictions=predictions, references=references)
        scores["bleu"] = 100 * bleu["bleu"]
    if "sacrebleu" in metrics:
        scores["sacrebleu"] = metrics["sacrebleu"].compute(predictions=predictions, references=references)["score"]
    if "exact_match" in metrics:
        scores["exact_match"] = 100 * metrics["exact_match"].compute(
            predictions=predictions, references=references)["exact_match"]
    scores["repeated_trigram_pct"] = repeated_ngram_share(predictions)
    if lengths is not None:
        scores["gen_len"] = sum(lengths) / len(lengths) if lengths else 0.0
    return scores


def lead_words(text: str, n: int) -> str:
    return " ".join(text.split()[:n])


@dataclass
class GeneratedItems:
    """What one generation pass produced, on every process, each item once."""

    items: list[int]
    outputs: list[str]
    lengths: list[int]  # generated tokens before the end of sequence


class Generator:
    """Generates for the first `limit` items of a split, on any number of processes.

    `tokenizer` decodes; `seq2seq` says whether outputs hold only new tokens (encoder-decoder) or the prompt
    too (causal LM, whose prompts are therefore padded on the left)."""

    def __init__(self, split: TokenizedSplit, tokenizer, seq2seq: bool, args: GenerationArguments,
                 batch_size: int, limit: int | None = None):
        self.split, self.tokenizer, self.seq2seq, self.args = split, tokenizer, seq2seq, args
        count = len(split.tokens) if limit is None else min(limit, len(split.tokens))
        self.dataset = Subset(split.tokens.select_columns(["prompt_ids", "item"]), range(count))
        self.collator = GenerationCollator(tokenizer.pad_token_id, "right" if seq2seq else "left")
        self.batch_size = batch_size
        self.loader = None  # prepared on first use, once (Accelerate keeps every prepared loader)

    def __len__(self) -> int:
        return len(self.dataset)

    def generation_kwargs(self, accelerator) -> dict[str, Any]:
        kwargs = {"max_new_tokens": self.args.generation_max_new_tokens, "num_beams": self.args.generation_num_beams,
                  "do_sample": False, "pad_token_id": self.tokenizer.pad_token_id}
        if self.args.no_repeat_ngram_size:
            kwargs["no_repeat_ngram_size"] = self.args.no_repeat_ngram_size
        if accelerator.num_processes > 1 and accelerator.distributed_type.value in SHARDED:
            # every forward all-gathers the sharded weights: a process whose batch ended early must keep stepping
            # with the others (transformers' synced_gpus, which it sets by itself only for transformers' own FSDP
            # wrapping and ZeRO-3), or the others wait in a collective it never joins
            kwargs["synced_gpus"] = True
        return kwargs

    @torch.no_grad()
    def generate(self, accelerator, model) -> GeneratedItems:
        """Collective: every process calls it; each gets every item once, in item order."""
        if self.loader is None:
            self.loader = accelerator.prepare(DataLoader(self.dataset, batch_size=self.batch_size,
                                                         collate_fn=self.collator))
        bare = accelerator.unwrap_model(model)  # DDP's wrapper has no generate(); the weights are the same
        was_training = bare.training
        bare.eval()
        items, tokens = [], []
        eos = self.end_tokens(bare)
        kwargs = self.generation_kwargs(accelerator)
        try:
            for batch in self.loader:
                with accelerator.autocast():
                    out = bare.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                        **kwargs)
                new = out if self.seq2seq else out[:, batch["input_ids"].shape[1]:]
                new = accelerator.pad_across_processes(new.contiguous(), dim=1, pad_index=self.tokenizer.pad_token_id)
                gathered = accelerator.gather_for_metrics({"item": batch["item"], "tokens": new})
                items.extend(gathered["item"].tolist())
                tokens.extend(gathered["tokens"].tolist())
        finally:
            bare.train(was_training)
        texts, lengths = [], []
        for row in tokens:
            kept = self.strip(row, eos, getattr(bare.config, "decoder_start_token_id", None))
            lengths.append(len(kept))
            texts.append(decode_output(self.tokenizer, kept))  # as the round-trip check decodes targets
        order = sorted(range(len(items)), key=items.__getitem__)
        return GeneratedItems([items[i] for i in order], [texts[i] for i in order], [lengths[i] for i in order])

    def end_tokens(self, model) -> set[int]:
        eos = model.generation_config.eos_token_id
        return set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}

    def strip(self, row: list[int], eos: set[int], start: int | None) -> list[int]:
        """The generated tokens before the first end token (a seq2seq model's decoder start token dropped); an
        output cut by --generation_max_new_tokens loses only the padding that evened out the batch."""
        if self.seq2seq and row and row[0] == start:
            row = row[1:]
        for i, token in enumerate(row):
            if token in eos:
                return row[:i]
        while row and row[-1] == self.tokenizer.pad_token_id:
            row = row[:-1]
        return row

    def references(self, items: Sequence[int]) -> list[str]:
        """The raw reference strings of `items` (the data's targets, or a chat's last reply), normalised."""
        return [normalise_text(self.split.references[i]) for i in items]

    def round_trips(self, items: Sequence[int]) -> list[str]:
        """What the tokenizer writes of each reference of `items`: decode(encode(reference)), decoded as outputs are."""
        return round_trips(self.tokenizer, [self.split.references[i] for i in items], self.seq2seq)


def evaluate_generation(generator: Generator, accelerator, model, metrics: Mapping[str, Any],
                        prefix: str) -> tuple[dict[str, float], list[dict]]:
    """Generate, score, and the rows of predictions.jsonl (item, source, the reference, its round trip and the output
    exactly as scored). The outputs are scored against the raw references and, as `{prefix}_{score}_vs_round_trip`,
    against what the tokenizer writes of them (roundtrip.py); with --lead_baseline_words N, the lead-N baseline (the
    source's first N words, as written) scored on the same items under `{prefix}_leadN_`."""
    done = generator.generate(accelerator, model)
    references, trips = generator.references(done.items), generator.round_trips(done.items)
    scores = {f"{prefix}_{k}": v for k, v in score_generations(done.outputs, references, metrics, done.lengths).items()}
    against_trips = score_generations(done.outputs, trips, metrics)
    scores.update({f"{prefix}_{k}_vs_round_trip": against_trips[k] for k in ROUND_TRIP_SCORES if k in against_trips})
    scores[f"{prefix}_generated_items"] = float(len(done.items))
    n = generator.args.lead_baseline_words
    sources = [generator.split.sources[i] for i in done.items]
    if n > 0:
        lead = [lead_words(s, n) for s in sources]
        scores.update({f"{prefix}_lead{n}_{k}": v for k, v in score_generations(lead, references, metrics).items()})
    rows = [{"item": i, "source": s, "reference": r, "round_trip": t, "output": o}
            for i, s, r, t, o in zip(done.items, sources, references, trips, done.outputs, strict=True)]
    return scores, rows


def write_predictions(path: Path, rows: Sequence[dict]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
