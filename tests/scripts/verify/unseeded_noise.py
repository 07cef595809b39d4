"""Seeded bug: augmentation noise from a generator made without a seed (random.Random() seeds itself from the OS at
each process start), so two runs of the same command train on other numbers. verify's determinism check flags it.
The twin draws its noise from torch's generator inside accel_train.SeededItems: (seed, epoch, index) alone."""

import random

import torch
from common import Points, features, parse, run

from accel_train import SeededItems, run_cli


class NoisyPoints(Points):
    def __init__(self, n: int, fixed: bool):
        super().__init__(n)
        self.fixed = fixed
        self.rng = random.Random()  # the bug: unseeded

    def __getitem__(self, i):
        x, y = features(i)
        noise = torch.randn(6) if self.fixed else torch.tensor([self.rng.gauss(0, 1) for _ in range(6)])
        return {"x": x + 0.3 * noise, "labels": y}


def main(argv=None):
    config, bug = parse(argv)
    points = NoisyPoints(bug.num_samples, bug.fixed)
    run(config, bug, SeededItems(points, config.seed) if bug.fixed else points)


if __name__ == "__main__":
    run_cli(main)
