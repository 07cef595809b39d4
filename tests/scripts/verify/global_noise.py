"""Seeded bug: augmentation noise drawn in __getitem__ from torch's global generator. train() seeds it, so two runs
agree; but the loader fetches ahead of the step, so after a resume the items draw other numbers than the
uninterrupted run's did. verify's resume check flags it; the twin wraps the dataset in accel_train.SeededItems."""

import torch
from common import Points, features, parse, run

from accel_train import SeededItems, run_cli


class NoisyPoints(Points):
    def __getitem__(self, i):
        x, y = features(i)
        return {"x": x + 0.3 * torch.randn(6), "labels": y}  # the global generator: depends on what was drawn before


def main(argv=None):
    config, bug = parse(argv)
    points = NoisyPoints(bug.num_samples)
    run(config, bug, SeededItems(points, config.seed) if bug.fixed else points)


if __name__ == "__main__":
    run_cli(main)
