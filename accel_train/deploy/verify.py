"""Verification: load the written artifact back and compare it with the trained model on held-out inputs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import ExportError
from .formats import Inputs, load_artifact
from .inputs import shape_text
from .targets import ExportTarget


def verify_artifact(fmt: str, path: Path, target: ExportTarget, checks: Sequence[tuple[str, Inputs]],
                    tolerance: float) -> dict[str, Any]:
    """{"verified": bool, "checks": [{inputs, shapes, max_abs_diff}], "max_abs_diff": worst}. Raises ExportError
    when an output's shape differs or the difference is above `tolerance` (or not finite)."""
    run = load_artifact(fmt, path, target.input_names)
    if run is None:
        return {"verified": False, "checks": [], "max_abs_diff": None,
                "note": "onnxruntime is not installed: checked with onnx.checker only (pip install onnxruntime)"}
    results = []
    with torch.no_grad():
        for description, inputs in checks:
            expected = target.module(*inputs)
            got = run(inputs)
            diff = _max_diff(fmt, path, target, description, inputs, expected, got)
            results.append({"inputs": description, "shapes": shape_text(inputs), "max_abs_diff": diff})
    bad = next((r for r in results if not r["max_abs_diff"] <= tolerance), None)  # NaN fails too
    if bad is not None:
        raise ExportError(
            f"--format {fmt}: {path.name} ({target.model_class}) differs from the trained model by "
            f"{bad['max_abs_diff']:.3g} on {bad['inputs']} ({bad['shapes']}), above the tolerance {tolerance:g}. "
            "Checks: "
            + "; ".join(f"{r['inputs']}: {r['max_abs_diff']:.3g}" for r in results)
            + ". A large difference on other shapes only means the graph froze the example's shapes; a small one "
              "everywhere is rounding (raise --tolerance)."
        )
    return {"verified": True, "checks": results, "max_abs_diff": max(r["max_abs_diff"] for r in results)}


def _max_diff(fmt: str, path: Path, target: ExportTarget, description: str, inputs: Inputs, expected: Any,
              got: list[torch.Tensor]) -> float:
    expected = [expected] if isinstance(expected, torch.Tensor) else list(expected)
    if len(got) != len(expected):
        raise ExportError(f"--format {fmt}: {path.name} returns {len(got)} outputs, the model {len(expected)} "
                          f"({target.output_names}) on {description}.")
    worst = 0.0
    for name, e, g in zip(target.output_names, expected, got, strict=True):
        if tuple(g.shape) != tuple(e.shape):
            raise ExportError(
                f"--format {fmt}: {path.name} output {name!r} has shape {list(g.shape)} where the trained model "
                f"gives {list(e.shape)} on {description} ({shape_text(inputs)}): the artifact froze the example's "
                "shapes. Use --format exported_program, or make the model's code shape-independent.")
        diff = (g.float() - e.float()).abs().max().item() if e.numel() else 0.0
        worst = diff if math.isnan(diff) else max(worst, diff)
    return worst
