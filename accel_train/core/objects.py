"""The run's optimizer, schedule and clipping as they run: a researcher's own objects named, never assumed.

`train(optimizer=..., scheduler=...)` takes the user's objects as they are. What the loop adds around them is said in
the start-up report and recorded in config.yaml (`what_ran`): the optimizer's class and each group's peak rate and
decay, the scheduler's class and when it is stepped, the clipping, and for each whether the user passed it or
accel_train built it. A scheduler of the user's is stepped on the clock --scheduler_interval names: after every
optimizer step (the default, stated) or at each epoch's end; a ReduceLROnPlateau at each evaluation.
"""

from __future__ import annotations

from typing import Any

from ..config import TrainConfig
from ..errors import ConfigError
from .hyperparameters import group_peaks
from .optim import steps_on_evaluation


def check_interval(config: TrainConfig, own_scheduler: bool) -> None:
    """--scheduler_interval epoch is for a scheduler object of the user's: the schedules accel_train builds count
    optimizer steps (their epoch-sized arguments are converted to steps)."""
    if config.scheduler_interval == "epoch" and not own_scheduler:
        raise ConfigError("--scheduler_interval epoch steps a scheduler object of your own (train(scheduler=...)) once "
                          "per epoch; this run builds its schedule from --lr_scheduler_type, which counts optimizer "
                          "steps. Leave --scheduler_interval step, and give epoch-sized arguments as "
                          "step_size_epochs / milestones_epochs in --lr_scheduler_kwargs.")


def drives(driven, optimizer) -> bool:
    """Whether a scheduler built on `driven` sets the rates of `optimizer`: the same object, or one whose param groups
    are the trained optimizer's own dicts (a wrapper such as a Lookahead shares them); Accelerate's DummyOptim stands
    in for an optimizer a DeepSpeed engine builds later (its schedule is rebuilt on that one)."""
    if driven is None or optimizer is None or driven is optimizer:
        return True
    if "DummyOptim" in (type(driven).__name__, type(optimizer).__name__):
        return True
    trained = {id(group) for group in getattr(optimizer, "param_groups", [])}
    groups = getattr(driven, "param_groups", [])
    return bool(groups) and all(id(group) in trained for group in groups)


def split_schedulers(given, optimizer=None, own_optimizer: bool = True) -> tuple[Any, list]:
    """train(scheduler=...): one scheduler, or several as a tutorial has them (a StepLR beside a ReduceLROnPlateau):
    (the schedule on the clock or None, [the plateau stepped at evaluations beside it]). More than one of either is
    refused with what to do, and so is a scheduler built on another optimizer than `optimizer`, the one that trains
    (it would step the other's rates and leave the trained one's constant)."""
    for scheduler in given if isinstance(given, (list, tuple)) else [given]:
        driven = getattr(scheduler, "optimizer", None)
        if not drives(driven, optimizer):
            own = "the optimizer you passed" if own_optimizer else \
                "the optimizer accel_train built (train() was given no optimizer object, or param groups)"
            raise ConfigError(f"train(scheduler=...): the {type(scheduler).__name__} was built on a "
                              f"{type(driven).__name__} that does not train; {own} does. Build the scheduler on the "
                              "optimizer you pass as train(optimizer=...), or pass no scheduler and set "
                              "--lr_scheduler_type.")
    if not isinstance(given, (list, tuple)):
        return given, []
    plateaus = [s for s in given if steps_on_evaluation(s)]
    clocks = [s for s in given if not steps_on_evaluation(s)]
    if len(plateaus) > 1 or len(clocks) > 1:
        raise ConfigError(f"train(scheduler=[...]) takes at most one schedule on the clock and one ReduceLROnPlateau "
                          f"beside it; got {', '.join(type(s).__name__ for s in given)}. Combine clock schedules "
                          "with torch.optim.lr_scheduler.SequentialLR or ChainedScheduler.")
    if not clocks:
        return (plateaus[0] if plateaus else None), []
    return clocks[0], plateaus


def steps_each_optimizer_step(scheduler, config: TrainConfig) -> bool:
    return config.scheduler_interval == "step" and not steps_on_evaluation(scheduler)


def steps_each_epoch(scheduler, config: TrainConfig) -> bool:
    return config.scheduler_interval == "epoch" and not steps_on_evaluation(scheduler)


def inner_object(obj):
    """The object Accelerate wrapped (AcceleratedOptimizer.optimizer, AcceleratedScheduler.scheduler), or obj; under
    DeepSpeed, the torch optimizer inside its ZeRO optimizer (DeepSpeedOptimizerWrapper -> DeepSpeedZeroOptimizer ->
    torch.optim.AdamW), which steps the partitions, and the schedule inside DeepSpeedSchedulerWrapper."""
    while type(obj).__name__.startswith(("Accelerated", "DeepSpeed", "ZeRO")):
        inner = getattr(obj, "optimizer", None) or getattr(obj, "scheduler", None)
        if inner is None:
            break
        obj = inner
    return obj


def fused_kernel(opt) -> bool:
    """Whether every param group steps with torch's fused kernel (read from the groups: a resumed run takes the
    checkpoint's choice, whatever the optimizer was built with)."""
    groups = getattr(opt, "param_groups", None) or []
    return bool(groups) and all(isinstance(g, dict) and g.get("fused") for g in groups)


def what_ran(optimizer, scheduler, config: TrainConfig, own_optimizer: bool, own_scheduler: bool,
             plateau=None) -> dict[str, Any]:
    """The record config.yaml keeps under `what_ran` (and the start-up report prints): what the loop really steps;
    `plateau`: a ReduceLROnPlateau of the user's beside the clock schedule."""
    opt, sched = inner_object(optimizer), inner_object(scheduler)
    if steps_on_evaluation(scheduler):
        clock = f"at each evaluation, on {config.monitored_metric}"
    elif own_scheduler:
        clock = "each epoch" if config.scheduler_interval == "epoch" else "each optimizer step"
    else:
        clock = "each optimizer step"
    groups = [{"lr": lr, "weight_decay": wd} for lr, wd in group_peaks(opt)]
    for group, label in zip(groups, getattr(opt, "group_labels", ()), strict=False):
        group["params"] = label  # a composite optimizer (--optim muon) says which of its parts steps each group
    ran = {
        "optimizer": {"class": type(opt).__name__, "given": "yours" if own_optimizer else "built from the config",
                      "groups": groups, **({"fused": True} if fused_kernel(opt) else {})},
        "scheduler": {"class": type(sched).__name__ if sched is not None else None,
                      "given": "yours" if own_scheduler else f"built: --lr_scheduler_type {config.lr_scheduler_type}",
                      "stepped": clock},
        "clipping": {"max_grad_norm": config.max_grad_norm if config.max_grad_norm > 0 else None},
    }
    if plateau is not None:
        ran["plateau"] = {"class": type(inner_object(plateau)).__name__, "given": "yours",
                          "stepped": f"at each evaluation, on {config.monitored_metric}"}
    return ran


def report_lines(ran: dict[str, Any], config: TrainConfig, warmup_steps: int = 0,
                 lr_scale: float = 1.0) -> tuple[str | None, list[str]]:
    """The start-up report's words for `what_ran`: the schedule line for a scheduler of the user's, or for one built
    over the user's optimizer (None: the report's own line, built from the config, is true) and the optimizer and
    clipping lines. Each thing the user did not choose is named as a default."""
    opt, sched = ran["optimizer"], ran["scheduler"]
    schedule = None
    if sched["given"] != "yours" and opt["given"] == "yours":
        # a built schedule multiplies each group's own rate: --learning_rate is not its peak
        rates = ", ".join(f"{g['lr']:g}" for g in opt["groups"][:4]) + (", ..." if len(opt["groups"]) > 4 else "")
        schedule = (f"{config.lr_scheduler_type}, peak lr {rates} (your optimizer's rates, each group's own; "
                    f"--learning_rate does not apply), {warmup_steps} warmup step(s)")
    elif sched["given"] == "yours":
        default = (" (--scheduler_interval step, the default; epoch steps it at each epoch's end)"
                   if sched["stepped"] == "each optimizer step" else "")
        beside = f"; beside it {ran['plateau']['class']}, stepped {ran['plateau']['stepped']}" if "plateau" in ran \
            else ""
        schedule = (f"yours, {sched['class']}, stepped {sched['stepped']}{default}{beside}; --learning_rate and "
                    "--warmup_steps do not apply to it")
    groups = "; ".join((f"{g['params']}: " if "params" in g else "") + f"lr {g['lr']:g}, weight decay "
                       f"{g['weight_decay']:g}" for g in opt["groups"][:4])
    more = f"; ... {len(opt['groups'])} groups" if len(opt["groups"]) > 4 else ""
    kernel = ", fused kernel" if opt.get("fused") else ""
    # --scale_lr multiplies the rates of an optimizer of the user's too (run_schedule): the rates shown are scaled
    scaled = f" (your rates x {lr_scale:.4g}: --scale_lr {config.scale_lr})" if opt["given"] == "yours" and \
        lr_scale != 1.0 else ""
    lines = [f"  optimizer        {opt['class']} ({opt['given']}{kernel}): {groups}{more}{scaled}"]
    clip = ran["clipping"]["max_grad_norm"]
    if clip is None:
        lines.append("  clipping         none (--max_grad_norm 0)")
    else:
        given = " (the default; --max_grad_norm 0 turns it off)" if config.max_grad_norm == 1.0 else ""
        lines.append(f"  clipping         global grad norm clipped to {clip:g}{given}")
    return schedule, lines
