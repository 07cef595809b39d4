"""The run's optimizer, schedule and clipping as they run: a researcher's own objects named, never assumed.

`train(optimizer=..., scheduler=...)` takes the user's objects as they are. What the loop adds around them is said in
the start-up report and recorded in config.yaml (`what_ran`): the optimizer's class and each group's peak rate and
decay, the scheduler's class and when it is stepped, the clipping, and for each whether the user passed it or
accel_train built it. A scheduler of the user's is stepped on the clock --scheduler_interval names: after every
optimizer step (the default, stated) or at each epoch's end; a ReduceLROnPlateau at each evaluation.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate.data_loader import SeedableRandomSampler
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import RandomSampler

from ..config import TrainConfig
from ..errors import ConfigError
from .accelerator import loop_steps_schedulers
from .data import random_item_notes
from .deepspeed_json import engine_clipping, engine_schedule
from .hyperparameters import group_peaks
from .optim import steps_on_evaluation
from .stream import idle_worker_notes


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


def take_schedules(accelerator, scheduler, config: TrainConfig) -> None:
    """After prepare: each prepared schedule steps once at each of the loop's calls (loop_steps_schedulers). A clock
    scheduler of the user's that is no torch LRScheduler (a class of one's own with step()) is not one Accelerate's
    prepare takes in, so no checkpoint held it (a resume started its warmup again, a rollback left it ahead of the
    weights): with state_dict / load_state_dict it is registered for checkpointing (saved, resumed and rolled back
    with the rest); without them it is refused where checkpoints are written or read."""
    loop_steps_schedulers(accelerator)
    if scheduler is None or isinstance(inner_object(scheduler), LRScheduler):  # prepared (wrapped) by Accelerate
        return
    if callable(getattr(scheduler, "state_dict", None)) and callable(getattr(scheduler, "load_state_dict", None)):
        accelerator.register_for_checkpointing(scheduler)
    elif config.save_strategy != "no" or config.resume_from_checkpoint:
        raise ConfigError(f"train(scheduler=...): the {type(scheduler).__name__} has no state_dict() and "
                          "load_state_dict(), so a checkpoint cannot hold where its schedule stands: a resume would "
                          "start it again. Give it both (returning and taking the counters it steps), use a "
                          "torch.optim.lr_scheduler scheduler, or train with --save_strategy no.")


def split_schedulers(given, optimizer=None, own_optimizer: bool = True) -> tuple[Any, list]:
    """train(scheduler=...): one scheduler, or several as a tutorial has them (a StepLR beside a ReduceLROnPlateau):
    (the schedule on the clock or None, [the plateau stepped at evaluations beside it]). More than one of either is
    refused with what to do, and so is a scheduler built on another optimizer than `optimizer`, the one that trains
    (it would step the other's rates and leave the trained one's constant)."""
    if isinstance(given, (list, tuple)) and not given:  # built and named "yours" before
        raise ConfigError("train(scheduler=[]): an empty list. Pass scheduler=None for the schedule --lr_scheduler_"
                          "type builds (constant: a constant rate), or the scheduler(s) of your own.")
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
    `plateau`: a ReduceLROnPlateau of the user's beside the clock schedule. A DeepSpeed JSON's scheduler is named as
    the JSON's, with each group's peak as it holds it (`engine_schedule`: the groups read the warmup's start)."""
    opt, sched = inner_object(optimizer), inner_object(scheduler)
    engine = None if own_scheduler else engine_schedule(getattr(optimizer, "accelerator_state", None), sched)
    if steps_on_evaluation(scheduler):
        clock = f"at each evaluation, on {config.monitored_metric}"
    elif own_scheduler:
        clock = "each epoch" if config.scheduler_interval == "epoch" else "each optimizer step"
    else:
        clock = "each optimizer step"
    groups = [{"lr": lr, "weight_decay": wd} for lr, wd in group_peaks(opt)]
    for group, peak in zip(groups, (engine or {}).get("peaks") or (), strict=False):
        group["lr"] = peak
    for group, label in zip(groups, getattr(opt, "group_labels", ()), strict=False):
        group["params"] = label  # a composite optimizer (--optim muon) says which of its parts steps each group
    ran = {
        "optimizer": {"class": type(opt).__name__, "given": "yours" if own_optimizer else "built from the config",
                      "groups": groups, **({"fused": True} if fused_kernel(opt) else {})},
        "scheduler": {"class": type(sched).__name__ if sched is not None else None,
                      "given": "yours" if own_scheduler else engine["given"] if engine else
                      f"built: --lr_scheduler_type {config.lr_scheduler_type}",
                      "stepped": clock},
        "clipping": clipping_in_effect(optimizer, config),
    }
    if plateau is not None:
        ran["plateau"] = {"class": type(inner_object(plateau)).__name__, "given": "yours",
                          "stepped": f"at each evaluation, on {config.monitored_metric}"}
    return ran


def clipping_in_effect(optimizer, config: TrainConfig) -> dict[str, Any]:
    """What `what_ran` records of the clipping: the norm the gradients are clipped to (None: not clipped) and, where
    that is not --max_grad_norm, what set it. A DeepSpeed engine clips at its config's "gradient_clipping", which a
    JSON may set explicitly beside the flag at its default (core/deepspeed_json.py); the prepared optimizer carries
    Accelerate's state (AcceleratedOptimizer.accelerator_state), where the engine's config is."""
    flag = config.max_grad_norm if config.max_grad_norm > 0 else None
    engine = engine_clipping(getattr(optimizer, "accelerator_state", None))
    if engine is None or (engine if engine > 0 else None) == flag:
        return {"max_grad_norm": flag}
    return {"max_grad_norm": engine if engine > 0 else None, "set_by": "DeepSpeed's config (\"gradient_clipping\")"}


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
    clip, set_by = ran["clipping"]["max_grad_norm"], ran["clipping"].get("set_by")
    if set_by:
        clipped = "none" if clip is None else f"global grad norm clipped to {clip:g}"
        lines.append(f"  clipping         {clipped} ({set_by}; --max_grad_norm {config.max_grad_norm:g} does not "
                     "apply)")
    elif clip is None:
        lines.append("  clipping         none (--max_grad_norm 0)")
    else:
        given = " (the default; --max_grad_norm 0 turns it off)" if config.max_grad_norm == 1.0 else ""
        lines.append(f"  clipping         global grad norm clipped to {clip:g}{given}")
    return schedule, lines


# where a torch scheduler (or plateau) stands, not how it was built; and what of an optimizer's param group is its
# rates (compared and followed on resume: hyperparameters.py) or its tensors
PROGRESS = {"last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step", "_is_initial", "base_lrs", "best",
            "num_bad_epochs", "cooldown_counter", "verbose", "T_cur", "T_i"}
GROUP_RATES = {"params", "lr", "initial_lr", "weight_decay"}


def own_settings(session) -> dict[str, dict[str, Any]]:
    """How the user's own optimizer, scheduler and plateau are built, as their state dicts hold it ({what: {key path:
    value}}, without where they stand): taken before a resume loads the checkpoint's (own_setting_notes)."""
    found: dict[str, dict[str, Any]] = {}
    if session.own_optimizer:
        groups = inner_object(session.optimizer).param_groups
        cycled = getattr(inner_object(session.scheduler), "cycle_momentum", False)  # OneCycleLR, CyclicLR step them
        skipped = GROUP_RATES | ({"momentum", "betas"} if cycled else set())
        found["optimizer"] = {f"param_groups[{i}].{k}": v for i, g in enumerate(groups) for k, v in g.items()
                              if k not in skipped}
    owned = {"scheduler": None if session.scheduler_built_here else session.scheduler, "plateau": session.plateau}
    for what, obj in owned.items():  # torch's schedulers, whose keys of progress are known (PROGRESS)
        inner = inner_object(obj)
        if isinstance(inner, LRScheduler):
            found[what] = _settings(inner.state_dict())
    return found


def _settings(state: Any, path: str = "") -> dict[str, Any]:
    if isinstance(state, dict):
        return {k: v for key, value in state.items() if key not in PROGRESS
                for k, v in _settings(value, f"{path}.{key}" if path else str(key)).items()}
    if isinstance(state, (list, tuple)) and any(isinstance(item, dict) for item in state):
        return {k: v for i, item in enumerate(state) for k, v in _settings(item, f"{path}[{i}]").items()}
    return {path: state}


def own_setting_notes(session, before: dict[str, dict[str, Any]]) -> list[str]:
    """What a resume's load put back over the user's own objects as their code builds them now: torch's
    load_state_dict restores a scheduler's settings (a CosineAnnealingLR's T_max) and an optimizer's param groups
    (betas, momentum) as the checkpoint holds them; said, with where to set them instead."""
    after, notes = own_settings(session), []
    for what, built in before.items():
        loaded = after.get(what, {})
        changed = [key for key in built if key in loaded and not _same(built[key], loaded[key])]
        if changed:
            settings = ", ".join(f"{key} {loaded[key]!r} (your code: {built[key]!r})" for key in changed[:4])
            notes.append(f"your {what}'s settings as the checkpoint holds them run, not as your code built them now: "
                         f"{settings}; torch's load_state_dict restores them (set them in a hook's "
                         "on_train_start to change them)")
    return notes


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and bool(torch.equal(a.cpu(), b.cpu()))
    try:
        return bool(a == b)
    except (RuntimeError, ValueError):  # tensors of other shapes, arrays
        return a is b


def own_generator_notes(loader, config: TrainConfig, accelerator=None) -> list[str]:
    """What the start-up report says of a shuffled training DataLoader built with a generator of the user's:
    Accelerate's seedable sampler (which lets a resume replay the order) draws the order from the run's seed. A
    sampler of the user's that subclasses RandomSampler is refused: that sampler takes its place (Accelerate replaces
    every RandomSampler), so its own sampling would never run. Nothing is said under an Accelerator of the user's
    without the seedable sampler: the loader is then taken as it is."""
    batches = getattr(loader, "batch_sampler", None)
    sampler = getattr(batches, "sampler", None) or getattr(loader, "sampler", None)  # the one Accelerate looks at
    seedable = accelerator is None or accelerator.dataloader_config.use_seedable_sampler
    if not seedable or not isinstance(sampler, RandomSampler):
        return []
    if type(sampler) not in (RandomSampler, SeedableRandomSampler):  # Accelerate's own takes its own place
        name = type(sampler).__name__
        raise ConfigError(f"the training DataLoader's sampler, {name}, subclasses torch's RandomSampler: "
                          "Accelerate's seedable sampler (which lets a resume replay the order) replaces every "
                          f"RandomSampler with its own, so the {name}'s sampling would never run. Subclass "
                          "torch.utils.data.Sampler instead (its order is then yours: give it a set_epoch(epoch) "
                          "that reseeds it, for an exact resume), or use a RandomSampler itself.")
    if getattr(loader, "generator", None) is None:
        return []
    seed, flag = (config.data_seed, "--data_seed") if config.data_seed is not None else (config.seed, "--seed")
    return [f"the training DataLoader's own generator is not used: its shuffled order comes from {flag} {seed} and "
            "the epoch (a seedable sampler, so that a resume replays it); change the order with --data_seed"]


def loader_notes(loader, config: TrainConfig, accelerator) -> list[str]:
    """What the start-up report says of the user's training DataLoader: its items' random draws, idle workers, its
    own generator (a sampler of its own that Accelerate would replace is refused)."""
    return random_item_notes(loader) + idle_worker_notes(loader) + own_generator_notes(loader, config, accelerator)
