"""The CPU peak an MFU is measured against (core/peak.py): a contended measurement cannot stick, and no MFU above 1
is ever published. Everything runs in this process; the cache lives in tmp_path (ACCEL_TRAIN_CACHE), and where a
test needs a slow or fast machine the matmul timing is faked (peak.time_matmul), never measured against a clock."""

import json

import pytest
import toy_train
from conftest import read_jsonl, reset_accelerate

QUIET = ["--report_to", "none", "--disable_tqdm", "--num_train_epochs", "1", "--logging_steps", "2",
         "--eval_strategy", "no", "--save_strategy", "no", "--per_device_train_batch_size", "8", "--max_steps", "6"]
POISON = 1e3  # FLOP/s: far below the toy model's own FLOP/s (about 1,200 FLOPs per sample, thousands of samples/s)


def use_cache(monkeypatch, folder):
    monkeypatch.setenv("ACCEL_TRAIN_CACHE", str(folder))
    return folder / "matmul_peak.json"


def toy_run(out):
    reset_accelerate()
    toy_train.main(["--output_dir", str(out), *QUIET])
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    return records, json.loads((out / "all_results.json").read_text())


def fake_timing(monkeypatch, flops_per_second):
    """peak.time_matmul answers `flops_per_second` (a fixed machine speed) and records the repeats asked."""
    from accel_train.core import peak

    asked = []

    def timed(device, precision, side, repeats):
        asked.append(repeats)
        return flops_per_second

    monkeypatch.setattr(peak, "time_matmul", timed)
    return asked


def test_a_poisoned_cached_peak_yields_no_mfu_above_one(tmp_path, monkeypatch):
    """The defect of 2026-12-03: a peak measured while other processes loaded the cores (here 1 kFLOP/s) was cached
    for ever and gave every later run an MFU far above 1. A run now re-times a matmul at its start and raises the
    cached peak (real timing: any CPU multiplies faster than 1 kFLOP/s)."""
    first = use_cache(monkeypatch, tmp_path / "first")
    toy_run(tmp_path / "measure")  # a fresh cache: this run measures and caches its peak
    poisoned = {key: POISON for key in json.loads(first.read_text())}
    cache = use_cache(monkeypatch, tmp_path / "machine")  # the same machine's cache, its entries poisoned
    cache.parent.mkdir()
    cache.write_text(json.dumps(poisoned))
    records, results = toy_run(tmp_path / "run")
    assert records and all("mfu" in r and 0 < r["mfu"] < 1 for r in records)
    assert 0 < results["train_mfu"] < 1
    raised = json.loads(cache.read_text())
    assert raised.keys() == poisoned.keys() and all(v > 1e8 for v in raised.values())  # raised to a real speed
    assert results["train_peak_tflops"] == pytest.approx(max(raised.values()) / 1e12)


def test_the_cached_peak_is_only_ever_raised(tmp_path, monkeypatch):
    """The best measurement made on this machine wins: a faster start-up timing raises the cache, a slower one (a
    contended start) leaves it; each process times once (the start-up report and the meter share it)."""
    import torch

    from accel_train.core import peak

    cpu = torch.device("cpu")
    cache = use_cache(monkeypatch, tmp_path / "a")
    asked = fake_timing(monkeypatch, 52.5e9)  # a contended first measurement
    assert peak.measured_peak(cpu, "bf16") == 52.5e9
    assert peak.measured_peak(cpu, "bf16") == 52.5e9 and asked == [peak.FULL_REPEATS]  # timed once per process
    poisoned = cache.read_text()
    for folder, speed, expected in (("b", 166e9, 166e9), ("c", 40e9, 166e9)):  # other processes, the same cache
        use_cache(monkeypatch, tmp_path / folder).parent.mkdir()
        (tmp_path / folder / "matmul_peak.json").write_text(poisoned if folder == "b" else cache.read_text())
        cache = tmp_path / folder / "matmul_peak.json"
        asked = fake_timing(monkeypatch, speed)
        assert peak.measured_peak(cpu, "bf16") == expected
        assert asked == [peak.START_REPEATS]  # a cached peak: the cheap re-timing, not the full measurement
        assert list(json.loads(cache.read_text()).values()) == [expected]


def test_remeasuring_on_purpose_replaces_the_cached_peak(tmp_path, monkeypatch):
    """ACCEL_TRAIN_REMEASURE_PEAK=1: the full measurement replaces the entry, even with a lower speed (a cache
    copied from a faster machine of the same name would otherwise stay)."""
    import torch

    from accel_train.core import peak

    cache = use_cache(monkeypatch, tmp_path)
    key = peak.peak_key(torch.device("cpu"), "fp32")
    cache.write_text(json.dumps({key: 9e11, "another machine | fp32": 5.0}))
    monkeypatch.setenv("ACCEL_TRAIN_REMEASURE_PEAK", "1")
    asked = fake_timing(monkeypatch, 1.4e11)
    assert peak.measured_peak(torch.device("cpu"), "fp32") == 1.4e11
    assert asked == [peak.FULL_REPEATS]
    assert json.loads(cache.read_text()) == {key: 1.4e11, "another machine | fp32": 5.0}


def test_a_model_faster_than_the_peak_publishes_no_mfu(tmp_path, monkeypatch, capsys):
    """Model FLOP/s above the peak proves the peak stale (here every timing is contended: 1 kFLOP/s): no interval
    logs an MFU, all_results.json holds no train_mfu, the log says why and how to re-measure, and the stale entry
    leaves the cache so that the next run measures the peak afresh."""
    cache = use_cache(monkeypatch, tmp_path)
    fake_timing(monkeypatch, POISON)
    records, results = toy_run(tmp_path / "run")
    out = capsys.readouterr().out
    assert records and all("mfu" not in r and r["model_tflops"] * 1e12 > POISON for r in records)
    assert not {"train_mfu", "train_peak_tflops"} & results.keys()
    assert "no MFU is published for this run" in out and "ACCEL_TRAIN_REMEASURE_PEAK=1" in out
    assert out.count("is above the") == 1  # said once, not at every interval
    assert json.loads(cache.read_text()) == {}


def test_an_emulated_precision_is_timed_at_a_side_that_takes_a_fraction_of_a_second(monkeypatch):
    """fp16 matmuls on this CPU run at 0.34 GFLOP/s (emulated): one 2048² matmul takes 50 s, and re-timing it at every
    process start (best of 2 after a warm-up) made an fp16 run on CPU start 150 s late (the suite's fp16 loss-scaler
    test: 0.07 s before, 142 s after). One small matmul first decides the side: a fast precision keeps 2048, an
    emulated one gets the side that takes about MATMUL_SECONDS."""
    import torch

    from accel_train.core import peak

    assert peak.fitted_side(4.1e11, 2048) == 2048  # this CPU's bf16: a 2048² matmul takes 42 ms
    assert peak.fitted_side(3.4e8, 2048) == 320  # its fp16: 320² takes 0.19 s
    assert peak.fitted_side(1.0, 2048) == peak.PROBE_SIDE and peak.fitted_side(3.4e8, 128) == 128
    sides = []
    real = peak.fitted_side
    monkeypatch.setattr(peak, "fitted_side", lambda rate, side: sides.append(real(rate, side)) or sides[-1])
    flops = peak.time_matmul(torch.device("cpu"), "fp16", 2048, 1)
    assert flops is not None and flops > 0
    if flops < 1e10:  # no native fp16 matmul here: the side shrank (a CPU with AMX-FP16 keeps a larger one)
        assert sides[-1] < 2048


def test_a_model_stored_in_bf16_is_measured_against_the_bf16_peak():
    """Under --mixed_precision no, a model whose weights are bf16 (or a LoRA adapter in fp32 on a frozen bf16 base:
    the base's matmuls are bf16) was measured against the fp32 peak: an MFU several times too high, or a correct
    cached fp32 peak thrown out as stale on a machine whose bf16 runs faster. The peak follows where most of the
    prepared model's weights are stored; an fp32 model keeps the fp32 peak."""
    import torch
    from accelerate import Accelerator

    from accel_train.core.peak import precision_of_matmuls

    def prepared(model):
        reset_accelerate()
        accelerator = Accelerator(cpu=True, mixed_precision="no")
        accelerator.prepare(model)
        return accelerator

    assert precision_of_matmuls(prepared(torch.nn.Linear(8, 8).to(torch.bfloat16))) == "bf16"
    base = torch.nn.Sequential(torch.nn.Linear(64, 64).to(torch.bfloat16), torch.nn.Linear(64, 4))  # a small fp32 head
    base[0].requires_grad_(False)
    assert precision_of_matmuls(prepared(base)) == "bf16"
    assert precision_of_matmuls(prepared(torch.nn.Linear(8, 8))) == "fp32"
