"""The gradient of optimizer step 1 as the optimizer is given it: what `accel-train verify`'s accumulation and
world-size checks compare in direction (a norm alone is blind to gradients paired with other examples).

Opt-in, free when off: with ACCEL_TRAIN_RECORD_GRADIENT=1 in the environment (verify sets it on the variants those
checks compare) train() hands the step loop a `GradientRecorder` as its probe (wrapping the diagnostics probe, if one
is asked). No hook event sees the gradients (hooks run between steps, after zero_grad); the loop's probe seam does:
core/loop.py's optimizer_step calls `probe.before_clip(step)` once the gradients of optimizer step `step` are complete.
There they are accumulated over the window's micro-batches, rescaled by the loss contract (a token sum divided by the
window's items), all-reduced across processes (DDP reduces in the backward of the window's last micro-batch), and
neither clipped nor, under fp16, unscaled yet: the recorder divides by the loss scale, as the optimizer will. It
copies them, so the run computes the same numbers as without it.

The main process writes output_dir/diagnostics/gradient_step1.safetensors once: one float32 tensor per parameter that
got a gradient, under the bare model's parameter names. Under FSDP and DeepSpeed each process holds a shard of the
gradient: the file then holds no tensor and its metadata says why ("skipped").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from ..core.accelerator import holds_whole_model
from ..rundir.layout import DIAGNOSTICS_DIR

VARIABLE = "ACCEL_TRAIN_RECORD_GRADIENT"
GRADIENT_FILE = "gradient_step1.safetensors"
STEP = 1  # the step both sides of a comparison take from the same weights: later steps compound the differences
WHERE = ("optimizer step 1: accumulated, rescaled by the loss contract, all-reduced; before clipping, divided by the "
         "fp16 loss scale")


def gradient_file(output_dir: Path | str) -> Path:
    return Path(output_dir) / DIAGNOSTICS_DIR / GRADIENT_FILE


def record_gradient(session: Any, probe: Any | None) -> Any | None:
    """The loop's probe: a GradientRecorder around `probe` when ACCEL_TRAIN_RECORD_GRADIENT=1, else `probe` itself
    (None when no diagnostics are asked: the loop pays one `is None` test)."""
    if os.environ.get(VARIABLE) != "1":
        return probe
    return GradientRecorder(session.accelerator, session.model, session.config.output_dir, probe)


class GradientRecorder:
    """The probe (module docstring): before_clip(1) saves the gradient; every call goes on to the wrapped probe."""

    def __init__(self, accelerator: Any, model: Any, output_dir: Path | str, inner: Any | None = None):
        self.acc, self.inner = accelerator, inner
        self.model = accelerator.unwrap_model(model)  # the bare model's parameter names
        self.path = gradient_file(output_dir)

    def before_clip(self, step: int) -> None:
        if step == STEP and self.acc.is_main_process:
            self._save()
        if self.inner is not None:
            self.inner.before_clip(step)

    def after_step(self, step: int) -> None:
        if self.inner is not None:
            self.inner.after_step(step)

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not holds_whole_model(self.acc):
            reason = (f"under {self.acc.distributed_type.value} each process holds a shard of the gradient: "
                      "no whole gradient to record")
            save_file({}, str(self.path), metadata={"step": str(STEP), "skipped": reason})
            return
        scaler = self.acc.scaler
        scale = float(scaler.get_scale()) if scaler is not None else 1.0
        tensors = {name: (p.grad.detach().float() / scale).cpu().contiguous()
                   for name, p in self.model.named_parameters() if p.grad is not None}
        save_file(tensors, str(self.path), metadata={"step": str(STEP), "where": WHERE})
