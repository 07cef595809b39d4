"""Step guard and diagnosis: non-finite losses and gradients, and preemption (SIGTERM).

`StepGuard` watches every micro-batch's loss on the device (no host sync) and, once per optimizer step,
turns "any non-finite loss in this window, a non-finite gradient norm, a SIGTERM received" into one small
tensor, reduced across processes, read with one sync. Every rank therefore takes the same decision at the
same step. `locate_nonfinite` re-runs a batch with hooks to name the first module whose output or gradient
went non-finite.
"""

from __future__ import annotations

import json
import math
import os
import signal
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device


@dataclass
class Verdict:
    nonfinite_loss: bool = False
    nonfinite_grad: bool = False
    preempt: bool = False
    bad_micro_batches: list[int] = field(default_factory=list)  # positions in the window, this rank

    @property
    def nonfinite(self) -> bool:
        return self.nonfinite_loss or self.nonfinite_grad


class StepGuard:
    """Non-finite detection and SIGTERM agreement, one device sync per optimizer step."""

    def __init__(self, accelerator: Accelerator, check_gradients: bool):
        self.accelerator = accelerator
        # Under fp16 the loss scaler owns non-finite gradients: it skips those steps and lowers the scale.
        self.check_gradients = check_gradients
        self.window: list[torch.Tensor] = []
        self.sigterm = False
        self._previous_handler = None

    def __enter__(self):
        try:
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: no preemption handling
            self._previous_handler = None
        return self

    def __exit__(self, *exc):
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
        return False

    def _on_sigterm(self, signum, frame) -> None:
        self.sigterm = True

    def watch(self, loss: torch.Tensor) -> None:
        self.window.append(torch.isfinite(loss.detach().float()).all())

    def verdict(self, grad_norm: Optional[torch.Tensor]) -> Verdict:
        finite = torch.stack(self.window) if self.window else torch.ones(1, dtype=torch.bool)
        self.window = []
        device = self.accelerator.device
        grad_bad = torch.zeros((), device=device)
        if self.check_gradients and isinstance(grad_norm, torch.Tensor):
            grad_bad = (~torch.isfinite(grad_norm.detach().float())).float().to(device)
        flags = torch.stack([(~finite).any().float().to(device), grad_bad,
                             torch.tensor(float(self.sigterm), device=device)])
        if self.accelerator.num_processes > 1:
            flags = self.accelerator.reduce(flags, reduction="sum")
        loss_bad, grad_bad_any, preempt = (v > 0 for v in flags.tolist())  # the step's one host sync
        bad = [i for i, ok in enumerate(finite.tolist()) if not ok] if loss_bad else []
        return Verdict(loss_bad, grad_bad_any, preempt, bad)


def fault_point(name: str, step: int, main_process: bool) -> None:
    """Test seam for the kill tests: ACCEL_TRAIN_FAULT=<name>:<step> SIGKILLs the main process there.
    Points: kill_after_step (an optimizer step done, nothing logged or saved yet) and kill_during_save
    (Accelerate has written the checkpoint files, the manifest that completes it has not been)."""
    fault = os.environ.get("ACCEL_TRAIN_FAULT")
    if fault and fault == f"{name}:{step}" and main_process:
        os.kill(os.getpid(), signal.SIGKILL)


def micro_batch_indices(loader, batch_index: int) -> Optional[list[int]]:
    """Dataset indices of this process's micro-batch number `batch_index` of the current epoch (the prepared
    loader's batch sampler replays the epoch's order, seeded by the epoch)."""
    sampler = getattr(loader, "batch_sampler", None)
    if sampler is None:
        return None
    for i, indices in enumerate(sampler):
        if i == batch_index:
            return [int(j) for j in indices]
    return None


def _nonfinite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_floating_point() and not bool(torch.isfinite(value).all())
    if isinstance(value, (list, tuple)):
        return any(_nonfinite(v) for v in value)
    if isinstance(value, dict):
        return any(_nonfinite(v) for v in value.values())
    if hasattr(value, "to_tuple"):  # transformers ModelOutput
        return any(_nonfinite(v) for v in value.to_tuple())
    return False


def locate_nonfinite(accelerator: Accelerator, model: torch.nn.Module, batch: Any, loss_fn: Callable) -> dict:
    """Re-run `batch` forward and backward on the bare model with hooks on every module; report the first
    module (in execution order) whose output, and the first whose gradient, is non-finite. Runs locally on
    this rank (no collectives), leaves no gradients behind."""
    from .metrics import as_loss_output

    bare = accelerator.unwrap_model(model)
    names = {module: name or type(bare).__name__ for name, module in bare.named_modules()}
    found: dict[str, Optional[str]] = {"forward": None, "backward": None}

    def forward_hook(module, inputs, output):
        if found["forward"] is None and _nonfinite(output):
            found["forward"] = f"{names[module]} ({type(module).__name__})"

    def backward_hook(module, grad_input, grad_output):
        if found["backward"] is None and (_nonfinite(grad_output) or _nonfinite(grad_input)):
            found["backward"] = f"{names[module]} ({type(module).__name__})"

    handles = [m.register_forward_hook(forward_hook) for m in bare.modules()]
    handles += [m.register_full_backward_hook(backward_hook) for m in bare.modules() if not list(m.children())]
    report: dict[str, Any] = {}
    try:
        with accelerator.autocast():
            loss = as_loss_output(loss_fn(bare, send_to_device(batch, accelerator.device)))["loss"]
        report["loss_on_rerun"] = float(loss.detach().float())
        if loss.requires_grad:
            with warnings.catch_warnings():  # inputs that need no gradient are fine here
                warnings.simplefilter("ignore", UserWarning)
                loss.backward()
    except RuntimeError as err:  # e.g. an autograd anomaly; the forward finding still stands
        report["rerun_error"] = str(err)
    finally:
        for handle in handles:
            handle.remove()
        bare.zero_grad(set_to_none=True)
    report["first_nonfinite_output"] = found["forward"]
    report["first_nonfinite_gradient"] = found["backward"]
    report["nonfinite_parameters"] = [n for n, p in bare.named_parameters() if not torch.isfinite(p).all()][:20]
    return report


def fetch_batch(loader, indices: list[int]) -> Any:
    """Rebuild a micro-batch from its dataset indices with the loader's own collate function."""
    return loader.collate_fn([loader.dataset[i] for i in indices])


def write_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=lambda v: None if isinstance(v, float) and math.isnan(v) else str(v)))


# ------------------------------------------------------------------------------------------------------------
# Opt-in diagnostics (--grad_flow_steps, --activation_stats_steps, --profile_steps, --memory_snapshot_step,
# --detect_anomaly). The loop holds `None` when every flag is off, so a normal step pays one `is None` test.

LOCAL_GRADIENTS = ("NO", "MULTI_CPU", "MULTI_GPU")  # where each rank holds whole, already-reduced gradients
VANISHING = 1e-4  # a layer's gradient RMS against the median layer's, at the same step
EXPLODING = 1e2  # a layer's gradient RMS against its own median over the earlier records


def layer_grad_norms(model: torch.nn.Module, scale: float = 1.0) -> tuple[dict[str, Optional[float]], dict[str, int]]:
    """Per layer (each module that owns trainable parameters), the L2 norm of its parameters' gradients divided
    by `scale` (the fp16 loss scale), and its number of trainable values. None: no parameter of the layer got a
    gradient. One device sync for the whole model."""
    norms, sizes, missing = [], {}, []
    for name, module in model.named_modules():
        params = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if not params:
            continue
        name = name or type(model).__name__
        sizes[name] = sum(p.numel() for p in params)
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            missing.append(name)
            continue
        norms.append((name, torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))))
    values = torch.stack([n for _, n in norms]).tolist() if norms else []
    result: dict[str, Optional[float]] = {name: value / scale for (name, _), value in zip(norms, values)}
    result.update({name: None for name in missing})
    return {name: result[name] for name in sizes}, sizes


def flag_layers(norms: dict[str, Optional[float]], sizes: dict[str, int],
                history: Optional[dict[str, list[float]]] = None) -> dict[str, list[str]]:
    """Flag layers by gradient RMS (norm / sqrt(values), so a big embedding is not large for its size alone):
    vanishing below 1e-4 times the median layer's (or exactly 0); exploding when non-finite, or above 100 times
    the layer's own median over the earlier records in `history` ({layer: [RMS, ...]}, extended here) *and* above
    the median layer; and layers that got no gradient at all. Layers differ by orders of magnitude in a healthy
    network (a fine-tuned head against attention projections, which start near zero and grow), so a layer is
    judged against its own past, and growth from below its peers is not an explosion."""
    rms = {n: v / math.sqrt(sizes[n]) for n, v in norms.items() if v is not None}
    usable = sorted(v for v in rms.values() if math.isfinite(v) and v > 0)
    median = usable[len(usable) // 2] if usable else 0.0
    flags: dict[str, list[str]] = {"no_gradient": [n for n, v in norms.items() if v is None],
                                   "vanishing": [], "exploding": []}
    history = {} if history is None else history
    for name, value in rms.items():
        past = sorted(history.get(name, []))
        if not math.isfinite(value) or (past and value > EXPLODING * past[len(past) // 2] and value > median):
            flags["exploding"].append(name)
        elif value == 0 or (median > 0 and value < VANISHING * median):
            flags["vanishing"].append(name)
        if math.isfinite(value):
            history.setdefault(name, []).append(value)
    return flags


def _first_float_tensor(value: Any) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value if value.is_floating_point() else None
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_float_tensor(item)
            if found is not None:
                return found
    return None


class ActivationStats:
    """Forward hooks on every leaf module, installed for one optimizer step at a time: mean, std, largest
    absolute value, share of exact zeros and of non-finite values of each output, averaged over the step's
    micro-batches (largest value: the maximum). Kept on the device until `collect` (one sync)."""

    FIELDS = ("mean", "std", "abs_max", "zero_fraction", "nonfinite_fraction")

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.handles: list = []
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def install(self) -> None:
        for name, module in self.model.named_modules():
            if name and not list(module.children()):
                self.handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name: str):
        def hook(module, inputs, output):
            x = _first_float_tensor(output)
            if x is None or not module.training or x.numel() == 0:  # evaluation forwards are not recorded
                return
            x = x.detach().float()
            finite = torch.isfinite(x)
            clean = torch.where(finite, x, torch.zeros_like(x))
            stats = torch.stack([clean.mean(), clean.std() if x.numel() > 1 else clean.new_zeros(()),
                                 clean.abs().max(), (x == 0).float().mean(), (~finite).float().mean()])
            if name in self.sums:
                previous = self.sums[name]
                self.sums[name] = torch.cat([previous[:2] + stats[:2], torch.maximum(previous[2:3], stats[2:3]),
                                             previous[3:] + stats[3:]])
            else:
                self.sums[name] = stats
            self.counts[name] = self.counts.get(name, 0) + 1
        return hook

    def collect(self) -> dict[str, dict[str, float]]:
        """Remove the hooks; return {module: {statistic: value}} for the step."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        names = list(self.sums)
        rows = torch.stack([self.sums[n] for n in names]).tolist() if names else []
        out = {}
        for name, row in zip(names, rows):
            count = self.counts[name]
            averaged = [row[0] / count, row[1] / count, row[2], row[3] / count, row[4] / count]
            out[name] = dict(zip(self.FIELDS, averaged))
        self.sums, self.counts = {}, {}
        return out


def memory_breakdown(model: torch.nn.Module, optimizer: Any) -> dict[str, float]:
    """MiB held by parameters, gradients, buffers and optimizer state on this process, plus peak and current
    resident memory: the CPU counterpart of a CUDA snapshot (PyTorch keeps no allocation history on CPU)."""
    import resource

    def mib(tensors) -> float:
        return round(sum(t.numel() * t.element_size() for t in tensors) / 2**20, 3)

    params = list(model.parameters())
    inner = getattr(optimizer, "optimizer", optimizer)
    state = [v for s in getattr(inner, "state", {}).values() for v in s.values() if isinstance(v, torch.Tensor)]
    out = {"parameters_mb": mib(params), "gradients_mb": mib(p.grad for p in params if p.grad is not None),
           "buffers_mb": mib(model.buffers()), "optimizer_state_mb": mib(state),
           "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        out["current_rss_mb"] = round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return out


def _profiler_schedule(first: int, last: int, step_offset: int):
    """torch.profiler schedule in optimizer steps: profiler step n is optimizer step n + step_offset."""
    from torch.profiler import ProfilerAction

    def schedule(n: int) -> ProfilerAction:
        step = n + step_offset
        if step == last:
            return ProfilerAction.RECORD_AND_SAVE
        if first <= step < last:
            return ProfilerAction.RECORD
        return ProfilerAction.WARMUP if step == first - 1 else ProfilerAction.NONE

    return schedule
