"""Resuming with other hyperparameters: what a run's optimizer and schedule were built with (saved in every
checkpoint's train_state.json), which changes a loaded state can follow (applied to the loaded optimizer and schedule,
each said in the start-up report) and which it cannot (refused by name before the checkpoint is loaded)."""

from __future__ import annotations

from typing import Any

from torch.optim import lr_scheduler as torch_sched

from ..config import TrainConfig
from ..errors import ConfigError
from .optim import StepPlan

HYPERPARAMETERS = ("optim", "learning_rate", "scale_lr", "scale_lr_reference_batch", "weight_decay", "adam_beta1",
                   "adam_beta2", "adam_epsilon", "sgd_momentum", "muon_lr_ratio", "lr_scheduler_type",
                   "lr_scheduler_kwargs", "scheduler_interval")
# what builds the optimizer and what builds the schedule: an object of the user's own is built by none of them
OPTIMIZER_FLAGS = ("optim", "learning_rate", "peak_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
                   "sgd_momentum", "muon_lr_ratio")
SCHEDULE_FLAGS = ("lr_scheduler_type", "lr_scheduler_kwargs", "total_steps", "warmup_steps")
# flag -> (the group key it sets, a key only that optimizer's groups hold): Muon's groups hold "eps" and "momentum" too
_SET_IN_GROUPS = {"adam_epsilon": ("eps", "betas"), "sgd_momentum": ("momentum", "dampening")}


def group_peaks(optimizer) -> list[list[float]]:
    """[peak learning rate, weight decay] of each param group as this run built it: the schedule's base rate
    (`initial_lr`, which --scale_lr and per-group flags such as --vision_learning_rate or --layerwise_lr_decay are
    already in) and the group's decay. Saved with every checkpoint, so a resume sees a change to any one group."""
    groups = getattr(optimizer, "param_groups", None) or []
    return [[float(g.get("initial_lr", g.get("lr", 0.0))), float(g.get("weight_decay", 0.0))]
            for g in groups if isinstance(g, dict)]


def run_hyperparameters(config: TrainConfig, plan: StepPlan, groups: list[list[float]] | None = None,
                        own: tuple[bool, bool] = (False, False),
                        classes: tuple[str, str] | None = None) -> dict[str, Any]:
    """The hyperparameters this run's optimizer and schedule are built with (saved in train_state.json); `groups`
    from `group_peaks`. `own`: whether the optimizer and the scheduler are the user's objects; the flags that did not
    build one are left out, so that a resume never applies them to it (an optimizer of the user's is compared by its
    groups' own rates and decays). `classes`: the optimizer's and the scheduler's classes, recorded with who built
    them, so that a resume into other objects (a user's SGD where a built AdamW was) is refused, not loaded."""
    values = {name: getattr(config, name) for name in HYPERPARAMETERS}
    values.update(peak_lr=config.learning_rate * plan.lr_scale, total_steps=plan.total_steps,
                  warmup_steps=plan.warmup_steps)
    if groups is not None:
        values["param_groups"] = groups
    if classes is not None:
        values["objects"] = [f"{name} ({'yours' if mine else 'built'})"
                             for name, mine in zip(classes, own, strict=True)]
    left_out = (OPTIMIZER_FLAGS if own[0] else ()) + (SCHEDULE_FLAGS if own[1] else ())
    return {name: value for name, value in values.items() if name not in left_out}


def hyperparameter_changes(scheduler, saved: dict[str, Any], current: dict[str, Any],
                           engine_owned: bool = False) -> dict[str, tuple[Any, Any]]:
    """{name: (saved, current)} of the hyperparameters that changed; a change a loaded state cannot follow is a
    ConfigError naming each field. Called before the checkpoint is loaded too, so that another --optim or another
    number of param groups is refused by name, not by torch's load_state_dict."""
    changed = {k: (saved[k], v) for k, v in current.items() if k in saved and saved[k] != v}
    if not changed:
        return {}
    inner = getattr(scheduler, "scheduler", scheduler)
    refused = [k for k in ("optim", "objects", "lr_scheduler_type", "lr_scheduler_kwargs", "scheduler_interval")
               if k in changed]
    if not isinstance(inner, (torch_sched.LambdaLR, torch_sched.ReduceLROnPlateau)):
        # torch's step / multistep / ... schedules keep their step counts in their saved state
        refused += [k for k in ("total_steps", "warmup_steps") if k in changed]
    per_group = "param_groups" in saved and "param_groups" in current
    if per_group:
        refused += group_refusals(*changed.get("param_groups", (saved["param_groups"], saved["param_groups"])))
    elif "weight_decay" in changed and not changed["weight_decay"][0]:
        refused.append("weight_decay")  # from 0: which groups should decay cannot be told from the loaded state
    if engine_owned:
        refused = list(changed)
    if refused:
        raise ConfigError(
            "resuming with changed " + ", ".join(f"{k} ({changed[k][0]!r} -> {changed[k][1]!r})" if k in changed
                                                 else k for k in refused)
            + ": the checkpoint's optimizer and schedule state was built for the old value(s) and cannot follow. "
            "Resume with the old values, or start a new run in another --output_dir.")
    return changed


def apply_hyperparameters(optimizer, scheduler, saved: dict[str, Any], current: dict[str, Any],
                          engine_owned: bool = False) -> list[str]:
    """After a checkpoint's optimizer and schedule state were loaded (which brings back the values they were
    built with), make them follow this run's hyperparameters where those differ; return one line per change.
    Each param group follows its own peak rate and decay (a changed --vision_learning_rate moves only that tower's
    group; a changed --learning_rate only the groups built from it). A change the loaded state cannot follow is a
    ConfigError naming each field (`hyperparameter_changes`). `saved` empty: a checkpoint from before hyperparameters
    were recorded (nothing is compared); without saved per-group values, every group follows --learning_rate and
    --weight_decay."""
    changed = hyperparameter_changes(scheduler, saved, current, engine_owned)
    if not changed:
        return []
    inner = getattr(scheduler, "scheduler", scheduler)
    per_group = "param_groups" in saved and "param_groups" in current
    groups = optimizer.param_groups
    schedules = [s for s in (inner, *getattr(inner, "_schedulers", ())) if hasattr(s, "base_lrs")]
    if per_group:
        lines = apply_group_changes(groups, schedules, *changed["param_groups"]) if "param_groups" in changed else []
    else:
        lines = []
        if "peak_lr" in changed:
            ratio = changed["peak_lr"][1] / changed["peak_lr"][0]
            _scale_rates(groups, schedules, [ratio] * len(groups))
        if "weight_decay" in changed:
            ratio = changed["weight_decay"][1] / changed["weight_decay"][0]
            for group in groups:
                group["weight_decay"] = group.get("weight_decay", 0.0) * ratio  # no-decay groups stay at 0
    for name in ("adam_beta1", "adam_beta2"):
        if name in changed:
            for group in groups:
                if "betas" in group:
                    betas = list(group["betas"])
                    betas[name == "adam_beta2"] = changed[name][1]
                    group["betas"] = tuple(betas)
    for name, (key, owner) in _SET_IN_GROUPS.items():
        if name in changed:
            for group in groups:
                if owner in group:
                    group[key] = changed[name][1]
    return [f"{k} {old!r} -> {new!r}: applied to the loaded optimizer and schedule"
            for k, (old, new) in changed.items() if k not in ("peak_lr", "param_groups")] + lines


def group_refusals(old: list[list[float]], new: list[list[float]]) -> list[str]:
    """What a per-group change cannot follow: another number of groups, a rate raised from 0 (no ratio to scale)."""
    if len(old) != len(new):
        return [f"param_groups ({len(old)} groups in the checkpoint, {len(new)} now: the model or the per-group "
                "flags changed which parameters train)"]
    return [f"param group {i} learning rate ({o[0]!r} -> {n[0]!r})" for i, (o, n) in enumerate(zip(old, new,
            strict=True)) if o[0] == 0 and n[0] != 0]


def apply_group_changes(groups, schedules, old: list[list[float]], new: list[list[float]]) -> list[str]:
    """Each group's new peak rate (its current rate and schedule base scaled by new / old) and weight decay."""
    ratios = [n[0] / o[0] if o[0] else 1.0 for o, n in zip(old, new, strict=True)]
    _scale_rates(groups, schedules, ratios)
    lines = []
    for i, (o, n) in enumerate(zip(old, new, strict=True)):
        groups[i]["weight_decay"] = n[1]
        if o != n:
            lines.append(f"param group {i}: peak learning rate {o[0]:.6g} -> {n[0]:.6g}, weight decay {o[1]:.6g} -> "
                         f"{n[1]:.6g}: applied to the loaded optimizer and schedule")
    return lines


def _scale_rates(groups, schedules, ratios: list[float]) -> None:
    for group, ratio in zip(groups, ratios, strict=True):
        for key in ("lr", "initial_lr"):
            if key in group:
                group[key] *= ratio
    for schedule in schedules:
        schedule.base_lrs = [lr * ratio for lr, ratio in zip(schedule.base_lrs, ratios, strict=True)]
