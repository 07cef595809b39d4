"""What the seeded-bug scripts of `accel-train verify`'s tests share: a user's small job on the public API.

Each script beside this one holds one real bug of a kind users hit, and its fix behind `--fixed true` (the twin):
verify must flag the bug with the check that names its class and pass the twin.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset

from accel_train import TrainConfig, build_accelerator, make_loader, parse_config, train


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
        if not 0 <= i < self.n:  # the sequence protocol: what a loop over the dataset, and verify, stop at
            raise IndexError(f"point {i} of {self.n}")
        x, y = features(i)
        return {"x": x, "labels": y}


def mean_loss(model, batch):
    return torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"])


def parse(argv, args_class=BugArgs) -> tuple[TrainConfig, BugArgs]:
    quiet = {"report_to": ["none"], "disable_tqdm": True, "run_report": False, "eval_strategy": "no",
             "learning_rate": 1e-2}
    return parse_config((TrainConfig, args_class), argv, defaults=quiet)


def new_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def run(config: TrainConfig, bug, train_set: Dataset, loss_fn=mean_loss, model=None, make_model=new_model,
        collate_fn=None, eval_loader=None, metrics_fn=None, shuffle: bool = True, lengths=None) -> None:
    """`model`: one the script built itself (by default `make_model()` builds one here, after the accelerator
    seeds). `bug`: the script's own flags (BugArgs or a dataclass of its own), recorded with the run. `shuffle`:
    False feeds the items in the dataset's order. `lengths` (one per item): the project's loader, batches of similar
    lengths (make_loader, as the NLP recipes build theirs)."""
    accelerator = build_accelerator(config)  # seeds every generator from --seed: build the model after it
    model = make_model() if model is None else model
    if lengths is not None:
        loader = make_loader(train_set, config, train=True, collate_fn=collate_fn, lengths=lengths)
    else:
        loader = DataLoader(train_set, batch_size=config.per_device_train_batch_size, shuffle=shuffle,
                            collate_fn=collate_fn)
    train(model, loader, loss_fn=loss_fn, config=config, extra_configs=[bug], accelerator=accelerator,
          eval_loader=eval_loader, metrics_fn=metrics_fn)
