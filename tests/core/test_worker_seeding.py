"""Data-loader workers draw their own random numbers on each process, reproducibly."""

import random

import numpy as np
import torch
from torch.utils.data import Dataset

from accel_train import TrainConfig, make_loader


class Draws(Dataset):
    """Each item is what the worker's torch, numpy and `random` generators give next."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([torch.rand(()).item(), np.random.rand(), random.random()])


def draws(rank: int) -> torch.Tensor:
    config = TrainConfig(per_device_train_batch_size=2, dataloader_num_workers=1, report_to=["none"])
    loader = make_loader(Draws(), config, train=True, process_index=rank)
    loader.generator = torch.Generator().manual_seed(7)  # what the loop does at every epoch, alike on all ranks
    return torch.cat(list(loader))


def test_workers_are_seeded_per_process_and_reproducibly():
    rank0, rank1 = draws(0), draws(1)
    assert torch.equal(rank0, draws(0))  # same seed, same rank: same numbers
    assert not torch.isclose(rank0, rank1).any()  # torch, numpy and random all differ between processes
