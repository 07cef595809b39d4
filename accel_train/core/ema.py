"""Weight averaging (--ema_decay): an exponential moving average of the model's weights, kept beside the live ones.

After every optimizer step each floating-point parameter and buffer moves its average toward the new value,
``average = decay_t * average + (1 - decay_t) * weight`` (torch's `get_ema_multi_avg_fn`), with the decay warmed up
as TensorFlow's ExponentialMovingAverage does it, ``decay_t = min(decay, (1 + t) / (10 + t))`` after t updates, so
that the first steps' random weights fade quickly. Every process keeps its own average of its own (under DDP:
identical) weights; sharded engines (FSDP, DeepSpeed) are refused, since each process there holds a shard.

Evaluating the average swaps its tensors into the prepared model (no copy: the tensors trade places) and back, so
the average is evaluated by the same forward, precision and gathers as the live weights, and the swap back restores
the live weights bitwise. The average is checkpointed with the run (Accelerate's `register_for_checkpointing`), so a
resumed run continues the same average.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.optim.swa_utils import get_ema_multi_avg_fn

from ..config import TrainConfig
from ..errors import CheckpointError, ConfigError
from .evaluation import evaluate_model

SHARDED_ENGINES = ("FSDP", "DEEPSPEED")
CUSTOM_STATE_GLOB = "custom_checkpoint_*.pkl"  # what Accelerate's save_state writes for a registered object


def averaged_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What is averaged: every floating-point parameter and buffer (BatchNorm's running statistics too), by name."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return {name: tensor for name, tensor in named if tensor.is_floating_point()}


class WeightAverage:
    """The exponential moving average of `model`'s weights (the unwrapped, prepared model). `update()` after each
    optimizer step; `swapped()` to evaluate or save the average; `state_dict()` for checkpoints."""

    def __init__(self, model: torch.nn.Module, decay: float, warmup: bool = True):
        if not 0 < decay < 1:
            raise ConfigError(f"--ema_decay {decay}: must be in (0, 1), e.g. 0.999 (0 turns averaging off).")
        self.decay, self.warmup = decay, warmup
        self.live = averaged_tensors(model)
        self.average = {name: tensor.detach().clone() for name, tensor in self.live.items()}
        self.updates = 0

    def current_decay(self) -> float:
        """The decay of the next update: warmed up from 0.1 toward `decay` (TF's num_updates rule)."""
        if not self.warmup:
            return self.decay
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self) -> None:
        names = list(self.average)
        ema_update = get_ema_multi_avg_fn(self.current_decay())
        ema_update([self.average[n] for n in names], [self.live[n].detach() for n in names], self.updates)
        self.updates += 1

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The model holds the average inside the block, its live weights again after it (bitwise)."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def copy_into_model(self) -> None:
        """Make the average the model's weights for good (--save_ema_as_final, at the end of the run)."""
        with torch.no_grad():
            for name, tensor in self.live.items():
                tensor.copy_(self.average[name])

    def _swap(self) -> None:
        for name, tensor in self.live.items():
            average = self.average[name]
            tensor.data, average.data = average.data, tensor.data

    def state_dict(self) -> dict:
        return {"decay": self.decay, "warmup": self.warmup, "updates": self.updates, "average": self.average}

    def load_state_dict(self, state: dict) -> None:
        saved = state["average"]
        if set(saved) != set(self.average):
            missing, extra = sorted(set(self.average) - set(saved)), sorted(set(saved) - set(self.average))
            raise CheckpointError(f"the checkpoint's weight average does not match this model (missing {missing[:3]}, "
                                  f"unexpected {extra[:3]}): resume with the model it was written by.")
        with torch.no_grad():
            for name, tensor in self.average.items():
                tensor.copy_(saved[name])
        self.updates = int(state["updates"])


def weight_average(accelerator, model: torch.nn.Module, config: TrainConfig) -> WeightAverage | None:
    """The run's average of the prepared `model` (None without --ema_decay), registered for checkpointing. Refused
    where each process holds only a shard of the weights (FSDP, DeepSpeed)."""
    if not config.ema_decay:
        return None
    engine = accelerator.distributed_type.value
    if engine in SHARDED_ENGINES:
        raise ConfigError(f"--ema_decay {config.ema_decay} under {engine}: the average is kept per process over the "
                          "full weights, and this engine shards them; train with DDP (or one device) to average "
                          "weights, or drop --ema_decay.")
    average = WeightAverage(accelerator.unwrap_model(model), config.ema_decay, config.ema_warmup)
    accelerator.register_for_checkpointing(average)
    return average


def check_checkpoint_average(checkpoint: Path) -> None:
    """A run with --ema_decay resumes only from a checkpoint that holds the average (Accelerate's custom state)."""
    if not any(checkpoint.glob(CUSTOM_STATE_GLOB)):
        raise CheckpointError(f"{checkpoint} holds no weight average (it was written without --ema_decay): resume "
                              "without --ema_decay, or start a fresh run to average from the first step.")


def evaluate_with_average(accelerator, model, loader, loss_fn, metrics_fn, average: WeightAverage | None,
                          prefix: str = "eval") -> dict[str, float]:
    """`evaluate_model` of the live weights and, with an average, of the average (`<prefix>_ema_*`) beside them."""
    metrics = evaluate_model(accelerator, model, loader, loss_fn, metrics_fn, prefix=prefix)
    if average is not None:
        with average.swapped():
            metrics.update(evaluate_model(accelerator, model, loader, loss_fn, metrics_fn, prefix=f"{prefix}_ema"))
    return metrics
