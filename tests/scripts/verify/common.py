"""What the seeded-bug scripts of `accel-train verify`'s tests share: a user's small job on the public API.

Each script beside this one holds one real bug of a kind users hit, and its fix behind `--fixed true` (the twin):
verify must flag the bug with the check that names its class and pass the twin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset

from accel_train import TrainConfig, build_accelerator, parse_config, train


@dataclass(frozen=True)
class BugArgs:
    fixed: bool = False  # the twin: the same script with the bug fixed
    num_samples: int = 64


def features(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Point `index`'s features and label, a function of the index alone."""
    x = torch.randn(6, generator=torch.Generator().manual_seed(index))
    return x, (x[0] + 0.5 * x[1] > 0).long()


class Points(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        x, y = features(i)
        return {"x": x, "labels": y}


def mean_loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"])


def parse(argv) -> tuple[TrainConfig, BugArgs]:
    quiet = {"report_to": ["none"], "disable_tqdm": True, "run_report": False, "eval_strategy": "no",
             "learning_rate": 1e-2}
    return parse_config((TrainConfig, BugArgs), argv, defaults=quiet)


def new_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def run(config: TrainConfig, bug: BugArgs, train_set: Dataset, loss_fn=mean_loss, model=None) -> None:
    """`model`: one the script built itself (by default one is built here, after the accelerator seeds)."""
    accelerator = build_accelerator(config)  # seeds every generator from --seed: build the model after it
    model = new_model() if model is None else model
    loader = DataLoader(train_set, batch_size=config.per_device_train_batch_size, shuffle=True)
    train(model, loader, loss_fn=loss_fn, config=config, extra_configs=[bug], accelerator=accelerator)
