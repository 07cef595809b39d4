"""Text generation: raw splits to token ids, and the collators that pad them.

Every split becomes a `datasets.Dataset` with

* ``input_ids`` and ``labels`` — what the model trains on. Seq2seq: the source, and the target ids (the decoder
  start token dropped when the tokenizer put it there: the model prepends it when it shifts the labels right).
  Causal: prompt + completion + eos, the labels -100 on the prompt unless `train_on_prompt`. Chats
  (`chat.py`): every assistant turn with its end-of-turn tokens learned. Language modelling: blocks of
  `block_size` tokens, labels = input ids (the model shifts them). The validation split's labels are on the
  completion only, whatever `train_on_prompt` says;
* ``prompt_ids`` (pairs and chat only) — what generation starts from: the source of a seq2seq model, the
  prompt of a causal LM; with ``item``, the row number, so outputs find their source and reference.

The labels always end with the end-of-sequence (or end-of-turn) token, also when --max_target_length cuts a target
(how many were cut is counted per split): where pad and eos are the same token (a causal LM without a pad token),
padding is marked with -100 by the collator, never by looking for the pad id, so the model still learns to stop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import datasets
import torch

from ....core.loss import IGNORE_INDEX
from ....errors import ConfigError, DataError, ModelError
from ..buckets import LengthBuckets
from .chat import ChatExample, chat_example
from .data import GenerationDataArguments, TaskColumns, check_texts
from .roundtrip import RoundTrip, check_round_trip


@dataclass(frozen=True)
class ModelFacts:
    """What tokenization needs to know of the model: its family, decoder start token and position limits."""

    seq2seq: bool
    decoder_start_token_id: int | None = None
    source_positions: int | None = None  # encoder (seq2seq)
    target_positions: int | None = None  # decoder (seq2seq)
    positions: int | None = None  # a causal LM's


@dataclass
class TokenizedSplit:
    tokens: datasets.Dataset  # input_ids, labels (+ prompt_ids, item for pairs and chat)
    sources: list[str]  # shown in predictions.jsonl
    references: list[str]  # the raw targets (a chat's last reply)
    can_generate: bool  # pairs and chat; not language-modelling blocks
    targets: int = 0  # targets (pairs) or assistant replies (chats) in the split
    targets_cut: int = 0  # of those, cut to --max_target_length
    round_trip: RoundTrip | None = None  # how many targets come back from decode(encode(target)) (roundtrip.py)


def tokenize_splits(raw: datasets.DatasetDict, tokenizer, args: GenerationDataArguments, task: TaskColumns,
                    model: ModelFacts, max_new_tokens: int = 0) -> dict[str, TokenizedSplit]:
    """{"train": ..., "validation": ...} as token ids, checked first (lengths against the model's positions, with
    `max_new_tokens` of generation; columns; empty targets)."""
    check_lengths(args, task, model, max_new_tokens)
    end_token_id(tokenizer, model.seq2seq)
    out = {}
    for name, split in raw.items():
        check_texts(split, task, name)
        if name != "train":  # --train_on_prompt widens what is learned; evaluation scores the completion only
            args = dataclasses.replace(args, train_on_prompt=False)
        if task.kind == "lm":
            block = args.block_size or min(1024, model.positions or 1024)
            texts = split[task.source]
            whole = args.packing or args.padding_free  # each text a document of its own, never run into the next
            tokens = lm_documents(texts, tokenizer, block, args.packing_split, name) if whole \
                else lm_blocks(texts, tokenizer, block, name)
            out[name] = TokenizedSplit(tokens, [], [], False)
            continue
        if task.kind == "chat":
            chats = [chat_rows(m, tokenizer, args, name, row) for row, m in enumerate(split[task.messages])]
            rows = [c.row() for c in chats]
            sources = [tokenizer.decode(r["prompt_ids"], skip_special_tokens=True) for r in rows]
            references = [m[-1]["content"] for m in split[task.messages]]
            targets, cut = sum(c.replies for c in chats), sum(c.cut for c in chats)
        else:
            sources, references = list(split[task.source]), list(split[task.target])
            if model.seq2seq:
                rows = [seq2seq_example(s, t, tokenizer, args, model.decoder_start_token_id)
                        for s, t in zip(sources, references, strict=True)]
            else:
                rows = [causal_example(s, t, tokenizer, args) for s, t in zip(sources, references, strict=True)]
            targets, cut = len(rows), sum(r.pop("cut") for r in rows)
        columns = {key: [r[key] for r in rows] for key in ("input_ids", "labels", "prompt_ids")}
        columns["item"] = list(range(len(rows)))
        out[name] = TokenizedSplit(datasets.Dataset.from_dict(columns), sources, references, True, targets, cut,
                                   check_round_trip(tokenizer, references, model.seq2seq))
    return out


def chat_rows(messages, tokenizer, args: GenerationDataArguments, split: str, row: int) -> ChatExample:
    try:
        return chat_example(messages, tokenizer, args.max_source_length, args.max_target_length,
                            args.train_on_prompt)
    except DataError as err:
        raise DataError(f"{split} row {row}: {err}") from None


def check_lengths(args: GenerationDataArguments, task: TaskColumns, model: ModelFacts, max_new_tokens: int = 0) -> None:
    """Lengths beyond the model's position embeddings would index past them (an IndexError deep inside, in
    training or, worse, in the generation at the end of the run): checked before anything is trained."""
    if model.seq2seq:  # the decoder also holds its start token
        limits = (("max_source_length", args.max_source_length, model.source_positions, "the encoder"),
                  ("max_target_length", args.max_target_length, model.target_positions, "the decoder"),
                  ("generation_max_new_tokens (+ the decoder start token)", max_new_tokens + 1,
                   model.target_positions, "the decoder"))
    elif task.kind == "lm":
        limits = (("block_size", args.block_size or 0, model.positions, "the model"),)
    else:
        limits = (("max_source_length + --max_target_length", args.max_source_length + args.max_target_length,
                   model.positions, "the model"),
                  ("max_source_length + --generation_max_new_tokens", args.max_source_length + max_new_tokens,
                   model.positions, "the model (a prompt and what is generated after it)"))
    for flag, value, limit, where in limits:
        if limit and value > limit:
            raise ConfigError(f"--{flag} = {value} exceeds the {limit} positions of {where}: lower it to {limit} "
                              "or less (inputs are truncated to it).")


def end_token_id(tokenizer, seq2seq: bool) -> int:
    """The token every target ends with: eos; for a seq2seq model [SEP] where there is no eos (a BERT tokenizer, of
    a warm-started encoder-decoder). A ModelError when there is none: the model learns to stop by writing it."""
    end = tokenizer.eos_token_id
    if end is None and seq2seq:
        end = tokenizer.sep_token_id
    if end is not None:
        return end
    if seq2seq:
        raise ModelError("this seq2seq model's tokenizer has neither an end-of-sequence nor a separator token: every "
                         "target ends with one, which is how the model learns to stop (without it each output would "
                         "run to --generation_max_new_tokens). Give a tokenizer that has one (--tokenizer_name), or "
                         "add it: tokenizer.eos_token = '...'.")
    raise ModelError("this causal LM's tokenizer has no end-of-sequence token: a causal LM learns to stop by writing "
                     "it after every completion (and between language-modelling texts). Give a tokenizer that has "
                     "one (--tokenizer_name), or add it: tokenizer.eos_token = '...'.")


def seq2seq_example(source: str, target: str, tokenizer, args: GenerationDataArguments,
                    decoder_start_token_id: int | None) -> dict:
    ids = tokenizer(args.source_prefix + source, max_length=args.max_source_length, truncation=True)["input_ids"]
    full = tokenizer(text_target=target)["input_ids"]
    labels = tokenizer(text_target=target, max_length=args.max_target_length, truncation=True)["input_ids"]
    # A BERT tokenizer opens every text with [CLS], the warm-started decoder's start token, which the model
    # prepends itself when it shifts the labels: keep it in the labels and the model learns to say it twice.
    if len(labels) > 1 and labels[0] == decoder_start_token_id:
        labels = labels[1:]
    # A tokenizer that does not close texts with eos (a BPE trained here, some others): without it in the
    # labels the model never learns to stop, and every output runs to --generation_max_new_tokens.
    end = end_token_id(tokenizer, seq2seq=True)
    if labels and labels[-1] != end:
        labels = labels[:args.max_target_length - 1] + [end]
    return {"input_ids": ids, "labels": labels, "prompt_ids": ids, "cut": len(full) > args.max_target_length}


def prompt_tokens(text: str, tokenizer, args: GenerationDataArguments) -> list[int]:
    """Prefix + prompt, cut to leave room for the suffix, + suffix: the completion always follows the suffix."""
    ids = tokenizer(args.source_prefix + text)["input_ids"]
    if tokenizer.eos_token_id is not None and ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]  # a tokenizer that closes every text with eos: the prompt is not finished
    suffix = tokenizer(args.prompt_suffix, add_special_tokens=False)["input_ids"] if args.prompt_suffix else []
    return ids[:max(args.max_source_length - len(suffix), 1)] + suffix


def completion_example(prompt: list[int], completion: list[int], args: GenerationDataArguments) -> dict:
    ids = prompt + completion
    labels = list(ids) if args.train_on_prompt else [IGNORE_INDEX] * len(prompt) + completion
    return {"input_ids": ids, "labels": labels, "prompt_ids": prompt}


def causal_example(source: str, target: str, tokenizer, args: GenerationDataArguments) -> dict:
    completion = tokenizer(target, add_special_tokens=False)["input_ids"]
    kept = completion[:args.max_target_length - 1]
    row = completion_example(prompt_tokens(source, tokenizer, args), kept + [tokenizer.eos_token_id], args)
    return {**row, "cut": len(kept) < len(completion)}


def lm_blocks(texts: Sequence[str], tokenizer, block_size: int, name: str) -> datasets.Dataset:
    """Concatenate the texts (eos after each) and cut blocks of `block_size` tokens; the remainder is dropped."""
    stream: list[int] = []
    for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        stream.extend(ids + [tokenizer.eos_token_id])
    count = len(stream) // block_size
    if count == 0:
        raise DataError(f"the {name} split has {len(stream)} tokens, fewer than one block of --block_size "
                        f"{block_size}; give more text or a smaller --block_size.")
    blocks = [stream[i * block_size:(i + 1) * block_size] for i in range(count)]
    return datasets.Dataset.from_dict({"input_ids": blocks, "labels": blocks})


def lm_documents(texts: Sequence[str], tokenizer, limit: int, split: bool, name: str) -> datasets.Dataset:
    """Each text with eos after it, an example of its own (packed or padding-free language modelling). A text
    longer than `limit` tokens (the block size) is cut into pieces of `limit` with `split`, else refused."""
    docs = [ids + [tokenizer.eos_token_id] for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
    long = [len(d) for d in docs if len(d) > limit]
    if long and not split:
        raise DataError(f"{len(long)} of {len(docs)} {name} texts are longer than the block size {limit} (the "
                        f"longest: {max(long)} tokens, eos included): pass --packing_split to cut them into "
                        "pieces, or give --block_size up to the model's positions.")
    pieces = [d[s:s + limit] for d in docs for s in range(0, len(d), limit)]
    return datasets.Dataset.from_dict({"input_ids": pieces, "labels": pieces})


def packing_width(args: GenerationDataArguments, task: TaskColumns, model: ModelFacts) -> int:
    """--max_seq_length, or the longest an example can be: source + target, or the language-modelling block."""
    if args.max_seq_length:
        return args.max_seq_length
    if task.kind == "lm":
        return args.block_size or min(1024, model.positions or 1024)
    return args.max_source_length + args.max_target_length


def pad(rows: Sequence[Sequence[int]], value: int, side: str, multiple: int | None = None,
        buckets: LengthBuckets | None = None) -> torch.Tensor:
    width = max(len(r) for r in rows)
    if buckets is not None:  # its widths are multiples of `multiple` already
        width = buckets.width(width)
    elif multiple:
        width = -(-width // multiple) * multiple
    fill = [[value] * (width - len(r)) for r in rows]
    return torch.tensor([list(r) + f if side == "right" else f + list(r) for r, f in zip(rows, fill, strict=True)])


class TrainCollator:
    """Right-padded training batch: ``input_ids`` (pad id), ``attention_mask``, ``labels`` (-100). A seq2seq
    model builds its decoder inputs from the labels; a causal LM shifts them. Written here rather than taken
    from transformers because one collator then serves both families and pads labels by length, never by
    value (pad may equal eos). With `buckets` (--length_buckets) each of input_ids and labels is padded to the
    bucket of its longest row (a seq2seq model's source and target each to its own)."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int | None = None, buckets: LengthBuckets | None = None):
        self.pad_token_id, self.multiple, self.buckets = pad_token_id, pad_to_multiple_of, buckets

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [r["input_ids"] for r in rows]
        widths = (self.multiple, self.buckets)
        return {"input_ids": pad(ids, self.pad_token_id, "right", *widths),
                "attention_mask": pad([[1] * len(r) for r in ids], 0, "right", *widths),
                "labels": pad([r["labels"] for r in rows], IGNORE_INDEX, "right", *widths)}


class GenerationCollator:
    """Batch of prompts to generate from: padded on the left for a causal LM (the new tokens must follow each
    prompt directly), on the right for an encoder; ``item`` carries the row numbers."""

    def __init__(self, pad_token_id: int, side: str):
        self.pad_token_id, self.side = pad_token_id, side

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids = [r["prompt_ids"] for r in rows]
        return {"input_ids": pad(ids, self.pad_token_id, self.side),
                "attention_mask": pad([[1] * len(r) for r in ids], 0, self.side),
                "item": torch.tensor([r["item"] for r in rows])}
