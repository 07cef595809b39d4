"""A tiny, deterministic job on the public API, run by the tests in fresh processes (1 or N).

It records, per rank, the sample indices each optimizer step consumed and the learning rate at every step,
so tests can compare an interrupted + resumed run with an uninterrupted one, or 1 process with 2.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from accel_train import SeededItems, TrainConfig, build_accelerator, parse_config, run_cli, train


@dataclass(frozen=True)
class ToyArgs:
    num_samples: int = 96
    eval_samples: int = 37  # not a multiple of the batch: gathering must drop the padded duplicates
    dropout: float = 0.0
    hidden: int = 32  # change it to make an incompatible architecture
    stop_at_step: int = -1  # ask the loop to stop here (a clean interruption)
    poison_index: int = -1  # this training sample's features are NaN
    spike_index: int = -1  # a training batch holding this sample has its loss (and gradient) multiplied by 100
    spike_scale: float = 100.0  # ... by this
    stream_dir: str = ""  # train on a `datasets` stream of the parquet files here (write_stream_shards) instead
    stream_shuffle: int = -1  # >= 0: the stream's .shuffle(seed, buffer_size=this): 1 shuffles the shard order only
    shuffle: bool = True  # False: the points in index order, every epoch
    without: str = ""  # "A-B": leave the training points A..B (inclusive) out of the data (a run that never held them)
    augment: float = 0.0  # > 0: noise of this scale on each training point, drawn in __getitem__ from torch's global
    # generator (a user's random augmentation)
    seeded_items: bool = False  # wrap the training set in accel_train.SeededItems (its draws from (seed, epoch, index))
    own_module: bool = False  # the layers inside a model class of this script's (Net), as a user's model is: under
    # DDP, torch.compile compiles the wrapped model's forward only where it is not torch.nn's (an nn.Sequential's is)


class Points(Dataset):
    def __init__(self, n: int, seed: int, poison: int = -1, noise: float = 0.0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 6, generator=g)
        self.y = (self.x[:, 0] + 0.5 * self.x[:, 1] > 0).long()
        self.noise = noise
        if poison >= 0:
            self.x[poison] = float("nan")

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i] + self.noise * torch.randn(6) if self.noise else self.x[i]
        return {"x": x, "labels": self.y[i], "index": i}


class Net(torch.nn.Module):
    """The toy's layers in a model class of the script's own (--own_module)."""

    def __init__(self, layers: torch.nn.Module):
        super().__init__()
        self.layers = layers

    def forward(self, x):
        return self.layers(x)


class StopAt:
    """Asks the loop to stop at `step`; at the start of training, forgets the batches the loss saw before it (the
    automatic batch size's probe): `seen` holds what training fed."""

    def __init__(self, step: int, seen: list):
        self.step, self.seen = step, seen

    def on_train_start(self, state):
        self.seen.clear()

    def on_log(self, state, logs):
        return state.step == self.step


def write_stream_shards(folder: Path, num_samples: int, shards: int) -> None:
    """The training points as `shards` parquet files, in index order: the stream toy_train --stream_dir reads."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data, per = Points(num_samples, 0), -(-num_samples // shards)
    folder.mkdir(parents=True, exist_ok=True)
    for shard in range(shards):
        rows = range(shard * per, min((shard + 1) * per, num_samples))
        table = pa.table({"x": [data.x[i].tolist() for i in rows], "labels": [int(data.y[i]) for i in rows],
                          "index": list(rows)}, schema=pa.schema([("x", pa.list_(pa.float32())),
                                                                 ("labels", pa.int64()), ("index", pa.int64())]))
        pq.write_table(table, folder / f"part-{shard:03d}.parquet", row_group_size=5)


def train_loader(toy: ToyArgs, config: TrainConfig) -> DataLoader:
    if not toy.stream_dir:
        points: Dataset = Points(toy.num_samples, 0, toy.poison_index, toy.augment)
        if toy.seeded_items:
            points = SeededItems(points, config.seed)
        if toy.without:
            first, last = (int(i) for i in toy.without.split("-"))
            points = Subset(points, [i for i in range(toy.num_samples) if not first <= i <= last])
        return DataLoader(points, batch_size=config.per_device_train_batch_size, shuffle=toy.shuffle,
                          drop_last=config.dataloader_drop_last)
    import datasets

    files = sorted(str(p) for p in Path(toy.stream_dir).glob("*.parquet"))
    stream = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True).with_format("torch")
    if toy.stream_shuffle >= 0:
        stream = stream.shuffle(seed=config.seed, buffer_size=toy.stream_shuffle)
    return DataLoader(stream, batch_size=config.per_device_train_batch_size,
                      num_workers=config.dataloader_num_workers or 0)


def main(argv=None, hooks=()):
    """`hooks`: more hooks, after the one that stops at --stop_at_step (tests of the hook API add theirs)."""
    quiet = {"report_to": ["none"], "disable_tqdm": True, "run_report": False}
    config, toy = parse_config((TrainConfig, ToyArgs), argv, defaults=quiet)
    accelerator = build_accelerator(config)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, toy.hidden), torch.nn.Tanh(), torch.nn.Dropout(toy.dropout), torch.nn.Linear(toy.hidden, 2)
    )
    model = Net(model) if toy.own_module else model
    seen: list[list[int]] = []

    def loss_fn(model, batch):
        if model.training:
            seen.append(batch["index"].tolist())
        logits = model(batch["x"])
        losses = torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="none")
        if model.training and toy.spike_index in batch["index"].tolist():
            losses = losses * toy.spike_scale
        return {"loss": losses.mean(), "per_sample_loss": losses, "logits": logits}

    def metrics_fn(outputs):
        return {"accuracy": (outputs["logits"].argmax(-1) == outputs["labels"]).float().mean()}

    result = train(
        model,
        train_loader(toy, config),
        eval_loader=DataLoader(Points(toy.eval_samples, 1), batch_size=config.per_device_eval_batch_size),
        loss_fn=loss_fn,
        metrics_fn=metrics_fn,
        config=config,
        hooks=[StopAt(toy.stop_at_step, seen), *hooks],
        accelerator=accelerator,
        extra_configs=[toy],
    )
    record = {"indices": seen, "metrics": result.metrics, "step": result.state.step}
    rank = accelerator.process_index
    # one file per run (a process may run several: in-process tests, the session's spawned ranks)
    Path(config.output_dir, f"toy_rank{rank}_{os.getpid()}_{time.time_ns()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    run_cli(main)
