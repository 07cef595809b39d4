"""Seeded bug: a collator that sorts a batch's rows by length (as packing or pack_padded_sequence wants) and leaves
the labels in the order the rows came: each row is trained on another row's label, and which one depends on the rows
the batch holds. k micro-batches of B are sorted within each micro-batch, one batch of kB across all of them: they
pair other inputs with other labels. verify's accumulation (and world-size) check flags it by the gradient's
DIRECTION only: the classifier starts at zero (a zero-initialised head), so step 1's loss is log(classes) whatever
the labels, and the rows' features are orthonormal, so the gradient's norm does not depend on which row got which
label either. Before verify compared whole gradients, this bug passed.

The twin sorts the labels with the rows.
"""

from dataclasses import dataclass

import torch
from common import parse, run
from torch.utils.data import Dataset

from accel_train import run_cli

CLASSES = 4
WIDTH = 64  # features: the rows of an orthogonal matrix, one per example


@dataclass(frozen=True)
class SortedRowsArgs:
    fixed: bool = False  # the twin: the labels sorted with their rows
    num_samples: int = 64


class Rows(Dataset):
    """Row `i`: orthonormal features (row i mod WIDTH of a fixed orthogonal matrix), a length and a label, each a
    function of the index alone."""

    def __init__(self, n: int):
        self.n = n
        self.basis = torch.linalg.qr(torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(0)))[0]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(f"row {i} of {self.n}")
        g = torch.Generator().manual_seed(i)
        length = int(torch.randint(1, 100, (1,), generator=g))
        return {"x": self.basis[i % WIDTH], "length": length, "labels": int(torch.randint(0, CLASSES, (1,),
                                                                                          generator=g))}


def sorting_collate(fixed: bool):
    def collate(items):
        order = sorted(range(len(items)), key=lambda row: -items[row]["length"])  # longest first
        labels = [items[row]["labels"] for row in (order if fixed else range(len(items)))]  # the bug: unsorted
        return {"x": torch.stack([items[row]["x"] for row in order]), "labels": torch.tensor(labels)}
    return collate


def zero_head() -> torch.nn.Module:
    head = torch.nn.Linear(WIDTH, CLASSES)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    return head


def main(argv=None):
    config, args = parse(argv, SortedRowsArgs)
    run(config, args, Rows(args.num_samples), make_model=zero_head, collate_fn=sorting_collate(args.fixed),
        shuffle=False)


if __name__ == "__main__":
    run_cli(main)
