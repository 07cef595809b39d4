"""Automatic micro-batch size (`--auto_find_batch_size`) that keeps the global batch and the schedule.

Accelerate's `find_executable_batch_size` retries a whole function with a smaller batch: the global batch,
and with it the learning-rate schedule, silently change, and each process may settle on a different size.
Here, before step 0, every process tries its largest micro-batch (the loader's first batch, the longest
under length grouping) forward and backward with optimizer-state-sized memory held, halving on
out-of-memory; the processes agree on the smallest size that fit everywhere; accumulation rises by the
same factor. Global batch, steps per epoch and the schedule are unchanged, so the run is the one that was
asked for, at a size that fits.

`--gradient_checkpointing`, the other way to fit a run in memory, is switched on here too.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Mapping
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import GradientState
from accelerate.utils import GradientAccumulationPlugin, gather, send_to_device
from torch.utils.data import DataLoader

from ..config import TrainConfig
from ..errors import ConfigError
from ..testing import faults
from .loss import as_loss_output
from .sharded import refuse_sharded_probe


def is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and ("out of memory" in str(err) or "can't allocate memory" in str(err)))


def _slice(batch: Any, n: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:n]
    if isinstance(batch, Mapping):  # dicts and transformers' BatchEncoding
        return {k: _slice(v, n) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice(v, n) for v in batch)
    return batch


def _fits(accelerator: Accelerator, model: torch.nn.Module, batch: Any, loss_fn: Callable, size: int,
          optimizer_slots: int) -> bool:
    held: list[torch.Tensor] = []
    try:
        faults.oom_point(size, accelerator.process_index)
        # what the optimizer will allocate at its first step (Adam: 2 tensors per parameter)
        held = [torch.empty_like(p) for p in model.parameters() if p.requires_grad for _ in range(optimizer_slots)]
        with accelerator.autocast():
            loss = as_loss_output(loss_fn(model, send_to_device(_slice(batch, size), accelerator.device)))["objective"]
        loss.backward()
        return True
    except Exception as err:  # noqa: BLE001 - only out-of-memory is handled; anything else is re-raised
        if not is_oom(err):
            raise
        return False
    finally:
        del held
        model.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def find_micro_batch(accelerator: Accelerator, model: torch.nn.Module, loader: DataLoader, loss_fn: Callable,
                     config: TrainConfig, optimizer: torch.optim.Optimizer) -> int:
    """The largest of B, B/2, B/4, ... (divisors of the configured micro-batch B) that fits on every rank."""
    size = config.per_device_train_batch_size
    slots = 2 if any(k in type(optimizer).__name__ for k in ("Adam", "Dummy")) else 1
    rng = torch.get_rng_state()  # the probe (the sampler's draw, dropout) must not shift the real run's RNG
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    batch = next(iter(loader))
    model.to(accelerator.device)
    # nor its model: the probe's forwards run in training mode, and a BatchNorm's running statistics moved with them
    buffers = {name: buffer.detach().clone() for name, buffer in model.named_buffers()}
    while not _fits(accelerator, model, batch, loss_fn, size, slots):
        if size % 2 or size == 1:
            size = 0
            break
        size //= 2
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(buffers[name])
    torch.set_rng_state(rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
    agreed = size
    if accelerator.num_processes > 1:  # the smallest size that fit on every rank
        agreed = int(gather(torch.tensor([size], device=accelerator.device)).min())
    if agreed == 0:
        raise ConfigError(
            f"--auto_find_batch_size: even the smallest micro-batch that divides {config.per_device_train_batch_size} "
            "runs out of memory on some process. Use a smaller model, --gradient_checkpointing, or mixed precision.")
    return agreed


def with_micro_batch(config: TrainConfig, loader: DataLoader, micro: int) -> tuple[TrainConfig, DataLoader]:
    """The same run with micro-batches of `micro`: accumulation multiplied so the global batch is unchanged."""
    factor = config.per_device_train_batch_size // micro
    derived = dataclasses.replace(config, per_device_train_batch_size=micro,
                                  gradient_accumulation_steps=config.gradient_accumulation_steps * factor)
    rebuilt = DataLoader(
        loader.dataset, batch_size=micro, sampler=loader.sampler, collate_fn=loader.collate_fn,
        drop_last=loader.drop_last, num_workers=loader.num_workers, pin_memory=loader.pin_memory,
        persistent_workers=loader.persistent_workers, worker_init_fn=loader.worker_init_fn,
        generator=loader.generator, timeout=loader.timeout, multiprocessing_context=loader.multiprocessing_context,
        prefetch_factor=loader.prefetch_factor if loader.num_workers else None,
        pin_memory_device=loader.pin_memory_device, in_order=getattr(loader, "in_order", True),
    )
    return derived, rebuilt


def fit_micro_batch(accelerator: Accelerator, model: torch.nn.Module, loader: DataLoader, loss_fn: Callable,
                    config: TrainConfig, optimizer: torch.optim.Optimizer) -> tuple[TrainConfig, DataLoader]:
    """--auto_find_batch_size: the config and loader of the same run at the largest micro-batch that fits on every
    rank (accumulation raised to keep the global batch and schedule); unchanged when the configured one fits. A
    loader batched by a batch_sampler of one's own is refused: that sampler, not a batch size, makes its batches (a
    smaller micro-batch rebuilt the loader without it: another order, without a word). Refused under FSDP and
    DeepSpeed (`refuse_sharded_probe`)."""
    refuse_sharded_probe(accelerator, config)
    if loader.batch_size is None:
        raise ConfigError(f"--auto_find_batch_size: the training DataLoader is batched by a batch_sampler of your own "
                          f"({type(loader.batch_sampler).__name__}), which decides its batches itself, so a smaller "
                          "micro-batch cannot be set on it. Give the loader a batch_size (and a sampler) instead, or "
                          "drop --auto_find_batch_size and size the batch_sampler's batches yourself.")
    micro = find_micro_batch(accelerator, model, loader, loss_fn, config, optimizer)
    if micro == config.per_device_train_batch_size:
        return config, loader
    accelerator.print(f"auto batch size: micro-batch {config.per_device_train_batch_size} -> {micro}, "
                      "accumulation raised to keep the global batch and schedule")
    config, loader = with_micro_batch(config, loader, micro)
    GradientState(GradientAccumulationPlugin(num_steps=config.gradient_accumulation_steps))
    return config, loader


def enable_gradient_checkpointing(model: torch.nn.Module, config: TrainConfig) -> None:
    """--gradient_checkpointing: recompute activations in backward (a transformers model's own switch)."""
    if not config.gradient_checkpointing:
        return
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ConfigError("--gradient_checkpointing: this model has no gradient_checkpointing_enable() (transformers "
                          "models do); wrap its blocks with torch.utils.checkpoint.checkpoint instead.")
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})
