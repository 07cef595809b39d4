"""The one seed derivation the package uses (a leaf: the data loaders and samplers of core/ all draw from it)."""

from __future__ import annotations

import torch


def seeded_generator(seed: int, counter: int) -> torch.Generator:
    """A CPU generator that is a function of (seed, counter) alone: the epoch's data order, a step's draws. The
    one derivation the package uses, so that every process and a resumed run draw the same numbers; the large
    prime keeps (seed, epoch) and (seed + 1, epoch - k) apart for any run length."""
    return torch.Generator().manual_seed(seed * 1_000_003 + counter)


def data_seed(config) -> int:
    """The seed of the data order: --data_seed when given, else --seed (the Trainer's rule)."""
    return config.data_seed if config.data_seed is not None else config.seed
