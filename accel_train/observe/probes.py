"""Opt-in diagnostics, free when off: per-layer gradient norms (--grad_flow_steps), activation statistics
(--activation_stats_steps), torch.profiler traces (--profile_steps), memory snapshots (--memory_snapshot_step) and
autograd anomaly detection (--detect_anomaly).

`Diagnostics` is the probe the step loop is given when a diagnostics flag is set (None otherwise, so a normal
step pays one `is None` test): the loop calls `before_clip(step)` once the gradients of optimizer step `step`
are complete and `after_step(step)` once the step is taken.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from ..core.accelerator import holds_whole_model
from ..rundir.layout import DIAGNOSTICS_DIR, PROFILER_DIR
from ..rundir.metrics_log import say, truncate_history

VANISHING = 1e-4  # a layer's gradient RMS against the median layer's, at the same step
EXPLODING = 1e2  # a layer's gradient RMS against its own median over the earlier records


def layer_grad_norms(model: torch.nn.Module, scale: float = 1.0) -> tuple[dict[str, float | None], dict[str, int]]:
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
        per_tensor = torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])
        norms.append((name, torch.linalg.vector_norm(per_tensor)))
    values = torch.stack([n for _, n in norms]).tolist() if norms else []
    result: dict[str, float | None] = {name: value / scale for (name, _), value in zip(norms, values, strict=True)}
    result.update({name: None for name in missing})
    return {name: result[name] for name in sizes}, sizes


def flag_layers(norms: dict[str, float | None], sizes: dict[str, int],
                history: dict[str, list[float]] | None = None) -> dict[str, list[str]]:
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


def _first_float_tensor(value: Any) -> torch.Tensor | None:
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
        for name, row in zip(names, rows, strict=True):
            count = self.counts[name]
            averaged = [row[0] / count, row[1] / count, row[2], row[3] / count, row[4] / count]
            out[name] = dict(zip(self.FIELDS, averaged, strict=True))
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


def profiler_schedule(first: int, last: int, step_offset: int):
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


class Diagnostics:
    """The opt-in diagnostics of one training session, entered around the loop. The loop calls
    `before_clip(step)` once the gradients of optimizer step `step` are complete, and `after_step(step)` once
    the step is taken. Gradient norms and activation statistics are recorded on the main process; every process
    writes its own profiler trace and memory snapshot."""

    def __init__(self, accelerator, config, model, optimizer, initial_step: int):
        self.acc, self.config, self.optimizer = accelerator, config, optimizer
        self.model = accelerator.unwrap_model(model)  # hooks and gradients of the bare model
        self.rank, self.main = accelerator.process_index, accelerator.is_main_process
        self.dir = Path(config.output_dir) / DIAGNOSTICS_DIR
        self.initial_step = initial_step
        self.local = holds_whole_model(accelerator)
        self.activations = ActivationStats(self.model) if config.activation_stats_steps and self.main else None
        self.armed = False
        self.profiler = None
        self.cuda_history = False
        self.anomaly: bool | None = None
        self.warned: set[tuple[str, str]] = set()
        self.grad_history: dict[str, list[float]] = {}  # RMS per layer: explosion is judged against the past

    @staticmethod
    def wanted(config) -> bool:
        return bool(config.grad_flow_steps or config.activation_stats_steps or config.profile_steps
                    or config.memory_snapshot_step or config.detect_anomaly)

    def __enter__(self) -> Diagnostics:
        # Folders are made when first written to: the main process may still be clearing an older run's.
        if self.main and self.initial_step:  # resumed: drop what the interrupted run recorded after its checkpoint
            for name in ("grad_flow.jsonl", "activations.jsonl"):
                truncate_history(self.dir / name, self.initial_step)
        if self.config.detect_anomaly:
            self.anomaly = torch.is_anomaly_enabled()
            torch.autograd.set_detect_anomaly(True)
        if self.config.profile_range and self.config.profile_range[1] > self.initial_step:
            self.profiler = self._profiler(*self.config.profile_range)
            self.profiler.start()
        if self.config.memory_snapshot_step > self.initial_step and self.acc.device.type == "cuda":
            torch.cuda.memory._record_memory_history(max_entries=100_000)
            self.cuda_history = True
        self._arm(self.initial_step + 1)
        if self.config.grad_flow_steps and not self.local and self.main:
            say(f"note: --grad_flow_steps needs whole gradients on each process; under "
                   f"{self.acc.distributed_type.value} they are sharded, so no gradient flow is recorded.")
        return self

    def __exit__(self, *exc) -> bool:
        if self.profiler is not None:
            self.profiler.stop()
        if self.anomaly is not None:
            torch.autograd.set_detect_anomaly(self.anomaly)
        if self.cuda_history:
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.activations is not None:
            self.activations.collect()  # removes the hooks
        return False

    def _due(self, every: int, step: int) -> bool:
        return bool(every) and step % every == 0

    def _arm(self, step: int) -> None:
        if self.activations is not None and self._due(self.config.activation_stats_steps, step):
            self.activations.install()
            self.armed = True

    def before_clip(self, step: int) -> None:
        if self.main and self.local and self._due(self.config.grad_flow_steps, step):
            scaler = self.acc.scaler
            norms, sizes = layer_grad_norms(self.model, scaler.get_scale() if scaler is not None else 1.0)
            flags = flag_layers(norms, sizes, self.grad_history)
            self._append("grad_flow.jsonl", {"step": step, "norms": norms, "sizes": sizes, "flags": flags})
            self._warn(step, "gradient", flags)
        if self.armed:
            stats = self.activations.collect()
            self.armed = False
            flags = {"dead": [n for n, s in stats.items() if s["zero_fraction"] >= 0.99],
                     "nonfinite": [n for n, s in stats.items() if s["nonfinite_fraction"] > 0]}
            self._append("activations.jsonl", {"step": step, "stats": stats, "flags": flags})
            self._warn(step, "activation", flags)

    def after_step(self, step: int) -> None:
        if self.profiler is not None:
            self.profiler.step()
        if step == self.config.memory_snapshot_step:
            self._snapshot(step)
        self._arm(step + 1)

    def _append(self, name: str, record: dict) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / name, "a") as fh:
            fh.write(json.dumps(record, default=lambda v: None) + "\n")

    def _warn(self, step: int, what: str, flags: dict[str, list[str]]) -> None:
        for kind, layers in flags.items():
            new = [n for n in layers if (kind, n) not in self.warned]
            self.warned.update((kind, n) for n in new)
            if new:
                say(f"diagnostics, step {step}: {kind.replace('_', ' ')} {what}s in {len(new)} layer(s): "
                       f"{', '.join(new[:5])}{' ...' if len(new) > 5 else ''} (see report.md)")

    def _profiler(self, first: int, last: int):
        from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

        folder = Path(self.config.output_dir) / PROFILER_DIR
        trace = tensorboard_trace_handler(str(folder), worker_name=f"rank{self.rank}")
        offset = self.initial_step + 1  # profiler step n (ProfilerStep#n in the trace) is optimizer step n + offset

        def ready(prof) -> None:
            trace(prof)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            (folder / f"key_averages_rank{self.rank}.txt").write_text(
                f"optimizer steps {first}-{last}; ProfilerStep#n in the trace is optimizer step n + {offset}\n{table}")

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        return profile(activities=activities, schedule=profiler_schedule(first, last, offset), on_trace_ready=ready,
                       record_shapes=True, profile_memory=True)

    def _snapshot(self, step: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"memory_step{step}_rank{self.rank}"
        record = {"step": step, "rank": self.rank, "device": str(self.acc.device),
                  **memory_breakdown(self.model, self.optimizer)}
        if self.cuda_history:
            torch.cuda.memory._dump_snapshot(str(path.with_suffix(".pickle")))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.cuda_history = False
            record["cuda_snapshot"] = path.with_suffix(".pickle").name
            record["gpu_peak_allocated_mb"] = round(torch.cuda.max_memory_allocated(self.acc.device) / 2**20, 1)
        else:
            record["note"] = ("CPU: PyTorch keeps no allocation history, so this is the breakdown by category and "
                              "the resident memory of the process; --profile_steps records memory per operator.")
        path.with_suffix(".json").write_text(json.dumps(record, indent=2))
        if self.main:
            say(f"memory snapshot at step {step}: {path.with_suffix('.json')}"
                   + (f" and {path.with_suffix('.pickle').name} (open at pytorch.org/memory_viz)" if self.cuda_history
                      or "cuda_snapshot" in record else ""))
