"""Data loaders for the loop: worker settings, per-worker seeding, and length-grouped batches.

Shuffling uses a plain RandomSampler, which `accelerator.prepare` swaps for its seedable sampler; the
length-grouped sampler here reseeds itself from (seed, epoch) for the same reason: the data order of any
epoch can be replayed exactly on resume.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler
from transformers.trainer_pt_utils import get_length_grouped_indices

from ..config import TrainConfig


def seed_worker(worker_id: int, rank: int = 0) -> None:
    """Give each worker of each process its own reproducible seed, for torch, numpy and `random`.

    torch seeds a worker with (base seed + worker id), the base seed drawn from the loader's generator. The
    loop seeds that generator from (seed, epoch) alike on every process, so that data order replays on
    resume; without the process rank mixed in, worker k of every process would draw the same augmentations.
    """
    seed = int(np.random.SeedSequence([torch.initial_seed(), rank]).generate_state(1, dtype=np.uint64)[0])
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


class LengthGroupedSampler(Sampler[int]):
    """Random order, but each run of `group_size` consecutive indices has similar lengths, which cuts
    padding. Group by the *global* micro-batch (per-device batch x processes): the processes then split
    a group of similar lengths between them, and N processes see the batches one process with N times the
    batch would see. Uses transformers' `get_length_grouped_indices`, reseeded from (seed, epoch)."""

    def __init__(self, lengths: Sequence[int], group_size: int, seed: int = 0):
        self.lengths = list(lengths)
        self.group_size = group_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(get_length_grouped_indices(self.lengths, self.group_size, generator=generator))


def make_loader(
    dataset: Dataset,
    config: TrainConfig,
    *,
    train: bool,
    collate_fn: Callable | None = None,
    lengths: Sequence[int] | None = None,
    num_processes: int = 1,
    process_index: int | None = None,
) -> DataLoader:
    """A DataLoader set up as the config says: batch size, shuffling (train), workers, pinned memory.

    Pass `lengths` (one per sample) to group similar lengths into batches. Workers are seeded per process
    (`process_index`, default: Accelerate's for this process). An iterable dataset (a stream) is read in its
    own order: shuffle it yourself (a `datasets.IterableDataset`: `.shuffle(seed=..., buffer_size=...)`).
    """
    batch_size = config.per_device_train_batch_size if train else config.per_device_eval_batch_size
    sampler = None
    if train and lengths is not None:
        seed = config.data_seed if config.data_seed is not None else config.seed
        sampler = LengthGroupedSampler(lengths, batch_size * num_processes, seed)
    workers = config.dataloader_num_workers
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=train and sampler is None and not isinstance(dataset, IterableDataset),
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=train and config.dataloader_drop_last,
        num_workers=workers,
        pin_memory=config.dataloader_pin_memory and torch.cuda.is_available(),
        persistent_workers=config.dataloader_persistent_workers and workers > 0,
        worker_init_fn=functools.partial(seed_worker, rank=_rank(process_index)) if workers > 0 else None,
    )


def dataset_size(loader) -> int | None:
    """The number of samples in a loader's dataset, or None for a stream without a length."""
    try:
        return len(loader.dataset)
    except (TypeError, AttributeError):
        return None


def _rank(process_index: int | None) -> int:
    if process_index is not None:
        return process_index
    from accelerate import PartialState

    return PartialState().process_index
