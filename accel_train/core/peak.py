"""The peak an MFU is measured against: a GPU's dense datasheet figure, or on a CPU this machine's own matmul speed.

A CPU's peak is the fastest 2048² matmul ever timed on this machine (per device, thread count, torch version and
precision), kept in ~/.cache/accel_train/matmul_peak.json (`ACCEL_TRAIN_CACHE` moves the folder). A timing taken
while other processes load the cores is slow, and a peak that stays too low makes every later MFU too high (on
2026-12-03 a contended 2-thread bf16 entry, 52 GFLOP/s against a real 0.3-0.4 TFLOP/s, gave the main job an MFU of
1.73). So the cached peak is only ever raised: the first run measures it (best of FULL_REPEATS), every later process
re-times the matmul at its start (best of START_REPEATS, about a third of a second) and raises the entry when it is
faster; a model measured faster than the peak proves the entry stale (FlopCount.within_peak: that run publishes no
MFU and the entry leaves the cache); ACCEL_TRAIN_REMEASURE_PEAK=1 replaces the entry with a fresh measurement."""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from ..rundir.checkpoint import parameter_numel

# Dense (no 2:4 sparsity) peak TFLOP/s of the matmuls in each precision, keyed by the exact name
# torch.cuda.get_device_name (and nvidia-smi) reports: a form factor has its own peak (an H100 PCIe or NVL has fewer
# SMs or lower clocks than the SXM part), and a name that is not here (another GPU, a MIG slice, AWS's A10G, which has
# no NVIDIA datasheet) has no peak rather than a neighbour's: the log then has no MFU. Sources: NVIDIA's datasheets,
# whose tensor-core figures are quoted with sparsity (halved here), fp32 being the non-tensor figure: H100
# (SXM 1,979 bf16 / 989 tf32 / 67 fp32 TFLOPS, i.e. the Hopper whitepaper's dense 989.4 / 494.7 / 66.9; PCIe 1,513 /
# 756 / 51; NVL 1,671 / 835 / 60), H200 (SXM as H100 SXM; NVL 1,671 / 835 / 60), A100 (SXM4 and PCIe, 40 and 80 GB
# alike: dense 312 / 156 / 19.5), HGX B200 (per GPU 4.5 PF / 2.2 PF / 75), L40S (dense 362.05 / 183 / 91.6), L40
# (dense 181.05 / 90.5 / 90.5), L4 (242 / 120 / 30.3), A10 (dense 125 / 62.5 / 31.2), V100 (fp16 tensor: SXM2 125,
# PCIe 112, V100S 130; fp32 15.7 / 14 / 16.4; no bf16 or tf32), T4 (fp16 65, fp32 8.1).
_HOPPER_SXM = {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}
_HOPPER_NVL = {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}
_A100 = {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "NVIDIA H100 80GB HBM3": _HOPPER_SXM,  # the SXM5 part
    "NVIDIA H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0},
    "NVIDIA H100 NVL": _HOPPER_NVL,
    "NVIDIA H200": _HOPPER_SXM,  # the SXM part
    "NVIDIA H200 NVL": _HOPPER_NVL,
    "NVIDIA B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0},
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "NVIDIA L40": {"bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5},
    "NVIDIA L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "NVIDIA A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "Tesla V100-SXM2-16GB": {"fp16": 125.0, "fp32": 15.7},
    "Tesla V100-SXM2-32GB": {"fp16": 125.0, "fp32": 15.7},
    "Tesla V100-PCIE-16GB": {"fp16": 112.0, "fp32": 14.0},
    "Tesla V100-PCIE-32GB": {"fp16": 112.0, "fp32": 14.0},
    "Tesla V100S-PCIE-32GB": {"fp16": 130.0, "fp32": 16.4},
    "Tesla T4": {"fp16": 65.0, "fp32": 8.1},
}


def datasheet_tflops(name: str, precision: str) -> float | None:
    """The dense datasheet peak of the GPU called exactly `name` in `precision` (TFLOP/s), None when unknown."""
    return PEAK_TFLOPS.get(name, {}).get(precision)


MATMUL_SIDE = 2048  # the square matmul whose speed is this machine's measured peak
FULL_REPEATS = 5  # timed matmuls (after a warm-up) of a measurement no cache entry holds, or one asked for
START_REPEATS = 2  # timed matmuls (after a warm-up) with which each later process checks the cached entry
REMEASURE = "ACCEL_TRAIN_REMEASURE_PEAK"  # =1: replace the cached entry with a fresh measurement
# The longest one timed matmul may take. A precision the device only emulates (fp16 on most CPUs: 0.34 GFLOP/s here,
# 50 s for one 2048² matmul, so 150 s at every process start) is timed at a smaller side, chosen from one small
# matmul (PROBE_SIDE) first: the timing stays under a second whatever the precision.
MATMUL_SECONDS = 0.25
PROBE_SIDE = 256

# (cache file, key) -> the speed this process timed: the start-up report and the meter ask for the same peak, and
# one timing per process is enough (a second one at the first step would only cost time)
_timed_here: dict[tuple[str, str], float] = {}


def peak_cache() -> Path:
    """The cache file of measured peaks: ~/.cache/accel_train/matmul_peak.json, or in $ACCEL_TRAIN_CACHE."""
    folder = os.environ.get("ACCEL_TRAIN_CACHE") or Path.home() / ".cache" / "accel_train"
    return Path(folder) / "matmul_peak.json"


def precision_of_matmuls(accelerator: Accelerator) -> str:
    """bf16 / fp16 under mixed precision, or where the prepared model's weights are stored so (most of its floating
    parameter elements, frozen ones included: a LoRA adapter on a bf16 base runs the base's matmuls in bf16), else
    tf32 (GPUs with TF32 on) or fp32."""
    if accelerator.mixed_precision in ("bf16", "fp16"):
        return accelerator.mixed_precision
    stored = _stored_precision(getattr(accelerator, "_models", []))  # what accelerator.prepare took
    if stored is not None:
        return stored
    tf32 = accelerator.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    return "tf32" if tf32 else "fp32"


def _stored_precision(models) -> str | None:
    """"bf16" / "fp16" where most floating parameter elements of `models` are stored in it (ZeRO-3's partitions at
    their full size), else None."""
    elements: dict[torch.dtype, int] = {}
    for model in models:
        for parameter in model.parameters():
            if parameter.is_floating_point():
                elements[parameter.dtype] = elements.get(parameter.dtype, 0) + parameter_numel(parameter)
    if not elements:
        return None
    most = max(elements, key=elements.get)
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(most)


def device_peak(accelerator: Accelerator) -> tuple[float | None, str]:
    """The peak the MFU is measured against, in FLOP/s, for the precision the matmuls run in, and what it is (the
    start-up report's line): a GPU's dense datasheet peak (`PEAK_TFLOPS`, by its exact name), a CPU's measured
    matmul peak (`measured_peak`), else None: "peak unknown", and no MFU is logged rather than a wrong one."""
    precision = precision_of_matmuls(accelerator)
    device = accelerator.device
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tflops = datasheet_tflops(name, precision)
        if tflops is None:
            return None, (f"peak unknown: {name} has no dense {precision} datasheet peak in "
                          "accel_train.core.peak.PEAK_TFLOPS, so no MFU is logged")
        return tflops * 1e12, f"{tflops:g} TFLOP/s, the dense {precision} datasheet peak of the {name}"
    if device.type != "cpu":  # mps, xpu, ...: no datasheet here, and a timed matmul there is not a peak
        return None, f"peak unknown: no {precision} peak for {device.type} devices, so no MFU is logged"
    peak = measured_peak(device, precision)
    if peak is None:
        return None, f"peak unknown: this cpu has no {precision} matmul, so no MFU is logged"
    timed = _timed_here.get((str(peak_cache()), peak_key(device, precision)), peak)
    return peak, (f"{peak / 1e12:.3g} TFLOP/s, the measured {precision} matmul peak of this cpu (the fastest "
                  f"{MATMUL_SIDE}² matmul timed on it at {torch.get_num_threads()} thread(s), {timed / 1e12:.3g} at "
                  f"this start; cached in {peak_cache()}, {REMEASURE}=1 measures it afresh)")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_info("model name") or platform.processor() or platform.machine()


def cpu_info(field: str) -> str | None:
    """The value of the first `field` line of /proc/cpuinfo ("model name", "flags"), or None (not Linux, no such
    line)."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith(field)), None)
    except OSError:
        return None


def peak_key(device: torch.device, precision: str) -> str:
    """The cache entry of this machine, device, thread count, torch version and precision."""
    return (f"{device_name(device)} | {device.type} | {torch.get_num_threads()} threads | torch {torch.__version__} | "
            f"{precision}")


def measured_peak(device: torch.device, precision: str, side: int = MATMUL_SIDE) -> float | None:
    """The dense matmul peak of `device` in `precision` (fp32, tf32, bf16, fp16), FLOP/s, at this process's thread
    count: the fastest `side` x `side` matmul ever timed for its cache entry (`peak_key`). Timed once per process:
    best of FULL_REPEATS where the cache has no entry (or $ACCEL_TRAIN_REMEASURE_PEAK=1, which then replaces the
    entry), else best of START_REPEATS, which raises the entry when faster. None where the precision has no matmul
    on the device.

        >>> measured_peak(torch.device("cpu"), "bf16")  # 4.1e11 on this 2-core AMD EPYC (AVX512-BF16), idle
    """
    key, cache = peak_key(device, precision), peak_cache()
    here = (str(cache), key)
    cached = read_peaks(cache).get(key)
    if here in _timed_here:
        return max(cached or 0.0, _timed_here[here])
    remeasure = os.environ.get(REMEASURE, "") not in ("", "0")
    timed = time_matmul(device, precision, side, FULL_REPEATS if cached is None or remeasure else START_REPEATS)
    if timed is None:
        return None
    _timed_here[here] = timed
    return record_peak(cache, key, timed, replace=remeasure)


def time_matmul(device: torch.device, precision: str, side: int, repeats: int) -> float | None:
    """FLOP/s of the fastest of `repeats` timed `side` x `side` matmuls after a warm-up; None where the precision
    has no matmul on the device."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    try:
        probe = _fastest(device, dtype, min(side, PROBE_SIDE), 1)
        side = fitted_side(2 * min(side, PROBE_SIDE) ** 3 / probe, side)
        return 2 * side**3 / _fastest(device, dtype, side, repeats)
    except RuntimeError:  # e.g. fp16 matmuls on a CPU without them
        return None


def fitted_side(rate: float, side: int) -> int:
    """The side (a multiple of 64, at most `side`, at least PROBE_SIDE) whose matmul takes about MATMUL_SECONDS at
    `rate` FLOP/s."""
    fits = int((MATMUL_SECONDS * rate / 2) ** (1 / 3)) // 64 * 64
    return max(min(side, PROBE_SIDE), min(side, fits))


def _fastest(device: torch.device, dtype: torch.dtype, side: int, repeats: int) -> float:
    """Seconds of the fastest of `repeats` timed `side` x `side` matmuls after a warm-up."""
    generator = torch.Generator(device).manual_seed(0)  # never the global one: a run's RNG stream stays its own
    a = torch.randn(side, side, device=device, generator=generator).to(dtype)
    b = torch.randn(side, side, device=device, generator=generator).to(dtype)
    best = math.inf
    for i in range(repeats + 1):
        _sync(device)
        started = time.perf_counter()
        a @ b
        _sync(device)
        if i:  # the first is the warm-up
            best = min(best, time.perf_counter() - started)
    return best


def read_peaks(cache: Path) -> dict[str, float]:
    try:
        peaks = json.loads(cache.read_text())
    except (OSError, ValueError):
        return {}
    return peaks if isinstance(peaks, dict) else {}


def record_peak(cache: Path, key: str, flops: float, replace: bool = False) -> float:
    """Raise `key`'s entry to `flops` (or set it: `replace`) and return the entry. The file is read again just
    before the write (another process may have raised an entry since) and replaced whole (a reader never sees
    half of it); an unwritable cache keeps the peak for this process only."""
    peaks = read_peaks(cache)
    peaks[key] = flops if replace else max(peaks.get(key, 0.0), flops)
    write_peaks(cache, peaks)
    return peaks[key]


def forget_peak(device: torch.device, precision: str, stale: float) -> None:
    """Remove the entry proven too low (`stale`: the peak a run measured its model above), unless another process
    raised it since: the next process measures the peak afresh (best of FULL_REPEATS)."""
    key, cache = peak_key(device, precision), peak_cache()
    _timed_here.pop((str(cache), key), None)
    peaks = read_peaks(cache)
    if key in peaks and peaks[key] <= stale:
        del peaks[key]
        write_peaks(cache, peaks)


def write_peaks(cache: Path, peaks: dict[str, float]) -> None:
    with contextlib.suppress(OSError):
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(peaks, indent=2))
        os.replace(partial, cache)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
