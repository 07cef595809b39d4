"""Weight averaging (--ema_decay): an exponential moving average of the model's weights, kept beside the live ones.

After every optimizer step each floating-point parameter and buffer moves its average toward the new value,
``average = decay_t * average + (1 - decay_t) * weight`` (torch's `get_ema_multi_avg_fn`), with the decay warmed up
as TensorFlow's ExponentialMovingAverage does it, ``decay_t = min(decay, (1 + t) / (10 + t))`` after t updates, so
that the first steps' random weights fade quickly. Every process keeps the average of what it holds: under DDP its
own (identical) copy of the whole weights; under FSDP2 the average of its own shard, sharded with the model.
DeepSpeed is refused (ZeRO-3 holds no weights in the module, ZeRO-1/2 hold them in half precision under bf16).

Evaluating the average writes its tensors into the model's own (local) storage and the live ones into the
average's, and back after: the average is evaluated by the same forward, precision and gathers as the live weights,
and the live weights come back bitwise. Under FSDP2 the gathered weights are freed before each exchange (`reshard`:
the root module keeps its gathered weights after a forward that has no backward). The average is saved with every
checkpoint as safetensors: `weight_average_rank0.safetensors` (replicated), or one file per process (sharded).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.optim.swa_utils import get_ema_multi_avg_fn

from ..config import TrainConfig
from ..errors import CheckpointError, ConfigError
from ..rundir.layout import weight_average_file
from .evaluation import evaluate_model

REFUSED_ENGINES = ("DEEPSPEED",)


def averaged_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What is averaged: every floating-point parameter and buffer (BatchNorm's running statistics too), by name."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return {name: tensor for name, tensor in named if tensor.is_floating_point()}


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this process holds: an FSDP2 parameter's shard (a DTensor's local view), or the tensor
    itself. DTensor is recognised by its method, not imported: a run without an average never loads it."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _averaged_dtype(dtype: torch.dtype) -> torch.dtype:
    """The average's dtype: fp32 for half-precision weights (bf16, fp16), else the weights' own."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


class WeightAverage:
    """The exponential moving average of `model`'s weights (the unwrapped, prepared model). `update()` after each
    optimizer step; `swapped()` to evaluate or save the average; `save` / `load` with the checkpoints."""

    def __init__(self, model: torch.nn.Module, decay: float, warmup: bool = True, rank: int = 0):
        if not 0 < decay < 1:
            raise ConfigError(f"--ema_decay {decay}: must be in (0, 1), e.g. 0.999 (0 turns averaging off).")
        self.decay, self.warmup, self.rank = decay, warmup, rank
        self.live = averaged_tensors(model)
        self.sharded = any(hasattr(t, "to_local") for t in self.live.values())  # each process averages its shard
        # kept in fp32 where the weights are in half precision: an update of (1 - decay) x (weight - average) is
        # under half of bf16's step at the average (2^-8 at 1.0) for decay 0.999, and would be rounded away
        self.average = {name: _local(tensor).detach().clone().to(_averaged_dtype(tensor.dtype))
                        for name, tensor in self.live.items()}
        self.held: dict[str, torch.Tensor] = {}  # inside swapped(): the live weights of averages of another dtype
        from torch.distributed.fsdp import FSDPModule

        self.fsdp_modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
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
        live = [_local(self.live[n]).detach().to(self.average[n].dtype) for n in names]  # no copy at equal dtypes
        ema_update([self.average[n] for n in names], live, self.updates)
        self.updates += 1

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The model holds the average inside the block (rounded to the model's dtype where the average is kept in
        fp32), its live weights again after it (bitwise), and the average is left as it was."""
        self._swap(into_model=True)
        try:
            yield
        finally:
            self._swap(into_model=False)

    def copy_into_model(self) -> None:
        """Make the average the model's weights for good (--save_ema_as_final, at the end of the run)."""
        self._reshard()
        with torch.no_grad():
            for name, tensor in self.live.items():
                _local(tensor).copy_(self.average[name])

    @torch.no_grad()
    def _swap(self, into_model: bool) -> None:
        """Exchange the storages where the average has the weights' dtype (no second copy of the model); where it is
        kept in fp32, write it into the model and hold the live tensor aside (an exchange would round the average)."""
        self._reshard()
        for name, tensor in self.live.items():
            local, average = _local(tensor), self.average[name]
            if average.dtype != local.dtype:
                if into_model:
                    self.held[name] = local.clone()
                local.copy_(average if into_model else self.held.pop(name))
                continue
            held = local.clone()
            local.copy_(average)
            average.copy_(held)

    def _reshard(self) -> None:
        """FSDP2: free the gathered weights, so that the next forward gathers the shards as they are now."""
        for module in self.fsdp_modules:
            module.reshard()

    def save(self, folder: Path) -> None:
        """Write the average into checkpoint `folder`: every process its shard, or the main process the whole."""
        if self.sharded or self.rank == 0:
            save_file({n: t.contiguous() for n, t in self.average.items()}, folder / weight_average_file(self.rank),
                      metadata={"updates": str(self.updates), "sharded": str(self.sharded)})

    def load(self, folder: Path, num_processes: int) -> None:
        """Continue the average saved in checkpoint `folder` (verified against its manifest before this)."""
        files = sorted(folder.glob(weight_average_file("*")))
        if not files:
            raise CheckpointError(f"{folder} holds no weight average (it was written without --ema_decay): resume "
                                  "without --ema_decay, or start a fresh run to average from the first step.")
        if self.sharded and len(files) != num_processes:
            raise CheckpointError(f"{folder} holds the weight average in {len(files)} shard(s), this run has "
                                  f"{num_processes} process(es): resume on {len(files)}, or without --ema_decay.")
        path = folder / weight_average_file(self.rank if self.sharded else 0)
        saved = load_file(path)
        if set(saved) != set(self.average) or any(saved[n].shape != t.shape for n, t in self.average.items()):
            missing, extra = sorted(set(self.average) - set(saved)), sorted(set(saved) - set(self.average))
            raise CheckpointError(f"{path}: the weight average does not match this model (missing {missing[:3]}, "
                                  f"unexpected {extra[:3]}, or shapes differ): resume with the model and the engine "
                                  "it was written by.")
        with torch.no_grad():
            for name, tensor in self.average.items():
                tensor.copy_(saved[name])
        with safe_open(path, "pt") as fh:
            self.updates = int(fh.metadata()["updates"])


def weight_average(accelerator, model: torch.nn.Module, config: TrainConfig) -> WeightAverage | None:
    """The run's average of the prepared `model` (None without --ema_decay). Refused under DeepSpeed."""
    if not config.ema_decay:
        return None
    engine = accelerator.distributed_type.value
    if engine in REFUSED_ENGINES:
        raise ConfigError(f"--ema_decay {config.ema_decay} under {engine}: ZeRO-3 keeps no weights in the module and "
                          "ZeRO-1/2 keep them in half precision under bf16, where an average of small updates is "
                          "lost to rounding; train with FSDP2, DDP or one device to average weights, or drop "
                          "--ema_decay.")
    # the bare module's names: torch.compile's wrapper holds the same tensors under `_orig_mod.` names, which would
    # reach the checkpoint's average (loading into no bare model, refusing a resume that turns compile on or off)
    bare = accelerator.unwrap_model(model, keep_torch_compile=False)
    return WeightAverage(bare, config.ema_decay, config.ema_warmup, rank=accelerator.process_index)


def evaluate_with_average(accelerator, model, loader, loss_fn, metrics_fn, average: WeightAverage | None,
                          prefix: str = "eval") -> dict[str, float]:
    """`evaluate_model` of the live weights and, with an average, of the average (`<prefix>_ema_*`) beside them."""
    metrics = evaluate_model(accelerator, model, loader, loss_fn, metrics_fn, prefix=prefix)
    if average is not None:
        # a metrics function that keeps what it saw (the observer's confusion matrices) keeps the average's apart
        average_fn = metrics_fn.for_average() if hasattr(metrics_fn, "for_average") else metrics_fn
        with average.swapped():
            metrics.update(evaluate_model(accelerator, model, loader, loss_fn, average_fn, prefix=f"{prefix}_ema"))
    return metrics
