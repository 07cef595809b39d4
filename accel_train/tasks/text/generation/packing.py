"""Packed and padding-free training batches for causal LMs, provably the same training as padded batches.

`--packing` places whole examples into rows of `--max_seq_length` tokens by best-fit-decreasing bin packing
(longest first, each into the fullest row it fits; an example is cut only with `--packing_split`).
`--padding_free` keeps each micro-batch's examples and writes them into one row, with no padding at all
(what transformers' `DataCollatorWithFlattening` does). In both, every example is a document of its own:

* position ids restart at 0 at every example, so positions are the ones it has alone;
* there is no attention mask: transformers' mask code reads the restarts (`find_packed_sequence_indices`) and
  builds a block-diagonal causal mask (sdpa, eager, flex), or FlashAttention's varlen kernel takes them, so an
  example attends only to itself. It does so only without a KV cache, and a model in training builds one unless
  told not to (`use_cache` defaults to the config's True; transformers 5.24: the examples then attend to each
  other, 0.15 logit error on a tiny Llama): the batch says `use_cache=False`. Not every model and back-end keeps
  the examples apart: `check_isolation` runs the model on two packed examples before training and refuses
  packing where the second one's logits change;
* the label of each example's first token is -100: in a padded row the causal shift never scores it either,
  and in a packed row it would be the prediction of this example's first token from the previous example.

So a packed batch scores the same tokens with the same logits as the padded batches of the same examples, and
the token-sum loss (`default_loss`) gives the same step gradient. The rows carry their count of non-padding tokens
(`REAL_TOKENS`) for the loop's tokens/s. This collator is written here rather than taken from transformers because
one collator serves packed rows (several per batch, padded to the longest) and padding-free rows, with the count.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import torch

from ....core.data import EXAMPLES, REAL_TOKENS
from ....core.loss import IGNORE_INDEX
from ....core.token_batches import default_budget
from ....errors import ConfigError, DataError
from ..buckets import LengthBuckets, padded_batches_reason, round_up
from .tokens import TrainCollator, pad

ISOLATION_TOLERANCE = 1e-4  # fp32 logits of one example, packed beside another vs alone (measured: ~1e-6)


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Indices of `lengths` grouped into bins of at most `capacity`: longest first, each into the bin with the
    least room that still holds it (a new bin when none does). Deterministic: ties keep the input order."""
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, bin number), sorted: the best fit is the first that holds it
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        size = lengths[i]
        if size > capacity:
            raise ValueError(f"item {i} has length {size}, more than the capacity {capacity}")
        k = bisect.bisect_left(room, (size, -1))
        if k == len(room):
            bins.append([i])
            bisect.insort(room, (capacity - size, len(bins) - 1))
        else:
            left, b = room.pop(k)
            bins[b].append(i)
            bisect.insort(room, (left - size, b))
    return bins


@dataclass(frozen=True)
class Packed:
    """Rows of whole examples: ``input_ids``, ``labels`` (-100 at each example's first token), ``position_ids``."""

    rows: datasets.Dataset
    groups: list[list[int]]  # per row, the documents in it (numbers of the examples, or of pieces with split)
    examples: int  # documents packed (pieces, with --packing_split)
    real_tokens: int
    width: int

    @property
    def padding_share(self) -> float:
        """Padding if every row were padded to the full width (the collator pads a batch to its longest row)."""
        return 1 - self.real_tokens / max(len(self.rows) * self.width, 1)


def pack_examples(examples: datasets.Dataset, width: int, split: bool = False) -> Packed:
    """`examples` (``input_ids``, ``labels``) packed into rows of at most `width` tokens. An example longer than
    `width` is a DataError unless `split`: then it is cut into pieces of `width`, each a document of its own."""
    ids, labels = examples["input_ids"], examples["labels"]
    long = [len(i) for i in ids if len(i) > width]
    if long and not split:
        raise DataError(f"{len(long)} of {len(ids)} training examples are longer than --max_seq_length {width} "
                        f"(the longest has {max(long)} tokens) and --packing never cuts an example: raise "
                        f"--max_seq_length to {max(long)}, or pass --packing_split to cut them into pieces (each "
                        "piece trains without the context before it).")
    pieces = [(i[s:s + width], lab[s:s + width]) for i, lab in zip(ids, labels, strict=True)
              for s in range(0, len(i), width)]
    rows: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
    groups = best_fit_decreasing([len(p[0]) for p in pieces], width)
    for members in groups:
        row = [pieces[m] for m in members]
        rows["input_ids"].append([t for p_ids, _ in row for t in p_ids])
        rows["labels"].append([t for _, p_labels in row for t in first_unscored(p_labels)])
        rows["position_ids"].append([t for p_ids, _ in row for t in range(len(p_ids))])
    return Packed(datasets.Dataset.from_dict(rows), groups, len(pieces), sum(len(p[0]) for p in pieces), width)


def first_unscored(labels: Sequence[int]) -> list[int]:
    return [IGNORE_INDEX, *labels[1:]]


class PackedCollator:
    """Rows of packed examples (with ``position_ids``) or single examples (without) into a batch with no attention
    mask: ``input_ids``, ``labels``, ``position_ids``, the counts of non-padding tokens and of rows. `flatten`: the
    batch is one row of all its examples (padding-free); else the rows are right-padded to the longest, the padding
    tokens each a one-token document of their own (position 0, label -100): causal attention never lets a real token
    see them."""

    def __init__(self, pad_token_id: int, flatten: bool = False, pad_to_multiple_of: int | None = None):
        self.pad_token_id, self.flatten, self.multiple = pad_token_id, flatten, pad_to_multiple_of

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [list(r["input_ids"]) for r in rows]
        positions = [list(r["position_ids"]) if "position_ids" in r else list(range(len(r["input_ids"])))
                     for r in rows]
        labels = [list(r["labels"]) if "position_ids" in r else first_unscored(r["labels"]) for r in rows]
        if self.flatten:
            ids, labels, positions = ([[t for row in rows_ for t in row]] for rows_ in (ids, labels, positions))
        multiple = None if self.flatten else self.multiple
        return {"input_ids": pad(ids, self.pad_token_id, "right", multiple),
                "labels": pad(labels, IGNORE_INDEX, "right", multiple),
                "position_ids": pad(positions, 0, "right", multiple),
                "use_cache": False,  # transformers reads the restarts only without a cache, and models make one
                REAL_TOKENS: torch.tensor(sum(len(r) for r in ids)),
                EXAMPLES: len(rows)}  # padding-free: one row, many examples (samples/s counts examples)


def isolation_error(model, vocab_size: int) -> float:
    """The largest change in one example's logits when another is packed before it (0 when isolated)."""
    first = torch.arange(3, 8).clamp_max(vocab_size - 1)
    second = torch.arange(9, 13).clamp_max(vocab_size - 1)
    batch = PackedCollator(0)([{"input_ids": torch.cat([first, second]).tolist(), "labels": [0] * 9,
                                "position_ids": [*range(5), *range(4)]}])
    inputs = {k: v for k, v in batch.items() if k not in ("labels", REAL_TOKENS, EXAMPLES)}  # what the model gets
    was_training = model.training
    model.eval()
    with torch.no_grad():
        packed = model(**inputs).logits[0, 5:]
        alone = model(input_ids=second[None], use_cache=False).logits[0]
    model.train(was_training)
    return float((packed.float() - alone.float()).abs().max())


def check_isolation(model, vocab_size: int, flag: str) -> None:
    """Refuse packing on a model whose attention lets packed examples see each other."""
    error = isolation_error(model, vocab_size)
    if error > ISOLATION_TOLERANCE:
        implementation = getattr(model.config, "_attn_implementation", None) or "the default"
        raise ConfigError(f"{flag}: {type(model).__name__} with attention {implementation!r} does not keep packed "
                          f"examples apart (an example's logits changed by {error:.3g} when another was packed "
                          "before it): it ignores the position-id restarts that mark where an example starts. Try "
                          "--attn_implementation sdpa (or flash_attention_2 on a GPU with flash-attn), or train "
                          f"without {flag}.")


@dataclass
class TrainingSet:
    """What the training loader is built from: the rows, their collator, their lengths for length grouping (None:
    no grouping), a line for the start-up report, and the rows' padding share for all_results.json
    (train_padding_ratio: packed rows as if each were padded to the full width, as the start-up line says;
    padding-free rows 0; None for padded batches); `packed`: rows of several examples, longest first (--packing),
    not the examples in their order."""

    rows: datasets.Dataset
    collator: Any
    lengths: list[int] | None
    summary: str
    padding_ratio: float | None = None
    packed: bool = False


def training_set(examples: datasets.Dataset, args, width: int, pad_token_id: int, multiple: int | None,
                 model, buckets: LengthBuckets | None = None, max_tokens: int | str = 0) -> TrainingSet:
    """Padded batches (to their length bucket with `buckets`), packed rows of `width` tokens (`args.packing`) or
    padding-free rows (`args.padding_free`) of `examples`; packing is refused where `model` does not keep packed
    examples apart. With `max_tokens` (--max_tokens_per_batch) the lengths are the widths the collator pads each
    example to, which the loader's plan bounds."""
    if max_tokens:
        refuse_token_budget(args, model, max_tokens)
        widths = [buckets.width(len(i)) if buckets else round_up(len(i), multiple) for i in examples["input_ids"]]
        most = ("the auto budget (the start-up report gives it)" if isinstance(max_tokens, str)
                else f"{max_tokens} padded tokens")
        return TrainingSet(examples, TrainCollator(pad_token_id, multiple, buckets), widths,
                           f"token budget: batches of at most {most} (rows x longest row)")
    lengths = [len(i) + len(lab) for i, lab in zip(examples["input_ids"], examples["labels"], strict=True)]
    vocab_size = model.get_input_embeddings().num_embeddings
    if args.packing:
        check_isolation(model, vocab_size, "--packing")
        packed = pack_examples(examples, width, args.packing_split)
        return TrainingSet(packed.rows, PackedCollator(pad_token_id, pad_to_multiple_of=multiple), None,
                           f"packed: {packed.examples} examples into {len(packed.rows)} rows of at most "
                           f"{packed.width} tokens, padding {100 * packed.padding_share:.1f}%", packed.padding_share,
                           packed=True)
    if args.padding_free:
        check_isolation(model, vocab_size, "--padding_free")
        return TrainingSet(examples, PackedCollator(pad_token_id, flatten=True),
                           lengths if args.group_by_length else None,
                           "padding-free: each micro-batch one row of its examples, no padding", 0.0)
    return TrainingSet(examples, TrainCollator(pad_token_id, multiple, buckets),
                       lengths if args.group_by_length else None,
                       f"length buckets: each batch padded to the smallest of {buckets.describe()} tokens that holds "
                       "it" if buckets else "")


def check_packing_flags(args, seq2seq: bool) -> None:
    """Packing and padding-free batches are for causal LMs."""
    flag = "--packing" if args.packing else "--padding_free" if args.padding_free else None
    if flag and seq2seq:
        raise ConfigError(f"{flag} is for causal LMs; this model is an encoder-decoder (its encoder and decoder "
                          f"inputs are separate sequences). Drop {flag}, or train a causal LM.")


def default_batching(config, accelerator, args, seq2seq: bool):
    """The recipe's default batching, (config, the line that says it): a token budget (--max_tokens_per_batch auto)
    unless the run chose its own or needs batches of examples (fixed_batches_reason; core/token_batches.py)."""
    return default_budget(config, accelerator, fixed_batches_reason(args, seq2seq))


def fixed_batches_reason(args, seq2seq: bool) -> str | None:
    """Why this run's batches are of examples, not the recipes' default token budget (core/token_batches.py:
    default_budget), or None: what refuse_token_budget refuses an explicit budget for, and random batches."""
    if args.packing:
        return "--packing fills rows of --max_seq_length tokens already"
    if args.padding_free:
        return "--padding_free makes each micro-batch one row of its examples"
    if seq2seq:
        return "this model is an encoder-decoder, whose source and target are padded apart"
    return padded_batches_reason(args.length_buckets, args.group_by_length)


def refuse_token_budget(args, model, max_tokens: int | str) -> None:
    """--max_tokens_per_batch plans batches of rows x longest row: what batches otherwise is refused, with why."""
    budget = f"--max_tokens_per_batch {max_tokens}"
    if args.packing:
        raise ConfigError(f"{budget} and --packing: packing fills rows of --max_seq_length tokens already (a token "
                          "budget of rows x --max_seq_length per micro-batch). Give one of them: --packing with "
                          f"--per_device_train_batch_size rows, or {budget} without --packing.")
    if args.padding_free:
        raise ConfigError(f"{budget} and --padding_free: a padding-free micro-batch is one row of its examples, "
                          "whose tokens are the sum of their lengths, not the rows x longest row the plan bounds. "
                          f"Give one of them.")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ConfigError(f"{budget}: this model is an encoder-decoder, whose source and target are padded apart "
                          "(rows x longest source + rows x longest target), which the plan's rows x longest row does "
                          "not bound. Train a causal LM, or use --per_device_train_batch_size.")
