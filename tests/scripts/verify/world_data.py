"""Seeded bugs of the world-size and data-accounting checks, each behind its own name in --bugs, so that one verify
run can flag several where they do not touch each other's evidence (the fixed twins: --fixed true):

    batchnorm          a BatchNorm1d layer: each process normalises by its own micro-batch, so 2 processes train
                       another model than 1 at the same global batch. World size reports it as a property of the
                       model, not a bug; the twin normalises per example (LayerNorm).
    lying_len          64 points kept as 32 pairs, and __len__ counts the pairs: the sampler draws indices 0..31 only,
                       and half of the points are never trained on. Data accounting flags it (dataset[32] returns an
                       item); the twin counts the points.
    dropping_collator  every 8th point is unlabelled (-1) and the collator drops such items from each batch: the
                       sampler's epoch, the examples counted and each process's share of the mean assume every index
                       drawn is fed. Data accounting flags it (fewer rows reach the loss than the sampler gave); the
                       twin filters the dataset before the loader (a Subset of the labelled points).
"""

from dataclasses import dataclass

import torch
from common import Points, features, parse, run
from torch.utils.data import Subset, default_collate

from accel_train import run_cli

BUGS = ("batchnorm", "lying_len", "dropping_collator")


@dataclass(frozen=True)
class WorldDataArgs:
    bugs: str = ""  # comma-separated, of BUGS
    fixed: bool = False  # the twin: the same script with the named bugs fixed
    num_samples: int = 64


class PairedPoints(Points):
    """The points kept as pairs (as a file of two examples per line would be)."""

    def __init__(self, n: int, fixed: bool):
        super().__init__(n)
        self.pairs = [(2 * i, 2 * i + 1) for i in range(n // 2)]
        self.fixed = fixed

    def __len__(self):
        return 2 * len(self.pairs) if self.fixed else len(self.pairs)  # the bug: the pairs counted, not the points

    def __getitem__(self, i):
        x, y = features(self.pairs[i // 2][i % 2])
        return {"x": x, "labels": y}


class PartlyLabelled(Points):
    """Every 8th point has no label (-1)."""

    def __init__(self, base):
        super().__init__(len(base))
        self.base = base

    def __getitem__(self, i):
        item = self.base[i]
        return {**item, "labels": torch.tensor(-1)} if i % 8 == 3 else item


def labelled_only(items):
    """The bug: a collator that drops the items it cannot use."""
    return default_collate([item for item in items if int(item["labels"]) >= 0])


def main(argv=None):
    config, args = parse(argv, WorldDataArgs)
    bugs = {name.strip() for name in args.bugs.split(",") if name.strip()}
    unknown = bugs - set(BUGS)
    if unknown:
        raise SystemExit(f"--bugs: unknown {sorted(unknown)}; choose among {', '.join(BUGS)}")
    points = PairedPoints(args.num_samples, args.fixed) if "lying_len" in bugs else Points(args.num_samples)
    collate_fn = None
    if "dropping_collator" in bugs:
        points = PartlyLabelled(points)
        if args.fixed:  # filtered before the loader: the sampler draws only what is fed
            points = Subset(points, [i for i in range(len(points)) if i % 8 != 3])
        else:
            collate_fn = labelled_only
    norm = torch.nn.BatchNorm1d if "batchnorm" in bugs and not args.fixed else torch.nn.LayerNorm

    def make_model():
        return torch.nn.Sequential(torch.nn.Linear(6, 16), norm(16), torch.nn.Tanh(), torch.nn.Linear(16, 2))

    run(config, args, points, make_model=make_model, collate_fn=collate_fn)


if __name__ == "__main__":
    run_cli(main)
