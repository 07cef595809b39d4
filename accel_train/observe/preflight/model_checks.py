"""The pre-flight checks that touch the model, the optimizer and the schedule (see the package docstring for the
levels). Each takes the run's core.session.Session and returns findings."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Mapping

import torch
from accelerate.utils import send_to_device
from torch.utils.data import IterableDataset

from ...core.accelerator import holds_whole_model
from ...core.guard import fetch_batch
from ...core.loss import tuple_target
from .findings import Finding, base_of, loader_batch

DECAY_TO_ZERO = ("linear", "cosine", "polynomial", "cosine_with_restarts", "cosine_annealing", "warmup_stable_decay")

def check_optimizer(f) -> list[Finding]:
    optimizer = base_of(f.optimizer)
    if not holds_whole_model(f.accelerator) or not isinstance(optimizer, torch.optim.Optimizer):
        return [Finding("optimizer", "ok", "not checked: the engine (FSDP / DeepSpeed) owns the parameters.")]
    bare = f.accelerator.unwrap_model(f.model)
    named = {id(p): (n, p) for n, p in bare.named_parameters()}
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [n for i, (n, p) in named.items() if p.requires_grad and i not in in_optimizer]
    frozen = [n for i, (n, p) in named.items() if not p.requires_grad and i in in_optimizer]
    foreign = len(in_optimizer - set(named))
    out = []
    if missing:
        values = sum(named[i][1].numel() for i in named if named[i][0] in set(missing))
        out.append(Finding("optimizer", "error", f"{len(missing)} trainable parameter tensor(s) ({values:,} values) "
                           f"are not in the optimizer and will never change, e.g. {', '.join(missing[:3])}"
                           + (f"; the optimizer holds {foreign} tensor(s) that are not the model's" if foreign else "")
                           + ".", "build the optimizer after the model is final (heads replaced, embeddings resized) "
                           "from model.parameters(), or freeze those parameters with requires_grad_(False)."))
    if frozen:
        out.append(Finding("optimizer", "warning", f"{len(frozen)} frozen parameter tensor(s) are in the optimizer "
                           f"and will not train, e.g. {', '.join(frozen[:3])}.",
                           "unfreeze them if they should train, or leave them out of the optimizer."))
    if not out:
        trainable = sum(p.numel() for _, p in named.values() if p.requires_grad)
        out.append(Finding("optimizer", "ok", f"the optimizer covers every trainable parameter ({trainable:,} values "
                           f"in {len(optimizer.param_groups)} group(s))."))
    return out


def simulate_schedule(scheduler, total_steps: int, steps_per_call: int = 1,
                      steps_per_epoch: int | None = None) -> list[list[float]] | None:
    """The learning rate of each param group after k optimizer steps, k = 0..total_steps (k = 0: the first
    step's; k: what the loop logs at step k, and what step k + 1 uses), from a copy of `scheduler` whose
    optimizer holds stand-ins for the parameters (no copy of the model or its optimizer state). None for a
    schedule that steps on metrics (ReduceLROnPlateau), or whose optimizer is not a torch optimizer.
    `steps_per_epoch`: the scheduler is stepped once per epoch (--scheduler_interval epoch), after that many
    optimizer steps."""
    inner = base_of(scheduler)
    optimizer = getattr(inner, "optimizer", None)
    plateau = isinstance(inner, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if not isinstance(optimizer, torch.optim.Optimizer) or plateau:
        return None
    stand_in = torch.zeros(())
    memo = {id(p): stand_in for group in optimizer.param_groups for p in group["params"]}
    memo.update({id(t): stand_in for state in optimizer.state.values() for t in state.values()
                 if isinstance(t, torch.Tensor)})
    shadow = copy.deepcopy(inner, memo)
    groups = shadow.optimizer.param_groups
    lrs: list[list[float]] = [[float(g["lr"])] for g in groups]
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": on purpose here
        warnings.simplefilter("ignore")
        for k in range(1, total_steps + 1):
            for _ in range(steps_per_call if steps_per_epoch is None or k % steps_per_epoch == 0 else 0):
                shadow.step()
            for i, group in enumerate(groups):
                lrs[i].append(float(group["lr"]))
    return lrs


def _steps_per_call(f) -> int:
    """Accelerate's default steps a prepared scheduler once per process unless split_batches is set. DeepSpeed's
    engine steps its scheduler once per optimizer step (Accelerate's wrapper of it does nothing)."""
    if f.accelerator.distributed_type.value == "DEEPSPEED":
        return 1
    return (f.accelerator.num_processes if getattr(f.scheduler, "step_with_optimizer", False)
            and not getattr(f.scheduler, "split_batches", False) else 1)


def run_schedule(f) -> list[list[float]] | None:
    """The schedule as the run will really step it, simulated (see simulate_schedule): under DeepSpeed the engine's
    own scheduler (a JSON one, e.g. WarmupDecayLR with its "auto" values filled, or accel_train's built over
    DeepSpeed's optimizer); None when it steps on metrics."""
    if f.config.scheduler_interval == "epoch":  # a scheduler of the user's, stepped at each epoch's end
        spe = f.plan.steps_per_epoch
        return None if spe is None else simulate_schedule(f.scheduler, f.plan.total_steps, 1, spe)
    return simulate_schedule(f.scheduler, f.plan.total_steps, _steps_per_call(f))


def schedule_record(lrs: list[list[float]], plan) -> dict:
    """The simulated schedule as kept for the report: at most ~2,000 points per group, the last step included."""
    total = plan.total_steps
    stride = max(1, math.ceil(total / 2000))
    keep = sorted(set(range(0, total + 1, stride)) | {total})
    return {"steps": keep, "lr": [[g[k] for k in keep] for g in lrs], "warmup_steps": plan.warmup_steps,
            "total_steps": total}


def check_plateau(f) -> list[Finding]:
    """The loop steps a ReduceLROnPlateau on --metric_for_best_model (eval_loss when unset), whatever the metric the
    user built it for: a `mode` against that metric's direction cuts the rate each time the metric improves."""
    cfg, out = f.config, []
    for schedule in (base_of(f.scheduler), base_of(getattr(f, "plateau", None))):
        if not isinstance(schedule, torch.optim.lr_scheduler.ReduceLROnPlateau):
            continue
        better = "greater" if cfg.best_is_greater else "lower"
        if schedule.mode != ("max" if cfg.best_is_greater else "min"):
            out.append(Finding("plateau", "warning", f"your ReduceLROnPlateau(mode={schedule.mode!r}) is stepped on "
                               f"{cfg.monitored_metric} at each evaluation (--metric_for_best_model), where {better} "
                               f"is better: it cuts the learning rate each time {cfg.monitored_metric} improves.",
                               f"build it with mode={'max' if cfg.best_is_greater else 'min'!r}, or set "
                               "--metric_for_best_model (and --greater_is_better) to the metric it is meant for."))
    return out


def check_schedule(f, lrs: list[list[float]] | None = None) -> list[Finding]:
    """`lrs`: run_schedule(f), when the caller has it already."""
    cfg, plan, total = f.config, f.plan, f.plan.total_steps
    per_call = _steps_per_call(f)
    lrs = lrs if lrs is not None else run_schedule(f)
    if lrs is None:
        return [Finding("schedule", "ok", f"not simulated: {type(base_of(f.scheduler)).__name__} steps on metrics, "
                        "belongs to the engine, or steps at the epoch ends of a stream.")]
    # curve[k]: the rate optimizer step k + 1 trains with, for the group with the highest peak
    group = lrs[max(range(len(lrs)), key=lambda i: max(lrs[i][:total]))]
    curve, final = group[:total], group[total]  # final: where the schedule stands once the run is over
    peak = max(curve)
    if peak <= 0:
        return [Finding("schedule", "warning", "the learning rate is 0 at every step: nothing trains (fine for a "
                        "run that only evaluates).", "set --learning_rate > 0 to train.")]
    live = [k for k, lr in enumerate(curve) if lr > 1e-9 * peak]
    end = live[-1] + 1 if live else 0
    peak_step = next(k for k, lr in enumerate(curve) if lr >= peak * (1 - 1e-6))
    out = []
    if end < total and total - end > max(1, 0.02 * total):
        cause = (f" The Accelerator steps the prepared scheduler {per_call} times per optimizer step "
                 "(step_scheduler_with_optimizer=True)." if per_call > 1 else "")
        accelerator_fix = "build the Accelerator with build_accelerator(config)" if per_call > 1 else ""
        if getattr(f, "scheduler_built_here", False):  # accel_train built it for the plan: only the stepping is off
            fix = (accelerator_fix or "check --lr_scheduler_kwargs against the run's length") + "."
        else:
            fix = (f"build the schedule for {total} optimizer steps (after sharding and accumulation), or let "
                   "accel_train build it (pass no scheduler)" + (f", and {accelerator_fix}." if per_call > 1 else "."))
            if cfg.scheduler_interval == "step" and per_call == 1:  # the loop steps it after every optimizer step
                fix += (" If your scheduler counts epochs (a tutorial's StepLR), set --scheduler_interval epoch: it "
                        "is stepped once per epoch then.")
        out.append(Finding("schedule", "error", f"the learning rate reaches 0 after step {end} of {total}: the last "
                           f"{total - end} steps ({(total - end) / total:.0%}) train nothing.{cause}", fix))
    elif cfg.lr_scheduler_type in DECAY_TO_ZERO and not cfg.lr_scheduler_kwargs and final > 0.1 * peak:
        out.append(Finding("schedule", "warning", f"--lr_scheduler_type {cfg.lr_scheduler_type} should end near 0, "
                           f"but it is still at {final / peak:.0%} of its peak when the run ends: it was built "
                           "for more steps than the run has, or is another schedule.",
                           f"build the schedule for {total} optimizer steps, or set --lr_scheduler_type to what it "
                           "is."))
    if abs(peak_step - plan.warmup_steps) > max(1, 0.05 * plan.warmup_steps):
        out.append(Finding("schedule", "warning", f"the learning rate reaches its peak after {peak_step} step(s), "
                           f"but the warmup is {plan.warmup_steps} step(s).", "build the schedule with the config's "
                           f"warmup ({plan.warmup_steps} steps), or set --warmup_steps to what it is."))
    # your optimizer's groups at rates of their own (the start-up report names each): no one --learning_rate could be
    # their peak, and building them "with lr=config.learning_rate" is no advice
    own = getattr(f, "own_optimizer", False)
    own_rates = own and len({round(max(g[:total]), 12) for g in lrs}) > 1
    # --optim muon builds its Muon groups at --muon_lr_ratio x --learning_rate
    ratio = max(1.0, cfg.muon_lr_ratio) if cfg.optim == "muon" and not own else 1.0
    if not own_rates and not math.isclose(peak, cfg.learning_rate * plan.lr_scale * ratio, rel_tol=1e-6):
        out.append(Finding("schedule", "warning", f"the schedule peaks at {peak:.3g}, --learning_rate is "
                           f"{cfg.learning_rate:g}{plan.peak_lr_note}.", "build the optimizer with "
                           "lr=config.learning_rate, or set --learning_rate to the value used."))
    out += _step_units(cfg, plan)
    if not out:
        out.append(Finding("schedule", "ok", f"{type(base_of(f.scheduler)).__name__} simulated over {total} steps: "
                           f"peak {peak:.3g} after {peak_step} warmup step(s), {final:.3g} when the run ends."))
    return out


def _step_units(cfg, plan) -> list[Finding]:
    """`step` / `multistep` count optimizer steps; a step_size or milestones below one epoch look like epochs."""
    kwargs = cfg.scheduler_kwargs
    if cfg.lr_scheduler_type not in ("step", "multistep") or not plan.steps_per_epoch:
        return []
    given = [kwargs["step_size"]] if "step_size" in kwargs else list(kwargs.get("milestones", []))
    if not given or max(given) >= plan.steps_per_epoch:
        return []
    key = "step_size" if "step_size" in kwargs else "milestones"
    in_steps = [g * plan.steps_per_epoch for g in given]
    return [Finding("schedule", "warning", f"--lr_scheduler_kwargs {key}={given[0] if key == 'step_size' else given} "
                    f"counts optimizer steps, and one epoch is {plan.steps_per_epoch} steps: the rate changes within "
                    "the first epoch. Epochs were probably meant.",
                    f'give {key} in steps ({{"{key}": {in_steps[0] if key == "step_size" else in_steps}}} for that '
                    f'many epochs) or in epochs ({{"{key}_epochs": {given[0] if key == "step_size" else given}}}).')]


def _label_width(f, batch, labels: torch.Tensor) -> tuple[int | None, str]:
    """The number of classes the model scores: the logits' last dimension from one evaluation-mode forward with
    the labels set to 0 (an out-of-range label would crash it, on a GPU with a device-side assert) — the loss's
    "logits", or for a tuple batch whose loss returns none the model's output on the inputs (`model(*batch[:-1])`)
    — else the model's config.num_labels."""
    bare = f.accelerator.unwrap_model(f.model)
    if holds_whole_model(f.accelerator):
        mapping = isinstance(batch, Mapping)
        safe = {**batch, "labels": torch.zeros_like(labels)} if mapping else (*batch[:-1], torch.zeros_like(labels))
        safe = send_to_device(safe, f.accelerator.device)
        was_training = bare.training
        bare.eval()
        try:
            with torch.no_grad(), f.accelerator.autocast():
                out = f.loss_fn(bare, safe)
                logits = out.get("logits") if isinstance(out, Mapping) else None
                if logits is None and not mapping:
                    logits = bare(*safe[:-1])
        finally:
            bare.train(was_training)
        fits = mapping or (logits is not None and logits.ndim == labels.ndim + 1 and logits.shape[-1] > 1)
        if isinstance(logits, torch.Tensor) and logits.ndim >= 2 and fits:
            return int(logits.shape[-1]), "the logits" if mapping else "the model's output"
    num_labels = getattr(getattr(bare, "config", None), "num_labels", None)
    if num_labels and labels.ndim == 1:
        return int(num_labels), "config.num_labels"
    return None, ""


def _column_labels(loader) -> torch.Tensor | None:
    """Every label of a `datasets.Dataset` (read from its Arrow column, no decoding of the inputs)."""
    dataset = getattr(loader, "dataset", None)
    names = getattr(dataset, "column_names", None) or []
    for name in ("labels", "label"):
        if name in names:
            try:
                values = torch.as_tensor(dataset[name])
            except (TypeError, ValueError):
                return None
            return values if not values.is_floating_point() else None
    return None


def check_labels(f) -> list[Finding]:
    loader = f.train_loader
    if isinstance(loader.dataset, IterableDataset):
        return [Finding("labels", "ok", "not checked: a stream has no indices to read its first samples by.")]
    size = min(loader_batch(loader) or 1, len(loader.dataset))
    batch = fetch_batch(loader, list(range(size)))  # the first samples: no sampler, no random number drawn
    labels = batch.get("labels") if isinstance(batch, Mapping) else tuple_target(batch)  # (inputs..., targets)
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point():
        return [Finding("labels", "ok", "not checked: the batch has no integer 'labels' nor integer targets as the "
                        "last element of a tuple (regression?).")]
    width, source = _label_width(f, batch, labels)
    if width is None:
        return [Finding("labels", "ok", "not checked: the loss returns no logits and the model has no num_labels.")]
    out = []
    for split, values in (("training batch", labels), ("training set", _column_labels(loader)),
                          ("evaluation set", _column_labels(f.eval_loader) if f.eval_loader is not None else None)):
        if values is None:
            continue
        used = values[values != -100]  # -100: the ignore index of cross-entropy
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= width):
            out.append(Finding("labels", "error", f"the {split} has labels {int(used.min())}..{int(used.max())}, the "
                               f"model scores {width} classes ({source}): valid labels are 0..{width - 1}.",
                               "map the labels to 0..num_labels-1 (e.g. 1-based labels minus 1), or build the model "
                               "with num_labels = the number of classes."))
    if not out:
        out.append(Finding("labels", "ok", f"labels within 0..{width - 1} ({width} classes, from {source})."))
    return out
