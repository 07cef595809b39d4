"""The pre-flight check: the silent bugs that waste a training run, looked for before step 0.

Each check returns findings with the fix. The rule for the level:

* **error** — the run as set up is certainly not the one asked for, or would crash later: precision or world
  size other than asked, a loader whose batch disagrees with the planned global batch, trainable parameters the
  optimizer never updates, a schedule that reaches zero long before the last step, labels outside the model's
  range. The run refuses to start (`ConfigError` listing every error) and writes nothing.
* **warning** — wrong in most runs but with legitimate uses: an unshuffled training loader (data already
  shuffled, a curriculum), a shuffled or truncated evaluation loader, a sampler that cannot be replayed on
  resume, a schedule of another length or warmup than the config says, low-precision master weights, intervals
  longer than the run. Printed, and kept in `preflight.json` and the report.
* **ok** — what was checked and found right, with the numbers (kept for the report).

Cost: no pass over the data and no backward. One evaluation-mode forward of one micro-batch (the first samples of
the training set) when the model's label range is read from its logits; the schedule is simulated on a copy of
the scheduler whose parameters are stand-ins. No random number generator is advanced.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from collections.abc import Mapping
from typing import Any, Callable, Literal, Optional

import torch
from accelerate.utils import gather_object, send_to_device

from .errors import ConfigError
from .runtime import precision_in_effect, requested_world_size

Level = Literal["error", "warning", "ok"]
LOCAL = ("NO", "MULTI_CPU", "MULTI_GPU")  # distributed types where the bare model and optimizer are whole
DECAY_TO_ZERO = ("linear", "cosine", "polynomial", "cosine_with_restarts", "cosine_annealing", "warmup_stable_decay")


@dataclass
class Finding:
    check: str
    level: Level
    message: str
    fix: str = ""

    def line(self) -> str:
        return f"[{self.level}] {self.check}: {self.message}" + (f" Fix: {self.fix}" if self.fix else "")


@dataclass
class PreflightResult:
    findings: list[Finding]
    schedule: Optional[dict] = None  # {"steps": [...], "lr": [[...] per group]} simulated on a copy
    seconds: float = 0.0

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "warning"]

    def to_dict(self) -> dict:
        return {"findings": [asdict(f) for f in self.findings], "schedule": self.schedule,
                "seconds": round(self.seconds, 3)}


@dataclass
class Flight:
    """What the checks look at: the prepared objects of the run about to start."""

    accelerator: Any
    config: Any
    plan: Any
    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    train_loader: Any
    eval_loader: Any
    loss_fn: Callable
    schedule: Optional[dict] = field(default=None)

    @property
    def local(self) -> bool:
        return self.accelerator.distributed_type.value in LOCAL


def run_preflight(accelerator, config, plan, model, optimizer, scheduler, train_loader, eval_loader,
                  loss_fn) -> PreflightResult:
    """Run every check on every process; raise `ConfigError` with all errors (and their fixes) if any process
    found one, so that every rank refuses the same start. Returns the findings otherwise."""
    started = time.perf_counter()
    flight = Flight(accelerator, config, plan, model, optimizer, scheduler, train_loader, eval_loader, loss_fn)
    findings: list[Finding] = []
    for check in CHECKS:
        try:
            findings += check(flight)
        except Exception as err:  # a check that cannot run must not stop a run it cannot judge
            findings.append(Finding(check.__name__.removeprefix("check_"), "warning",
                                    f"the check could not run ({type(err).__name__}: {err}).",
                                    "report it; --no_preflight skips the pre-flight check."))
    if accelerator.num_processes > 1:  # one collective: every rank takes the same decision
        merged = gather_object([asdict(f) for f in findings])
        findings = [Finding(**d) for d in {tuple(d.values()): d for d in merged}.values()]
    result = PreflightResult(findings, flight.schedule, time.perf_counter() - started)
    if result.errors:
        raise ConfigError("the pre-flight check refused to start this run:\n" +
                          "\n".join(f"  - {f.message} Fix: {f.fix}" for f in result.errors) +
                          "\n(--no_preflight skips the check.)")
    return result


# ------------------------------------------------------------------------------------------------ the checks


def check_precision(f: Flight) -> list[Finding]:
    acc, asked = f.accelerator, f.config.mixed_precision
    running, effect = acc.mixed_precision, precision_in_effect(acc)
    out = []
    if asked is not None and asked != running:
        out.append(Finding("precision", "error", f"--mixed_precision {asked} was asked, the Accelerator runs {running}.",
                           "build the Accelerator with build_accelerator(config), or give both the same precision."))
    elif running in ("fp16", "bf16") and effect == "fp32":
        out.append(Finding("precision", "error", f"{running} was asked but no autocast is in effect (fp32).",
                           "check the device supports it; run `accelerate env`."))
    halves = {p.dtype for p in f.model.parameters() if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16)}
    if halves and f.local:
        dtype = str(sorted(halves, key=str)[0]).removeprefix("torch.")
        level: Level = "error" if running == "fp16" and torch.float16 in halves else "warning"
        out.append(Finding("precision", level, f"trainable parameters are stored in {dtype}: updates smaller than "
                           f"{dtype}'s resolution are lost (low-precision training, not mixed precision)"
                           + (", and the fp16 loss scaler refuses fp16 gradients." if level == "error" else "."),
                           "load the model in float32 (from_pretrained(..., dtype=torch.float32)) and let "
                           "--mixed_precision bf16/fp16 autocast."))
    if not out:
        out.append(Finding("precision", "ok", f"{effect} (asked: {asked or 'the launcher'}: {running})."))
    return out


def check_world_size(f: Flight) -> list[Finding]:
    acc = f.accelerator
    wanted, source = requested_world_size(f.config.expected_world_size)
    if wanted is not None and wanted != acc.num_processes:
        return [Finding("world_size", "error", f"{wanted} processes were asked ({source}), {acc.num_processes} "
                        "are running.", "launch with accel-train launch (see README, 'Choosing hardware').")]
    return [Finding("world_size", "ok", f"{acc.num_processes} process(es), {acc.distributed_type.value}, "
                    f"device {acc.device}" + (f" (asked {wanted} via {source})." if wanted else "."))]


def _loader_batch(loader) -> Optional[int]:
    """Samples per micro-batch this process gets from a prepared loader (None: a batch sampler of its own)."""
    sampler = getattr(loader, "batch_sampler", None)
    size = getattr(sampler, "batch_size", None) or getattr(loader, "batch_size", None)
    if size is None:
        return None
    split = getattr(sampler, "split_batches", False)
    return size // getattr(sampler, "num_processes", 1) if split else size


def check_batch(f: Flight) -> list[Finding]:
    cfg, plan, n = f.config, f.plan, f.accelerator.num_processes
    gas, per_device = cfg.gradient_accumulation_steps, _loader_batch(f.train_loader)
    formula = f"{cfg.per_device_train_batch_size} per device x {n} process(es) x {gas} accumulation"
    if per_device is not None and per_device != cfg.per_device_train_batch_size:
        return [Finding("global_batch", "error", f"the training loader yields micro-batches of {per_device} "
                        f"samples, --per_device_train_batch_size is {cfg.per_device_train_batch_size}: the global "
                        f"batch ({plan.global_batch_size} = {formula}), the plan and the resume position are computed "
                        "from the flag.", "build the loader with make_loader(dataset, config, train=True) or "
                        "batch_size=config.per_device_train_batch_size.")]
    note = "" if per_device is not None else " (the loader's own batch sampler: its size was not checked)"
    return [Finding("global_batch", "ok", f"global batch {plan.global_batch_size} = {formula}{note}.")]


def check_steps(f: Flight) -> list[Finding]:
    cfg, plan, n = f.config, f.plan, f.accelerator.num_processes
    gas, total = cfg.gradient_accumulation_steps, plan.total_steps
    out = [Finding("steps", "ok", f"{plan.steps_per_epoch} optimizer step(s) per epoch = {plan.batches_per_epoch} "
                   f"micro-batches per process (after sharding over {n}) / {gas} accumulation; {total} in total "
                   f"over {plan.num_epochs} epoch(s).")]
    if gas > plan.batches_per_epoch:
        out.append(Finding("steps", "warning", f"--gradient_accumulation_steps {gas} exceeds the "
                           f"{plan.batches_per_epoch} micro-batches each process gets per epoch: every step averages "
                           f"only {plan.batches_per_epoch}, not the {gas} the global batch counts.",
                           "lower --gradient_accumulation_steps or the batch size, or use more data."))
    for name, strategy, every in (("logging", cfg.logging_strategy, cfg.logging_steps),
                                  ("evaluation", cfg.eval_strategy if f.eval_loader is not None else "no",
                                   cfg.eval_steps or cfg.logging_steps),
                                  ("checkpoint", cfg.save_strategy, cfg.save_steps)):
        if strategy == "steps" and every > total:
            out.append(Finding("intervals", "warning", f"{name} every {every} steps, but the run has {total}: none "
                               "happens before the end.", f"lower the {name} interval or use the epoch strategy."))
    return out


def _base(obj):
    """The object Accelerate wrapped (optimizer, scheduler), or the object itself."""
    for attr in ("scheduler", "optimizer"):
        inner = getattr(obj, attr, None)
        if inner is not None and type(obj).__name__.startswith("Accelerated"):
            return inner
    return obj


def check_optimizer(f: Flight) -> list[Finding]:
    optimizer = _base(f.optimizer)
    if not f.local or not isinstance(optimizer, torch.optim.Optimizer):
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


def _order(sampler) -> str:
    from torch.utils.data import RandomSampler, SequentialSampler, SubsetRandomSampler, WeightedRandomSampler
    from torch.utils.data.distributed import DistributedSampler

    if isinstance(sampler, (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)):
        return "shuffled"
    if isinstance(sampler, DistributedSampler):
        return "shuffled" if sampler.shuffle else "sequential"
    if isinstance(sampler, SequentialSampler):
        return "sequential"
    if type(sampler).__name__ == "LengthGroupedSampler":
        return "shuffled"
    return "unknown"


def check_loaders(f: Flight) -> list[Finding]:
    from accelerate.data_loader import get_sampler

    out = []
    train = get_sampler(f.train_loader)
    order = _order(train)
    if order == "sequential" and not f.config.overfit_batches:
        out.append(Finding("train_order", "warning", "the training loader is not shuffled: every epoch sees the "
                           "samples in the same order (a dataset sorted by label trains on one class at a time).",
                           "DataLoader(..., shuffle=True) or make_loader(dataset, config, train=True); ignore this "
                           "only if the data is shuffled already or the order is a curriculum."))
    else:
        out.append(Finding("train_order", "ok", f"training order: {order} ({type(train).__name__})."))
    if train is not None and order != "sequential" and not hasattr(train, "set_epoch"):
        out.append(Finding("seedable_sampler", "warning", f"the training sampler ({type(train).__name__}) has no "
                           "set_epoch(): its order cannot be replayed, so a resumed run sees other batches than an "
                           "uninterrupted one.", "build the Accelerator with build_accelerator(config) (seedable "
                           "sampler) or give the sampler set_epoch(epoch) and seed it from (seed, epoch)."))
    elif train is not None:
        out.append(Finding("seedable_sampler", "ok", f"the training order is replayable ({type(train).__name__})."))
    if f.eval_loader is not None:
        evaluation = get_sampler(f.eval_loader)
        if _order(evaluation) == "shuffled":
            out.append(Finding("eval_order", "warning", "the evaluation loader is shuffled: predictions come in "
                               "another order each time and cannot be matched to samples or compared across runs.",
                               "DataLoader(..., shuffle=False) or make_loader(dataset, config, train=False)."))
        if getattr(f.eval_loader, "drop_last", False) or getattr(getattr(f.eval_loader, "batch_sampler", None), "drop_last", False):
            out.append(Finding("eval_order", "warning", "the evaluation loader drops its last incomplete batch: "
                               "those samples are never evaluated.", "DataLoader(..., drop_last=False)."))
        if not [x for x in out if x.check == "eval_order"]:
            out.append(Finding("eval_order", "ok", f"evaluation order: {_order(evaluation)}, every sample evaluated."))
    return out


def simulate_schedule(scheduler, total_steps: int, steps_per_call: int = 1) -> Optional[list[list[float]]]:
    """The learning rate of each param group after k optimizer steps, k = 0..total_steps (k = 0: the first
    step's; k: what the loop logs at step k, and what step k + 1 uses), from a copy of `scheduler` whose
    optimizer holds stand-ins for the parameters (no copy of the model or its optimizer state). None for a
    schedule that steps on metrics (ReduceLROnPlateau) or that an engine owns (DeepSpeed)."""
    inner = _base(scheduler)
    optimizer = getattr(inner, "optimizer", None)
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(inner, torch.optim.lr_scheduler.ReduceLROnPlateau):
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
        for _ in range(total_steps):
            for _ in range(steps_per_call):
                shadow.step()
            for i, group in enumerate(groups):
                lrs[i].append(float(group["lr"]))
    return lrs


def check_schedule(f: Flight) -> list[Finding]:
    cfg, plan, total = f.config, f.plan, f.plan.total_steps
    # Accelerate's default steps a prepared scheduler once per process unless split_batches is set.
    per_call = (f.accelerator.num_processes if getattr(f.scheduler, "step_with_optimizer", False)
                and not getattr(f.scheduler, "split_batches", False) else 1)
    lrs = simulate_schedule(f.scheduler, total, per_call)
    if lrs is None:
        return [Finding("schedule", "ok", f"not simulated: {type(_base(f.scheduler)).__name__} steps on metrics or "
                        "belongs to the engine.")]
    stride = max(1, math.ceil(total / 2000))
    keep = sorted(set(range(0, total + 1, stride)) | {total})
    f.schedule = {"steps": keep, "lr": [[g[k] for k in keep] for g in lrs],
                  "warmup_steps": plan.warmup_steps, "total_steps": total}
    # curve[k]: the rate optimizer step k + 1 trains with, for the group with the highest peak
    curve = lrs[max(range(len(lrs)), key=lambda i: max(lrs[i][:total]))][:total]
    peak = max(curve)
    if peak <= 0:
        return [Finding("schedule", "error", "the learning rate is 0 at every step.", "set --learning_rate > 0.")]
    live = [k for k, lr in enumerate(curve) if lr > 1e-9 * peak]
    end = live[-1] + 1 if live else 0
    peak_step = next(k for k, lr in enumerate(curve) if lr >= peak * (1 - 1e-6))
    out = []
    if end < total and total - end > max(1, 0.02 * total):
        cause = (f" The Accelerator steps the prepared scheduler {per_call} times per optimizer step "
                 "(step_scheduler_with_optimizer=True)." if per_call > 1 else "")
        out.append(Finding("schedule", "error", f"the learning rate reaches 0 after step {end} of {total}: the last "
                           f"{total - end} steps ({(total - end) / total:.0%}) train nothing.{cause}",
                           f"build the schedule for {total} optimizer steps (after sharding and accumulation), or let "
                           "accel_train build it (pass no scheduler)" + (", and build the Accelerator with "
                           "build_accelerator(config)." if per_call > 1 else ".")))
    elif cfg.lr_scheduler_type in DECAY_TO_ZERO and not cfg.lr_scheduler_kwargs and curve[-1] > 0.1 * peak:
        out.append(Finding("schedule", "warning", f"--lr_scheduler_type {cfg.lr_scheduler_type} should end near 0, "
                           f"but the last step still has {curve[-1] / peak:.0%} of the peak: the schedule was built "
                           "for more steps than the run has, or is another schedule.",
                           f"build the schedule for {total} optimizer steps, or set --lr_scheduler_type to what it is."))
    if abs(peak_step - plan.warmup_steps) > max(1, 0.05 * plan.warmup_steps):
        out.append(Finding("schedule", "warning", f"the learning rate reaches its peak after {peak_step} step(s), "
                           f"but the warmup is {plan.warmup_steps} step(s).", "build the schedule with the config's warmup "
                           f"({plan.warmup_steps} steps), or set --warmup_steps to what it is."))
    if not math.isclose(peak, cfg.learning_rate, rel_tol=1e-6):
        out.append(Finding("schedule", "warning", f"the schedule peaks at {peak:.3g}, --learning_rate is "
                           f"{cfg.learning_rate:g}.", "build the optimizer with lr=config.learning_rate, or set "
                           "--learning_rate to the value used."))
    if not out:
        out.append(Finding("schedule", "ok", f"{type(_base(f.scheduler)).__name__} simulated over {total} steps: "
                           f"peak {peak:.3g} after {peak_step} warmup step(s), {curve[-1]:.3g} at the last step."))
    return out


def _label_width(f: Flight, batch: dict) -> tuple[Optional[int], str]:
    """The number of classes the model scores: the logits' last dimension from one evaluation-mode forward with
    the labels set to 0 (an out-of-range label would crash it, on a GPU with a device-side assert), else the
    model's config.num_labels."""
    bare = f.accelerator.unwrap_model(f.model)
    if f.local:
        safe = {**batch, "labels": torch.zeros_like(batch["labels"])}
        was_training = bare.training
        bare.eval()
        try:
            with torch.no_grad(), f.accelerator.autocast():
                out = f.loss_fn(bare, send_to_device(safe, f.accelerator.device))
        finally:
            bare.train(was_training)
        logits = out.get("logits") if isinstance(out, Mapping) else None
        if isinstance(logits, torch.Tensor) and logits.ndim >= 2:
            return int(logits.shape[-1]), "the logits"
    num_labels = getattr(getattr(bare, "config", None), "num_labels", None)
    if num_labels and batch["labels"].ndim == 1:
        return int(num_labels), "config.num_labels"
    return None, ""


def _column_labels(loader) -> Optional[torch.Tensor]:
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


def check_labels(f: Flight) -> list[Finding]:
    from .diagnostics import fetch_batch

    loader = f.train_loader
    size = min(_loader_batch(loader) or 1, len(loader.dataset))
    batch = fetch_batch(loader, list(range(size)))  # the first samples: no sampler, no random number drawn
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point():
        return [Finding("labels", "ok", "not checked: the batch has no integer 'labels' (regression, or not a mapping).")]
    width, source = _label_width(f, batch)
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


CHECKS = (check_world_size, check_precision, check_batch, check_steps, check_schedule, check_optimizer, check_loaders,
          check_labels)
