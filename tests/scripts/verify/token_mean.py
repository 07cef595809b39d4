"""Seeded bug: a per-token loss averaged over the tokens of each micro-batch, on rows of very different lengths. With
accumulation each micro-batch's mean then weighs as much as the others whatever its token count, so a token in a short
micro-batch counts for more than one in a long one: k accumulated micro-batches train another objective than one
batch of kB (the 2024 gradient-accumulation bug of the Trainer). verify's accumulation check flags it.

The twin follows the project's per-token loss contract (README, accel_train/core/loss.py): it returns the token SUM
and the token count, {"loss_sum": ..., "num_items": ...}, and the loop divides by the tokens of the whole
accumulation window on all processes.

The task: a tiny token tagger (an embedding and a linear head). The rows are stored in blocks of 8 of similar length
(as a dataset bucketed by length, or concatenated from sources of short and long texts, is) and fed in that order:
blocks of short rows (1 to 4 tokens, every label 0: one micro-batch's mean gradient is large) alternate with blocks
of long rows (17 to 32 tokens, labels spread over the vocabulary: a small mean gradient). With 2 micro-batches of 8
the token mean gives the short block half the weight of the step, where it holds a tenth of its tokens.

`--order grouped`: the same rows in another arrangement, as most text data comes: each row short or long at random
(a quarter short), read through the project's loader in batches of similar lengths (make_loader with the lengths,
as the NLP recipes read theirs). No order of the script's then makes the micro-batches unequal: verify's own choice of
step 1's examples (the shortest and the longest of the set, core/data.py's UnequalFirstStep) must.
"""

from dataclasses import dataclass

import torch
from common import parse, run
from torch.utils.data import Dataset

from accel_train import run_cli

VOCAB = 16
LONGEST = 32
BLOCK = 8  # rows of similar length stored together


@dataclass(frozen=True)
class TokenMeanArgs:
    fixed: bool = False  # the twin: token sums and counts
    num_samples: int = 64
    order: str = "blocks"  # blocks: stored in blocks of 8, fed in order; grouped: random lengths, length-grouped


def is_short(i: int, order: str) -> bool:
    if order == "blocks":
        return (i // BLOCK) % 2 == 0
    return bool(torch.rand((), generator=torch.Generator().manual_seed(10_000 + i)) < 0.25)


class Rows(Dataset):
    """Row `i`: its tokens and labels, a function of the index alone."""

    def __init__(self, n: int, order: str = "blocks"):
        self.n, self.order = n, order

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(f"row {i} of {self.n}")
        g = torch.Generator().manual_seed(i)
        short = is_short(i, self.order)
        length = 1 + int(torch.randint(0, 4, (1,), generator=g)) if short else \
            17 + int(torch.randint(0, LONGEST - 16, (1,), generator=g))
        ids = torch.randint(1, VOCAB, (length,), generator=g)
        return {"input_ids": ids, "labels": torch.zeros_like(ids) if short else ids}


def pad(items):
    """Right padding with 0; labels -100 on the padding."""
    longest = max(len(item["input_ids"]) for item in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    labels = torch.full((len(items), longest), -100, dtype=torch.long)
    for row, item in enumerate(items):
        ids[row, :len(item["input_ids"])] = item["input_ids"]
        labels[row, :len(item["labels"])] = item["labels"]
    return {"input_ids": ids, "labels": labels}


def tagger() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Tanh(), torch.nn.Linear(16, VOCAB))


def main(argv=None):
    config, args = parse(argv, TokenMeanArgs)

    def loss_fn(model, batch):
        logits, labels = model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten()
        if not args.fixed:  # the bug: the mean over this micro-batch's tokens
            return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100)
        total = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
        return {"loss_sum": total, "num_items": (labels != -100).sum()}

    rows = Rows(args.num_samples, args.order)
    lengths = [len(rows[i]["input_ids"]) for i in range(len(rows))] if args.order == "grouped" else None
    run(config, args, rows, loss_fn, make_model=tagger, collate_fn=pad, shuffle=False, lengths=lengths)


if __name__ == "__main__":
    run_cli(main)
