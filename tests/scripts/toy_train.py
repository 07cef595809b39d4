"""A tiny, deterministic job on the public API, run by the tests in fresh processes (1 or N).

It records, per rank, the sample indices each optimizer step consumed and the learning rate at every step,
so tests can compare an interrupted + resumed run with an uninterrupted one, or 1 process with 2.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from accel_train import TrainConfig, build_accelerator, parse_config, run_cli, train


@dataclass(frozen=True)
class ToyArgs:
    num_samples: int = 96
    eval_samples: int = 37  # not a multiple of the batch: gathering must drop the padded duplicates
    dropout: float = 0.0
    hidden: int = 32  # change it to make an incompatible architecture
    stop_at_step: int = -1  # ask the loop to stop here (a clean interruption)
    poison_index: int = -1  # this training sample's features are NaN
    spike_index: int = -1  # a training batch holding this sample has its loss (and gradient) multiplied by 100


class Points(Dataset):
    def __init__(self, n: int, seed: int, poison: int = -1):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 6, generator=g)
        self.y = (self.x[:, 0] + 0.5 * self.x[:, 1] > 0).long()
        if poison >= 0:
            self.x[poison] = float("nan")

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i], "index": i}


class StopAt:
    def __init__(self, step: int):
        self.step = step

    def on_log(self, state, logs):
        return state.step == self.step


def main(argv=None):
    quiet = {"report_to": ["none"], "disable_tqdm": True, "run_report": False}
    config, toy = parse_config((TrainConfig, ToyArgs), argv, defaults=quiet)
    accelerator = build_accelerator(config)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, toy.hidden), torch.nn.Tanh(), torch.nn.Dropout(toy.dropout), torch.nn.Linear(toy.hidden, 2)
    )
    seen: list[list[int]] = []

    def loss_fn(model, batch):
        if model.training:
            seen.append(batch["index"].tolist())
        logits = model(batch["x"])
        losses = torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="none")
        if model.training and toy.spike_index in batch["index"].tolist():
            losses = losses * 100
        return {"loss": losses.mean(), "per_sample_loss": losses, "logits": logits}

    def metrics_fn(outputs):
        return {"accuracy": (outputs["logits"].argmax(-1) == outputs["labels"]).float().mean()}

    bs = config.per_device_train_batch_size
    result = train(
        model,
        DataLoader(Points(toy.num_samples, 0, toy.poison_index), batch_size=bs, shuffle=True,
                   drop_last=config.dataloader_drop_last),
        eval_loader=DataLoader(Points(toy.eval_samples, 1), batch_size=config.per_device_eval_batch_size),
        loss_fn=loss_fn,
        metrics_fn=metrics_fn,
        config=config,
        hooks=[StopAt(toy.stop_at_step)],
        accelerator=accelerator,
        extra_configs=[toy],
    )
    record = {"indices": seen, "metrics": result.metrics, "step": result.state.step}
    rank = accelerator.process_index
    Path(config.output_dir, f"toy_rank{rank}_{os.getpid()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    run_cli(main)
