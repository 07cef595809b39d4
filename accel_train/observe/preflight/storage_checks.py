"""The disk-space check: the checkpoints this run will keep at once, and its final model, against the free space
of the output directory's file system, before the first step. A run that cannot write its checkpoints finds out
at its first save (the previous checkpoints stay, rundir/checkpoint.py), hours in; this finds out before any.

The estimate, from the prepared objects (no optimizer step has run, so no optimizer state exists yet):
* the model's state (parameters and buffers, in their dtypes: model.safetensors),
* the optimizer's state: per trainable element, the state tensors its class keeps (AdamW: exp_avg and exp_avg_sq;
  SGD with momentum: one buffer; an optimizer it does not know: two, and it says so), in float32,
* the weight average's copy (--ema_decay),
and the most checkpoints on disk at once: every save of the run when --save_total_limit is unset; otherwise the
limit plus the one being written (rotation runs after a save lands) plus the best one, kept outside the limit. The
checkpoints already in the output directory count against that peak when they rotate out. Main process only: it
writes the checkpoint's shared files; a rank's own part (sharded state on node-local disks) is not counted apart.
Measured on one process (0.17 % under a real checkpoint); under FSDP2 the parameters' global sizes are counted, under
ZeRO the partitioned sizes (ds_numel) and the inner optimizer's state: not measured against a sharded checkpoint.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import torch

from ...rundir.checkpoint import parameter_numel
from .findings import Finding

# state tensors per trainable element, by optimizer class name (what torch's optimizers keep after their first step)
STATE_PER_ELEMENT = {"AdamW": 2, "Adam": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adagrad": 1, "Adadelta": 2,
                     "RMSprop": 1, "Rprop": 2, "ASGD": 2, "Muon": 1, "Adafactor": 0, "LBFGS": 2}
UNKNOWN_STATE = 2
HEADROOM = 1.05  # file headers, the manifest, scheduler and random states: measured under 1 % on toy_train
GiB = 1024**3


def _optimizers(optimizer) -> list:
    """The torch optimizers behind a prepared one (Accelerate wraps it, DeepSpeed's ZeRO wraps it again; a composite
    may hold several)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if type(inner).__name__.startswith("DeepSpeedZeroOptimizer"):
        inner = inner.optimizer
    parts = getattr(inner, "optimizers", None)
    return list(parts) if parts else [inner]


def _state_factor(optimizer) -> tuple[int, bool]:
    """(state tensors per element, known) for one torch optimizer, from its class and its groups' settings."""
    name, groups = type(optimizer).__name__, optimizer.param_groups
    if name == "SGD":  # a momentum buffer, only with momentum
        return int(any(g.get("momentum", 0) for g in groups)), True
    if name not in STATE_PER_ELEMENT:
        return UNKNOWN_STATE, False
    factor = STATE_PER_ELEMENT[name]
    if name in ("Adam", "AdamW") and any(g.get("amsgrad") for g in groups):
        factor += 1
    if name == "RMSprop":
        factor += int(any(g.get("momentum", 0) for g in groups)) + int(any(g.get("centered") for g in groups))
    return factor, True


def optimizer_state_bytes(optimizer) -> tuple[int, list[str]]:
    """Bytes of float32 state the optimizer will keep, and the classes it had to assume for."""
    total, assumed = 0, []
    for part in _optimizers(optimizer):
        factor, known = _state_factor(part)
        if not known:
            assumed.append(type(part).__name__)
        elements = sum(parameter_numel(p) for g in part.param_groups for p in g["params"] if p.requires_grad)
        total += factor * elements * 4
    return total, assumed


def checkpoint_estimate(model: torch.nn.Module, optimizer, average) -> dict[str, int]:
    tensors = [*model.parameters(), *model.buffers()]
    weights = sum(parameter_numel(t) * t.element_size() for t in tensors)
    state, assumed = optimizer_state_bytes(optimizer)
    ema = sum(t.numel() * t.element_size() for t in average.average.values()) if average is not None else 0
    return {"weights": weights, "optimizer": state, "ema": ema, "assumed": assumed}


def saves_planned(config, plan) -> int:
    if config.save_strategy == "steps":
        return plan.total_steps // config.save_steps
    if config.save_strategy == "epoch":
        return plan.num_epochs or 1
    return 0


def peak_checkpoints(config, planned: int) -> int:
    if config.save_total_limit is None:
        return planned
    best = 1 if config.best_metric_name else 0
    return min(planned, config.save_total_limit + 1 + best)


def _existing_bytes(output_dir: Path) -> int:
    root = output_dir / "checkpoints"
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.is_dir() else 0


def _free_bytes(path: Path) -> tuple[int, Path]:
    """Free bytes of the file system `path` will be on (its nearest existing parent)."""
    path = path.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free, path


def _gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 1024**2:.1f} MiB"


def _kept_words(config, planned: int, peak: int) -> str:
    if planned == 0 and config.save_strategy == "no":
        return "no checkpoints (--save_strategy no)"
    if config.save_total_limit is None:
        return f"all {planned} (--save_total_limit unset)"
    best = ", the best" if config.best_metric_name else ""
    return f"{peak} at once (--save_total_limit {config.save_total_limit}, the one being written{best})"


def check_disk(f) -> list[Finding]:
    if not f.accelerator.is_main_process:
        return []
    config = f.config
    out = Path(config.output_dir)
    sizes = checkpoint_estimate(f.accelerator.unwrap_model(f.model), f.optimizer, f.average)
    one = math.ceil((sizes["weights"] + sizes["optimizer"] + sizes["ema"]) * HEADROOM)
    planned = saves_planned(config, f.plan)
    peak = peak_checkpoints(config, planned)
    existing = _existing_bytes(out)
    # existing checkpoints count toward the limit and rotate out as new ones land; without a limit they stay
    needed = max(0, peak * one - existing) if config.save_total_limit is not None else planned * one
    needed += sizes["weights"]  # the final model at the top of the output directory
    free, where = _free_bytes(out)
    parts = f"weights {_gib(sizes['weights'])}, optimizer state {_gib(sizes['optimizer'])}" + (
        f", weight average {_gib(sizes['ema'])}" if sizes["ema"] else "")
    kept = _kept_words(config, planned, peak)
    facts = (f"checkpoints of about {_gib(one)} each ({parts}), {kept}, and the final model: about {_gib(needed)} "
             f"needed, {_gib(free)} free on {where}.")
    assumed = (f" The state of {', '.join(sizes['assumed'])} is assumed to be {UNKNOWN_STATE} float32 tensors per "
               "parameter element.") if sizes["assumed"] else ""
    if needed > free:
        return [Finding("disk", "error", f"the output directory's disk is too small for this run: {facts}{assumed}",
                        "free space there, keep fewer checkpoints (--save_total_limit N), save less often "
                        "(--save_steps, --save_strategy), or give --output_dir on a larger disk.")]
    return [Finding("disk", "ok", facts + assumed)]
