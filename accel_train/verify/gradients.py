"""The direction of step 1's gradient, compared between two variants: what the accumulation and world-size checks judge
beside the loss and the gradient's norm. Two gradients of equal norm can point elsewhere (examples paired with other
targets, a weighting per micro-batch or per process that keeps the total): only the whole vector tells.

Each variant runs with ACCEL_TRAIN_RECORD_GRADIENT=1 (observe/gradient_record.py): its main process saves the gradient
the optimizer is given at step 1 (accumulated, all-reduced, before clipping) in diagnostics/gradient_step1.safetensors.
Over all parameters at once (float64 sums): the relative L2 difference ||g_a - g_b|| / ||g_b|| (b: the side taken as
the reference, one batch or one process) and the cosine. A parameter with a gradient on one side only counts as zero
on the other (and is named).
"""

from __future__ import annotations

import math
from pathlib import Path

from safetensors import safe_open

from ..observe.gradient_record import VARIABLE, gradient_file

RECORD_ENV = {VARIABLE: "1"}  # what the compared variants' environment gets


def read_gradient(run_dir: Path) -> tuple[dict | None, str | None]:
    """(the recorded gradient by parameter name, None) or (None, why there is none)."""
    path = gradient_file(run_dir)
    if not path.is_file():
        return None, (f"no {path.relative_to(Path(run_dir).parent)}: the run did not reach an optimizer step, or the "
                      "script does not train with accel_train.train()")
    with safe_open(str(path), "pt") as handle:
        skipped = (handle.metadata() or {}).get("skipped")
        if skipped:
            return None, f"{path.parent.parent.name}: {skipped}"
        return {name: handle.get_tensor(name) for name in handle.keys()}, None


def gradient_direction(a: Path, b: Path) -> dict:
    """Step 1's gradients of runs `a` and `b`: {"gradient_relative", "gradient_cosine", "gradient_values",
    "gradient_only_one_side"}, or {"gradient_not_compared": why} when either run has none or the shapes differ."""
    grads_a, why_a = read_gradient(a)
    grads_b, why_b = read_gradient(b)
    if grads_a is None or grads_b is None:
        return {"gradient_not_compared": why_a or why_b}
    differ = [name for name in set(grads_a) & set(grads_b) if grads_a[name].shape != grads_b[name].shape]
    if differ:
        return {"gradient_not_compared": f"parameter shapes differ between the runs ({', '.join(sorted(differ)[:3])})"}
    difference = norm_a = norm_b = dot = 0.0
    for name in set(grads_a) | set(grads_b):
        ga, gb = grads_a.get(name), grads_b.get(name)
        ga = ga.double() if ga is not None else gb.double() * 0
        gb = gb.double() if gb is not None else ga * 0
        difference += float((ga - gb).square().sum())
        norm_a += float(ga.square().sum())
        norm_b += float(gb.square().sum())
        dot += float((ga * gb).sum())
    relative = math.sqrt(difference) / math.sqrt(norm_b) if norm_b > 0 else (0.0 if difference == 0 else math.inf)
    cosine = dot / math.sqrt(norm_a * norm_b) if norm_a > 0 and norm_b > 0 else (1.0 if difference == 0 else 0.0)
    return {"gradient_relative": relative, "gradient_cosine": cosine,
            "gradient_values": sum(t.numel() for t in grads_b.values()),
            "gradient_only_one_side": sorted(set(grads_a) ^ set(grads_b))}
