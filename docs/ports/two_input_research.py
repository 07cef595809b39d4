"""A research model, ported: two inputs (x1, x2), an auxiliary loss beside the main one (each logged), parameter
groups with their own learning rate and weight decay, and training data that is a stream of `(x1, x2, y)` tuples
(a torch IterableDataset) (docs/ports.md).

    python docs/ports/two_input_research.py --output_dir runs/research --max_steps 300
    python docs/ports/two_input_research.py --output_dir runs/research --max_steps 300 --resume_from_checkpoint latest

The data is synthetic and seeded (a teacher rule over x1 and x2), so that the program runs anywhere: y is the class
of a fixed linear rule of both inputs, and x2 is partly predictable from x1, which the auxiliary head learns.
A stream has no length: --max_steps sets the run's length. A plain IterableDataset cannot say where it is, so a
resumed run re-reads the stream up to its position (exact; the start-up report says so): datasets.IterableDataset
streams with state_dict() are loaded at their position instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from accel_train import TrainConfig, build_accelerator, parse_config, run_cli, train

DEFAULTS = {
    "output_dir": "runs/two_input_research", "max_steps": 300, "per_device_train_batch_size": 32,
    "per_device_eval_batch_size": 256, "eval_strategy": "steps", "eval_steps": 100, "save_strategy": "steps",
    "save_steps": 100, "logging_steps": 10, "mixed_precision": "no", "report_to": ["none"], "seed": 0,
    "lr_scheduler_type": "cosine", "warmup_steps": 0.1,  # a schedule built by accel_train over the groups' own rates
}


@dataclass(frozen=True)
class ResearchArguments:
    encoder_lr: float = field(default=3e-3, metadata={"help": "The two encoders' learning rate."})
    head_lr: float = field(default=1e-3, metadata={"help": "The classifier's and the auxiliary head's rate."})
    aux_weight: float = field(default=0.3, metadata={"help": "Weight of the auxiliary loss in the training loss."})
    stream_size: int = field(default=4096, metadata={"help": "Samples in one pass over the stream."})
    tiny: bool = field(default=False, metadata={"help": "Width 8 and a 256-sample stream (tests)."})


def teacher(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x1 = torch.randn(n, 16, generator=g)
    x2 = x1[:, :4] * 0.8 + 0.2 * torch.randn(n, 4, generator=g)
    rule = torch.Generator().manual_seed(1234)  # the same rule for the stream and the held-out set
    w1, w2 = torch.randn(16, 3, generator=rule), torch.randn(4, 3, generator=rule)
    return x1, x2, (x1 @ w1 + x2 @ w2).argmax(-1)


class TupleStream(IterableDataset):
    """Yields (x1, x2, y) one at a time, in the same order at each pass, as a reader of shards would."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed = n, seed

    def __iter__(self):
        x1, x2, y = teacher(self.seed, self.n)
        yield from zip(x1, x2, y, strict=True)


class TwoInputNet(nn.Module):
    """Encoders for x1 [B, 16] and x2 [B, 4], a classifier over both, an auxiliary head x1 -> x2."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.enc1 = nn.Sequential(nn.Linear(16, width), nn.GELU())
        self.enc2 = nn.Sequential(nn.Linear(4, width), nn.GELU())
        self.classifier = nn.Linear(2 * width, 3)
        self.aux_head = nn.Linear(width, 4)

    def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.cat([self.enc1(x1), self.enc2(x2)], dim=-1))


def param_groups(model: TwoInputNet, args: ResearchArguments) -> list[dict]:
    """The encoders learn faster and decay; the heads learn slower and do not."""
    encoders = [*model.enc1.parameters(), *model.enc2.parameters()]
    heads = [*model.classifier.parameters(), *model.aux_head.parameters()]
    return [{"params": encoders, "lr": args.encoder_lr, "weight_decay": 0.05},
            {"params": heads, "lr": args.head_lr, "weight_decay": 0.0}]


def main_loss(model, batch):
    x1, x2, y = batch
    logits = model(x1, x2)
    per_sample = nn.functional.cross_entropy(logits, y, reduction="none")
    return {"loss": per_sample.mean(), "per_sample_loss": per_sample, "logits": logits}


def make_loss(aux_weight: float):
    def loss_fn(model, batch):
        out = main_loss(model, batch)
        x1, x2, _ = batch
        net = getattr(model, "module", model)  # DDP wraps the model; the auxiliary head is not in forward()
        aux = nn.functional.mse_loss(net.aux_head(net.enc1(x1)), x2)
        return {**out, "loss": out["loss"] + aux_weight * aux,
                "log": {"main_loss": out["loss"].detach(), "aux_loss": aux.detach()}}

    loss_fn.evaluation_loss = main_loss  # evaluations, best model and early stopping judge the main task only
    return loss_fn


def accuracy(outputs):
    return {"accuracy": (outputs["logits"].argmax(-1) == outputs["labels"]).float().mean().item()}


def main(argv=None) -> dict[str, float]:
    config, args = parse_config((TrainConfig, ResearchArguments), argv, defaults=DEFAULTS)
    accelerator = build_accelerator(config)
    model = TwoInputNet(width=8 if args.tiny else 64)
    optimizer = torch.optim.AdamW(param_groups(model, args))
    stream = TupleStream(256 if args.tiny else args.stream_size, seed=config.seed)
    held_out = list(zip(*teacher(config.seed + 1, 128 if args.tiny else 1024), strict=True))
    result = train(model, DataLoader(stream, batch_size=config.per_device_train_batch_size), config=config,
                   loss_fn=make_loss(args.aux_weight), optimizer=optimizer, accelerator=accelerator,
                   eval_loader=DataLoader(held_out, batch_size=config.per_device_eval_batch_size), metrics_fn=accuracy)
    return result.metrics


if __name__ == "__main__":
    run_cli(main)
