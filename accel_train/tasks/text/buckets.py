"""Length buckets: each batch padded up to the smallest of a few fixed lengths that holds it (--length_buckets).

Dynamic padding gives each batch the length of its longest row (rounded up to a multiple of 8 under bf16/fp16), so
a run sees dozens of sequence lengths; with --torch_compile each one may compile the model again (a static graph per
length, or one dynamic-shape graph whose kernels are generic in the length). Buckets leave a few shapes: compile
builds one static graph per bucket (the recipes ask for static shapes when buckets are on) and then never again.

    --length_buckets 32,64,128     these widths (each rounded up to the pad multiple); the largest must hold the
                                   longest row the recipe can make (its --max_seq_length, ...)
    --length_buckets auto          16, 24, 32, 48, 64, 96, ... (each at most 1.5x the one below) up to the longest
                                   row, then the longest row itself; the largest 8 of them: 16,24,32,48,64,96,128 for
                                   128 tokens, 384,...,4096 for 4096 (shorter batches pad to the smallest)

`allow_recompiles` raises torch._dynamo's recompile limit (8 graphs per function) to hold them all.

The padding is masked as dynamic padding's is (attention_mask 0, labels -100 on token labels), so a bucketed batch
has the same loss and gradients as the unbucketed one; it costs the extra pad tokens, which the recipes report as
their padding share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError, DataError

FLAG = "--length_buckets"
MAX_BUCKETS = 8  # a few shapes is the point; each compiles a graph in training and one in evaluation
SMALLEST_AUTO = 16


@dataclass(frozen=True)
class LengthBuckets:
    """The widths a batch may be padded to, increasing."""

    widths: tuple[int, ...]

    def width(self, longest: int) -> int:
        """The smallest width that holds a row of `longest` tokens."""
        for size in self.widths:
            if size >= longest:
                return size
        raise DataError(f"a batch has a row of {longest} tokens, longer than the largest of {FLAG} "
                        f"{','.join(map(str, self.widths))}: add a larger width (or use {FLAG} auto).")

    def describe(self) -> str:
        return ",".join(map(str, self.widths))


def round_up(n: int, multiple: int | None) -> int:
    return -(-n // multiple) * multiple if multiple else n


def resolve_buckets(spec: str | None, longest: int, multiple: int | None) -> LengthBuckets | None:
    """The buckets `spec` asks for (None: off) for rows of at most `longest` tokens, padded to `multiple` (8 under
    bf16/fp16, else None): widths are rounded up to it; refused when the largest cannot hold `longest`."""
    if spec is None or spec.strip() == "":
        return None
    top = round_up(longest, multiple)
    if spec.strip().lower() == "auto":
        # 16, 24, 32, 48, 64, 96, ...: each at most 1.5x the one below, so a batch pads at most a third of its width
        steps = [base * 2 ** k for k in range(32) for base in (SMALLEST_AUTO, SMALLEST_AUTO * 3 // 2)]
        widths = sorted({round_up(w, multiple) for w in steps if w < top} | {top})
        return LengthBuckets(tuple(widths[-MAX_BUCKETS:]))
    try:
        asked = [int(part) for part in spec.split(",")]
    except ValueError:
        raise ConfigError(f"{FLAG} {spec}: give increasing token counts separated by commas (e.g. 32,64,128) or "
                          "auto.") from None
    if any(w < 1 for w in asked) or asked != sorted(set(asked)):
        raise ConfigError(f"{FLAG} {spec}: the widths must be positive and increasing (e.g. 32,64,128).")
    widths = tuple(sorted({round_up(w, multiple) for w in asked}))
    if len(widths) > MAX_BUCKETS:
        raise ConfigError(f"{FLAG} {spec}: {len(widths)} widths; each compiles a graph for training and one for "
                          f"evaluation, and a few shapes is the point of buckets. Give at most {MAX_BUCKETS}.")
    if widths[-1] < longest:
        raise ConfigError(f"{FLAG} {spec}: the largest width {widths[-1]} cannot hold the longest row this run can "
                          f"have ({longest} tokens): add a width of at least {longest}, or use {FLAG} auto.")
    return LengthBuckets(widths)


def allow_recompiles(buckets: LengthBuckets | None) -> None:
    """Raise dynamo's recompile limit (8 graphs per function, past which it runs the model uncompiled, silently but
    for a log line) to hold a static graph per width in training and another in evaluation (a model in eval mode
    without gradients compiles its own), plus the pre-flight check's two. Never lowers it; nothing without buckets."""
    if not buckets:
        return
    import torch._dynamo

    needed = 2 * len(buckets.widths) + 4
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, needed)


class BucketedPadding:
    """A tokenizer's padding (transformers' DataCollatorWithPadding, the tokenizer's padding side) to the bucket of
    the batch's longest row instead of to the longest row."""

    def __init__(self, tokenizer, buckets: LengthBuckets):
        self.tokenizer, self.buckets = tokenizer, buckets

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, Any]:
        from transformers import DataCollatorWithPadding

        width = self.buckets.width(max(len(f["input_ids"]) for f in features))
        return DataCollatorWithPadding(self.tokenizer, padding="max_length", max_length=width)(features)


def padded_batches_reason(length_buckets: str | None, group_by_length: bool) -> str | None:
    """What in a text recipe's padded batches asks for batches of examples rather than the recipes' default token
    budget (core/token_batches.py: default_budget), or None: buckets (a budget's micro-batches vary in rows, so
    compiled, each (rows, width) would be another graph) and random batches."""
    if length_buckets:
        return "--length_buckets pads to a few widths so that --torch_compile compiles a few graphs"
    return None if group_by_length else "--no_group_by_length asks for random batches"
