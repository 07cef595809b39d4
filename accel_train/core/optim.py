"""Optimizer, learning-rate schedule and the step plan, all counted in optimizer steps.

A "step" is one optimizer step everywhere in accel_train: after `gradient_accumulation_steps`
micro-batches on every process. Schedules are built for that count and stepped once per optimizer step,
so the learning rate at step k is the same on 1 process or 8.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import lr_scheduler as torch_sched

from ..config import TORCH_SCHEDULERS, TrainConfig
from ..errors import ConfigError
from .fused import fused_adamw_runs
from .muon import as_groups, build_muon, refuse_sharded_muon

ParamGroups = Iterable[torch.nn.Parameter | dict[str, Any]]


@dataclass(frozen=True)
class StepPlan:
    """How long the run is, derived once from the config and the prepared loader."""

    batches_per_epoch: int | None  # micro-batches per process per epoch (None: a stream without a length)
    steps_per_epoch: int | None  # optimizer steps per epoch
    total_steps: int
    warmup_steps: int
    global_batch_size: int
    num_epochs: int | None  # epochs started (the last may be partial)
    lr_scale: float = 1.0  # --scale_lr: the factor applied to every param group's learning rate

    @property
    def peak_lr_note(self) -> str:
        return "" if self.lr_scale == 1.0 else f" (x {self.lr_scale:.4g} by --scale_lr)"


def lr_scale(config: TrainConfig, global_batch_size: int) -> float:
    """--scale_lr: linear (Goyal et al. 2017) or sqrt scaling of the learning rate with the global batch size
    against --scale_lr_reference_batch; 1 when off."""
    ratio = global_batch_size / config.scale_lr_reference_batch
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[config.scale_lr]


def make_plan(config: TrainConfig, batches_per_epoch: int | None, num_processes: int) -> StepPlan:
    gas = config.gradient_accumulation_steps
    # 0 with --max_tokens_per_batch: its steps hold varying numbers of samples (the start-up report gives the mean)
    global_batch = 0 if config.max_tokens_per_batch else config.per_device_train_batch_size * num_processes * gas
    if batches_per_epoch is None:  # a stream: only --max_steps says how long the run is
        if config.max_steps <= 0:
            raise ConfigError("the training loader has no length (an iterable dataset or a stream): give --max_steps "
                              "so the run and its schedule have a length, or give the dataset a __len__.")
        warmup = config.warmup_for(config.max_steps)
        if warmup > config.max_steps:
            raise ConfigError(f"warmup ({warmup} steps) is longer than training ({config.max_steps} optimizer "
                              "steps). Lower --warmup_steps or train longer.")
        return StepPlan(None, None, config.max_steps, warmup, global_batch, None, lr_scale(config, global_batch))
    if batches_per_epoch == 0:
        raise ConfigError(
            "the training data loader is empty on this process: the dataset has fewer samples than "
            f"per_device_train_batch_size ({config.per_device_train_batch_size}) x {num_processes} process(es)"
            + (" with --dataloader_drop_last" if config.dataloader_drop_last else "")
            + ". Use a smaller batch size or more data."
        )
    # Accelerate syncs at the end of the loader, so a last, shorter accumulation window is a step too.
    steps_per_epoch = math.ceil(batches_per_epoch / gas)
    if config.max_steps > 0:
        total = config.max_steps
    else:
        total = math.ceil(config.num_train_epochs * steps_per_epoch)
    warmup = config.warmup_for(total)
    if warmup > total:
        raise ConfigError(
            f"warmup ({warmup} steps) is longer than training ({total} optimizer steps). "
            "Lower --warmup_steps or train longer."
        )
    return StepPlan(
        batches_per_epoch=batches_per_epoch,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
        warmup_steps=warmup,
        global_batch_size=global_batch,
        num_epochs=math.ceil(total / steps_per_epoch),
        lr_scale=lr_scale(config, global_batch),
    )


def no_decay_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups: weight decay on weights, none on biases and normalisation parameters (1-D tensors)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or name.endswith(".bias") else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def layerwise_lr_decay_groups(
    model: torch.nn.Module, learning_rate: float, weight_decay: float, decay: float
) -> list[dict[str, Any]]:
    """Param groups for layer-wise learning-rate decay in a transformer encoder: the head keeps
    `learning_rate`, encoder layer i of L gets `learning_rate * decay**(L - i)`, the embeddings
    `decay**(L + 1)`. Biases and norms get no weight decay. Layers are found by `.layer.<i>.` /
    `.layers.<i>.` in parameter names (BERT, RoBERTa, DeBERTa, ViT, ...)."""
    import re

    pattern = re.compile(r"\.layers?\.(\d+)\.")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    depth = 1 + max((int(m.group(1)) for n, _ in named if (m := pattern.search(n))), default=-1)
    if depth == 0:
        raise ConfigError("--layerwise_lr_decay: no '.layer.<i>.' parameters found; this model has no layer stack.")
    groups: dict[tuple[float, float], list[torch.nn.Parameter]] = {}
    for name, param in named:
        match = pattern.search(name)
        if match:
            scale = decay ** (depth - int(match.group(1)))
        elif "embed" in name:
            scale = decay ** (depth + 1)
        else:
            scale = 1.0
        wd = 0.0 if param.ndim < 2 or name.endswith(".bias") else weight_decay
        groups.setdefault((learning_rate * scale, wd), []).append(param)
    return [{"params": ps, "lr": lr, "weight_decay": wd} for (lr, wd), ps in groups.items()]


def batches_per_process(loader, num_processes: int) -> int | None:
    """Micro-batches each process gets from `loader` once prepared: Accelerate deals whole batches round-robin
    and evens them out (drop_last: the incomplete round is dropped). None for a loader without a length."""
    try:
        batches = len(loader)
    except TypeError:
        return None  # a stream: make_plan asks for --max_steps
    if num_processes == 1:
        return batches
    return batches // num_processes if loader.drop_last else math.ceil(batches / num_processes)


def deepspeed_config(accelerator) -> dict:
    plugin = getattr(accelerator.state, "deepspeed_plugin", None) if accelerator is not None else None
    return plugin.deepspeed_config if plugin is not None else {}


def build_optimizer(
    model: torch.nn.Module, config: TrainConfig, params: ParamGroups | None = None, accelerator=None
) -> torch.optim.Optimizer:
    """An optimizer named by `config.optim` over `params` (default: decay / no-decay groups of `model`); `muon`
    splits each group between Muon and AdamW (core/muon.py) and is refused under FSDP and DeepSpeed. `adamw` (the
    default) and `adam` take torch's fused kernel where the device has one (core/fused.py), `adamw_torch` torch's
    default kernels, `adamw_torch_fused` the fused one.

    Under DeepSpeed with an optimizer in its JSON, DeepSpeed's own optimizer is used (Accelerate's DummyOptim
    stands in for it until `prepare`)."""
    groups = as_groups(params if params is not None else no_decay_param_groups(model, config.weight_decay))
    if not groups:
        raise ConfigError("the optimizer has no parameters: every parameter of the model is frozen.")
    if config.optim == "muon":  # Muon for the hidden matrices, AdamW for the rest (core/muon.py)
        refuse_sharded_muon(accelerator)
        return build_muon(model, config, groups, fused=fused_adamw_runs(groups, accelerator))
    if "optimizer" in deepspeed_config(accelerator):
        from accelerate.utils import DummyOptim

        return DummyOptim(groups, lr=config.learning_rate, weight_decay=config.weight_decay)
    name = config.optim
    if name in ("adamw", "adamw_torch", "adamw_torch_fused", "adam"):
        kwargs: dict[str, Any] = dict(
            lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon
        )
        if name == "adamw_torch_fused" or name in ("adamw", "adam") and fused_adamw_runs(groups, accelerator):
            kwargs["fused"] = True
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW  # Adam's decay is L2, as SGD's
        return cls(groups, weight_decay=config.weight_decay, **kwargs)
    return torch.optim.SGD(
        groups, lr=config.learning_rate, momentum=config.sgd_momentum, weight_decay=config.weight_decay
    )


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig, plan: StepPlan, accelerator=None):
    """A schedule over `plan.total_steps` optimizer steps with `plan.warmup_steps` of linear warmup.

    transformers' schedulers take the warmup themselves; torch's (step, multistep, exponential,
    cosine_annealing) get a linear warmup in front through SequentialLR. `step` and `multistep` count optimizer
    steps (step_size, milestones); `step_size_epochs` / `milestones_epochs` give them in epochs instead. Under
    DeepSpeed with a scheduler in its JSON, DeepSpeed's is used, told the same total and warmup steps (core/sharded.py
    fills them); with only an optimizer in its JSON, this schedule is built over DeepSpeed's optimizer.
    """
    engine_config = deepspeed_config(accelerator)
    if "scheduler" in engine_config or "optimizer" in engine_config:
        from accelerate.utils import DummyScheduler

        # DeepSpeed's own optimizer exists only inside deepspeed.initialize: this schedule is built over it there
        build = None if "scheduler" in engine_config else (lambda real: build_scheduler(real, config, plan))
        return DummyScheduler(optimizer, total_num_steps=plan.total_steps, warmup_num_steps=plan.warmup_steps,
                              lr_scheduler_callable=build)
    name, kwargs = config.lr_scheduler_type, epochs_to_steps(config.scheduler_kwargs, plan)
    if name == "constant" and plan.warmup_steps:
        name = "constant_with_warmup"  # transformers' "constant" silently ignores the warmup asked for
    if name == "reduce_lr_on_plateau":
        name = "reduce_on_plateau"  # one implementation, stepped on evaluations by the loop
    if name not in TORCH_SCHEDULERS:
        from transformers import get_scheduler

        try:
            return get_scheduler(
                name,
                optimizer,
                num_warmup_steps=plan.warmup_steps,
                num_training_steps=plan.total_steps,
                scheduler_specific_kwargs=kwargs or None,
            )
        except TypeError as err:
            raise ConfigError(f"--lr_scheduler_kwargs {kwargs} do not fit scheduler '{name}': {err}") from None
    if name == "reduce_on_plateau":
        if plan.warmup_steps:
            raise ConfigError("reduce_on_plateau steps on evaluations and takes no warmup; set --warmup_steps 0.")
        return torch_sched.ReduceLROnPlateau(optimizer, mode="max" if config.best_is_greater else "min", **kwargs)
    try:
        if name == "step":
            main = torch_sched.StepLR(optimizer, **{"step_size": max(1, plan.total_steps // 3), **kwargs})
        elif name == "multistep":
            default = [plan.total_steps // 2, plan.total_steps * 3 // 4]
            main = torch_sched.MultiStepLR(optimizer, **{"milestones": default, **kwargs})
        elif name == "exponential":
            main = torch_sched.ExponentialLR(optimizer, **{"gamma": 0.999, **kwargs})
        else:
            main = torch_sched.CosineAnnealingLR(
                optimizer, **{"T_max": max(1, plan.total_steps - plan.warmup_steps), **kwargs}
            )
    except TypeError as err:
        raise ConfigError(f"--lr_scheduler_kwargs {kwargs} do not fit scheduler '{name}': {err}") from None
    if not plan.warmup_steps:
        return main
    warmup = torch_sched.LambdaLR(optimizer, lambda step: step / plan.warmup_steps)
    return torch_sched.SequentialLR(optimizer, [warmup, main], milestones=[plan.warmup_steps])


def epochs_to_steps(kwargs: dict[str, Any], plan: StepPlan) -> dict[str, Any]:
    """`step_size_epochs` / `milestones_epochs` in --lr_scheduler_kwargs as optimizer steps (step_size, milestones)."""
    epochs = {k: kwargs[k] for k in ("step_size_epochs", "milestones_epochs") if k in kwargs}
    if not epochs:
        return kwargs
    if plan.steps_per_epoch is None:
        raise ConfigError(f"--lr_scheduler_kwargs {sorted(epochs)}: a stream has no epochs; give step_size / "
                          "milestones in optimizer steps.")
    out = {k: v for k, v in kwargs.items() if k not in epochs}
    if "step_size_epochs" in epochs:
        out["step_size"] = max(1, round(epochs["step_size_epochs"] * plan.steps_per_epoch))
    if "milestones_epochs" in epochs:
        out["milestones"] = [round(e * plan.steps_per_epoch) for e in epochs["milestones_epochs"]]
    return out


def steps_on_evaluation(scheduler) -> bool:
    """ReduceLROnPlateau steps on an evaluation metric, every other schedule on optimizer steps."""
    return isinstance(getattr(scheduler, "scheduler", scheduler), torch_sched.ReduceLROnPlateau)


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def run_schedule(optimizer, config: TrainConfig, plan, scheduler, accelerator):
    """The run's schedule: the caller's `scheduler`, or one built for the plan; --scale_lr applied to the optimizer
    first."""
    if plan.lr_scale != 1.0:
        if scheduler is not None:
            raise ConfigError("--scale_lr scales the optimizer's learning rates before the schedule is built; with a "
                              "scheduler of your own, scale the rates yourself and leave --scale_lr none.")
        # DeepSpeed's DummyOptim holds plain groups; its own lr is filled already scaled (sharded.py)
        groups = getattr(optimizer, "param_groups", None) or getattr(optimizer, "params", [])
        for group in groups:
            if isinstance(group, dict) and "lr" in group:
                group["lr"] *= plan.lr_scale
    return scheduler or build_scheduler(optimizer, config, plan, accelerator)
