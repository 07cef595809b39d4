"""The meters behind the training log: loss, throughput, data wait, MFU and peak memory between two log events.
Reductions run on every rank; nothing here writes a file of the run (a CPU peak proven stale leaves the peak cache:
peak.forget_peak)."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from accelerate import Accelerator

from .peak import REMEASURE, device_peak, forget_peak, precision_of_matmuls


class StepMeter:
    """Training loss, throughput and data-wait time between two log events.

    Losses are summed on the device and reduced across processes only when a record is made, so the loop does
    not synchronise with the device at every step. The logged loss is the mean of the micro-batches' means, or,
    for a sum loss, Σ sums / Σ items over the interval and all processes (then "num_items" is logged too; under
    --max_tokens_per_batch a mean loss of a step of several micro-batches counts as the sum over its examples,
    loss.weigh_by_examples, so its logged loss is the mean over the interval's examples).
    Scalars a loss function returns under "log" ({"itc_loss": ..., "itm_weight": ...}; the same names on every
    process) are averaged over the interval's micro-batches and all processes, and recorded beside the loss.
    """

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self.flops = FlopCount(accelerator)
        self.held: float | None = None  # when the evaluation or checkpoint in progress began (hold / release)
        self.reset()

    def reset(self) -> None:
        self.loss_sum: torch.Tensor | None = None
        self.items: torch.Tensor | None = None  # a sum loss's items in the interval
        self.terms: dict[str, torch.Tensor] = {}  # the loss function's "log" scalars, summed
        self.micro_batches = 0
        self.dropped = 0  # steps whose update was dropped (their losses left the interval: rescue.drop_window)
        self.samples = 0
        self.tokens = 0
        self.data_wait = 0.0
        self.paused = 0.0  # evaluation and checkpoint time inside the interval: not training throughput
        self.carried = 0.0  # training seconds of the interval spent before the checkpoint it resumed from
        self.started = time.perf_counter()

    def hold(self) -> None:
        """From now until release(): evaluating and saving, not training time; what pending() saves meanwhile leaves
        it out too (a checkpoint written after its step's evaluation carried that evaluation's seconds)."""
        self.held = time.perf_counter()

    def release(self) -> None:
        if self.held is not None:
            self.paused += time.perf_counter() - self.held
            self.held = None

    def running(self) -> float:
        """The interval's training seconds so far (its pauses excluded, one in progress too)."""
        now = time.perf_counter()
        held = now - self.held if self.held is not None else 0.0
        return max(now - self.started - self.paused - held, 0.0) + self.carried

    def pending(self) -> dict[str, Any]:
        """This process's loss figures of the interval not logged yet, saved with a checkpoint (TrainState.pending_loss)
        so that a resumed run logs that interval, and its train_loss, as the uninterrupted run does."""
        return {"loss_sum": None if self.loss_sum is None else float(self.loss_sum),
                "items": None if self.items is None else float(self.items), "micro_batches": self.micro_batches,
                "terms": {name: float(value) for name, value in self.terms.items()}, "seconds": self.running(),
                "dropped": self.dropped}

    def resume_interval(self, saved: list[dict[str, Any]], clock: bool = True) -> None:
        """Start the interval a checkpoint left unlogged: `saved` holds each rank's `pending()` (empty: a fresh
        interval). On another world size the main process takes the whole of it: the sums stay, their rounding not.
        `clock`: its training seconds go on in train_seconds (a resume; a rollback's clock kept them already)."""
        self.reset()
        acc = self.accelerator
        mine = [saved[acc.process_index]] if len(saved) == acc.num_processes else saved if acc.is_main_process else []
        self.carried = max([part.get("seconds", 0.0) for part in mine] or [0.0]) if clock else 0.0
        self.dropped = max([part.get("dropped", 0) for part in saved] or [0])  # the same on every rank: agreed
        for part in mine:
            if part["loss_sum"] is not None:
                value = torch.tensor(part["loss_sum"], dtype=torch.float32, device=acc.device)
                self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
            if part["items"] is not None:
                value = torch.tensor(part["items"], dtype=torch.float64, device=acc.device)  # counts: exact
                self.items = value if self.items is None else self.items + value
            for name, number in part["terms"].items():
                value = torch.tensor(number, dtype=torch.float32, device=acc.device)
                self.terms[name] = self.terms[name] + value if name in self.terms else value
            self.micro_batches += part["micro_batches"]

    def add_micro_batch(self, out: Mapping[str, Any], samples: int, tokens, waited: float) -> None:
        """`out`: the loss function's output (as_loss_output): its "loss" and optional "log" scalars."""
        loss = (out["objective"] if "items" in out else out["loss"]).detach().float()
        self.loss_sum = loss if self.loss_sum is None else self.loss_sum + loss
        if "items" in out:
            self.items = out["items"] if self.items is None else self.items + out["items"]
        for name, value in (out.get("log") or {}).items():
            value = torch.as_tensor(value).detach().float().reshape(())
            self.terms[name] = self.terms[name] + value if name in self.terms else value
        self.micro_batches += 1
        self.samples += samples
        self.tokens += tokens
        self.data_wait += waited

    def record(self, state: Any = None) -> dict[str, float]:
        """Reduce across processes and return the interval's numbers (collective). With the loop's TrainState, also
        "train_seconds": the run's training seconds up to this record, evaluations and checkpoint writes excluded
        (kept in the state, so a resumed run goes on counting: time to a target quality, as MLPerf measures it)."""
        elapsed = max(time.perf_counter() - self.started - self.paused, 1e-9)  # this session's: its throughput
        acc = self.accelerator
        names = sorted(self.terms)
        sums = [0.0 if self.loss_sum is None else self.loss_sum, *(self.terms[n] for n in names)]
        counts = [self.micro_batches, self.samples, float(self.tokens), -1.0 if self.items is None else self.items]
        local = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=acc.device).reshape(())
                             for v in (*sums, *counts)])
        total = (acc.reduce(local, reduction="sum") if acc.num_processes > 1 else local).tolist()
        micro, samples, tokens, items = total[-4:]
        if self.items is not None:  # a sum loss: token-weighted over the interval and every process
            loss = total[0] / items if items > 0 else math.nan
        else:
            loss = total[0] / micro if micro else math.nan
        record = {"loss": loss}
        if samples:  # an interval that fed nothing (a resumed run with no step left) has no throughput, not 0
            record.update(samples_per_second=samples / elapsed, data_wait_fraction=self.data_wait / elapsed)
        record.update({name: value / micro for name, value in zip(names, total[1:-4], strict=True)} if micro else {})
        if self.items is not None:
            record["num_items"] = items
        if tokens:
            record["tokens_per_second"] = tokens / elapsed
        devices = max(acc.num_processes, 1)
        flops = self.flops.model_flops(samples / elapsed / devices, tokens / elapsed / devices)  # per device
        if flops is not None and self.flops.peak and samples:
            record["model_tflops"] = flops / 1e12
            if self.flops.within_peak(flops):
                record["mfu"] = flops / self.flops.peak
        record.update(peak_memory(acc.device))
        if state is not None:
            state.train_seconds += elapsed + self.carried
            record["train_seconds"] = round(state.train_seconds, 3)
        self.reset()
        return record


class FlopCount:
    """Counts the model FLOPs of one training micro-batch (forward + backward) with torch's FlopCounterMode, once:
    per token position when the batch has an attention mask (text: batches differ in length, and length grouping
    puts the longest first), else per sample (images). The model FLOP/s in the log is the FLOPs per position x the
    *real* (non-pad) tokens per second — padding is not model work — or per sample x samples/s; the MFU is that over
    the device's peak (`device_peak`: a GPU's datasheet, or this machine's measured matmul peak in the precision in
    effect, CPUs included; none known, no MFU). For a transformer the count is 6 x parameters per token plus
    attention: 3 x the forward when every weight trains. Model FLOPs, not hardware FLOPs (PaLM's MFU): the forward
    that activation checkpointing recomputes during backward is not counted (`model_flop_formulas`), so
    --gradient_checkpointing does not raise the MFU by the work it adds. A model FLOP/s above the peak proves the
    peak wrong (`within_peak`): from then on the run logs no MFU, and publishes none."""

    def __init__(self, accelerator: Accelerator):
        self.peak, self.peak_source = device_peak(accelerator)
        self.device, self.precision = accelerator.device, precision_of_matmuls(accelerator)
        self.stale: str | None = None  # why this run publishes no MFU: its model ran faster than the peak
        self._unsaid = False  # `stale` not yet written by `say_stale`
        self.per_sample: float | None = None
        self.per_token: float | None = None
        self._pending = self.peak is not None
        self._mode = None
        self._samples = 0
        self._tokens: Any = 0

    def measure(self, batch_samples: int, batch_positions: int = 0):
        """A context for the next micro-batch (its sample count, and its token positions, padding included: B x L);
        it counts only the first time."""
        if not self._pending:
            return contextlib.nullcontext()
        from torch.utils.flop_counter import FlopCounterMode

        self._pending, self._samples, self._tokens = False, batch_samples, batch_positions
        self._mode = FlopCounterMode(display=False, custom_mapping=model_flop_formulas())
        stack = contextlib.ExitStack()
        # A compiled model runs this micro-batch uncompiled: dynamo meeting a dispatch mode (the counter) marks every
        # frame it meets as never to compile again, so --torch_compile would have trained eagerly from here on (the
        # graphs compiled before, in the pre-flight check, were all it ever ran). No-op for a model not compiled.
        # torch.compiler.set_stance is torch >= 2.6; before it, a compiled model still meets the counter. Nothing is
        # compiled while dynamo is not imported (torch.compile imports it), and importing it costs every run a second.
        if hasattr(torch.compiler, "set_stance") and "torch._dynamo" in sys.modules:
            stack.enter_context(torch.compiler.set_stance("force_eager"))
        stack.enter_context(self._mode)
        return stack

    def counts(self) -> dict[str, float | None]:
        """The counted FLOPs per sample and per token position ({} before the count), for the train state."""
        self.model_flops(0.0)
        return {} if self.per_sample is None else {"per_sample": self.per_sample, "per_token": self.per_token}

    def restore(self, counts: dict[str, float | None]) -> None:
        """Take the counts of the run being resumed instead of counting a micro-batch again (which would change
        that step's numerics: counting dispatches attention differently, and the resumed run must be bitwise)."""
        if counts and self.peak is not None:
            self.per_sample, self.per_token, self._pending = counts["per_sample"], counts["per_token"], False

    def mfu(self, samples_per_second: float, tokens_per_second: float = 0.0) -> float | None:
        flops = self.model_flops(samples_per_second, tokens_per_second)
        return flops / self.peak if flops is not None and self.peak and self.within_peak(flops) else None

    def within_peak(self, flops: float) -> bool:
        """Whether an MFU may be published at `flops` model FLOP/s: not above the peak, and no interval of this run
        was (an MFU above 1 is impossible: the peak is what is wrong, and the MFU of every interval used it). A
        CPU's stale peak leaves the cache, so that the next run measures it afresh."""
        if self.stale is None and self.peak and flops > self.peak:
            self.stale = stale_peak_message(self, flops)
            self._unsaid = True
            if self.device.type == "cpu":
                forget_peak(self.device, self.precision, self.peak)
        return self.stale is None

    def say_stale(self, write: Callable[[str], None]) -> None:
        """Write why this run publishes no MFU, once, after an interval proved the peak stale."""
        if self._unsaid:
            write(self.stale)
            self._unsaid = False

    def model_flops(self, samples_per_second: float, tokens_per_second: float = 0.0) -> float | None:
        """Model FLOP/s at this throughput (per device), or None before the count."""
        if self._mode is not None and self.per_sample is None and self._samples:
            total = self._mode.get_total_flops()
            self.per_sample = total / self._samples
            tokens = float(self._tokens)
            self.per_token = total / tokens if tokens else None
        if self.per_token and tokens_per_second:
            return self.per_token * tokens_per_second
        return self.per_sample * samples_per_second if self.per_sample else None


def stale_peak_message(flops: FlopCount, model_flops: float) -> str:
    ran = (f"peak stale: the model ran at {model_flops / 1e12:.3g} TFLOP/s, which is above the "
           f"{flops.peak / 1e12:.3g} TFLOP/s")
    if flops.device.type != "cpu":
        return (f"{ran} dense {flops.precision} datasheet peak of this {flops.device.type} device in "
                "accel_train.core.peak.PEAK_TFLOPS: that entry is wrong for this device, so no MFU is published for "
                "this run (nor in all_results.json).")
    return (f"{ran} {flops.precision} matmul peak its MFU is measured against: that peak was timed while other work "
            "loaded the cores, so no MFU is published for this run (nor in all_results.json; the intervals logged "
            "before used the same peak). It is removed from the cache: the next run measures it afresh; "
            f"{REMEASURE}=1 re-measures it on purpose, on an idle machine.")


def model_flop_formulas() -> dict[Any, Any]:
    """torch's FLOP formulas, each counting nothing for an op that a checkpointed forward recomputes: an op run inside
    a backward pass (an autograd graph task) with grad mode on. A backward op proper runs with grad mode off (the
    loop's backward builds no graph); the recomputation, non-reentrant (what --gradient_checkpointing asks for) or
    reentrant (a model's own checkpointing may be), runs with it on to rebuild the graph it differentiates. Without
    this the count is the hardware FLOPs, +33% for a fully checkpointed model."""
    from torch.utils.flop_counter import flop_registry

    def model_only(formula):
        def count(*args, out_val=None, **kwargs):
            # torch._C._current_graph_task_id: -1 outside a backward pass (what torch.utils.checkpoint itself reads)
            if torch.is_grad_enabled() and torch._C._current_graph_task_id() != -1:
                return 0
            return formula(*args, out_val=out_val, **kwargs)

        count._get_raw = True  # FlopCounterMode passes the tensors as they are, as to its own registry's formulas
        return count

    return {op: model_only(formula) for op, formula in flop_registry.items()}


def peak_memory(device: torch.device) -> dict[str, float]:
    """Peak memory so far: allocated on the GPU, or the process's peak resident set on a CPU.

    On Linux the CPU peak is VmHWM, which `reset_cpu_peak_memory()` lowers to the current use, so that several
    runs in one process (a benchmark) each get their own peak; elsewhere, the process's lifetime peak."""
    if device.type == "cuda":
        return {"gpu_peak_memory_mb": round(torch.cuda.max_memory_allocated(device) / 2**20, 1)}
    try:
        with open("/proc/self/status") as status:
            kb = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"cpu_peak_rss_mb": round(kb / 1024, 1)}


def reset_cpu_peak_memory() -> bool:
    """Lower the process's peak resident set (VmHWM) to its current use (Linux); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False
