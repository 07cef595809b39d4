"""The pre-flight's disk-space check (observe/preflight/storage_checks.py): its estimate against the checkpoints a
run then writes, a refusal with the figures that writes nothing, and the peak that --save_total_limit sets. All
in-process, a 1.05M-parameter MLP (so the fixed files, random states and manifest, are under 1 % of a
checkpoint)."""

import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from test_preflight import fly

from accel_train import ConfigError, TrainConfig
from accel_train.observe.preflight import storage_checks
from accel_train.observe.preflight.storage_checks import (
    HEADROOM,
    checkpoint_estimate,
    optimizer_state_bytes,
    peak_checkpoints,
)

Usage = namedtuple("Usage", "total used free")


def wide():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1024),
                               torch.nn.Tanh(), torch.nn.Linear(1024, 2))


def size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def disk_finding(findings):
    (finding,) = [f for f in findings if f["check"] == "disk"]
    return finding


def test_the_estimate_holds_each_checkpoint_and_the_run_fits(tmp_path):
    """16 steps, a checkpoint every 4, a weight average: 4 checkpoints kept (no limit)."""
    model = wide()
    findings = fly(tmp_path / "run", model=model, save_strategy="steps", save_steps=4, ema_decay=0.9)
    finding = disk_finding(findings)
    assert finding["level"] == "ok" and "all 4 (--save_total_limit unset)" in finding["message"]
    checkpoints = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert len(checkpoints) == 4
    optimizer = torch.optim.AdamW(model.parameters())
    estimate = checkpoint_estimate(model, optimizer, None)
    ema = estimate["weights"]  # the average of every floating-point tensor: the weights' size again
    written = [size(c) for c in checkpoints]
    raw = estimate["weights"] + estimate["optimizer"] + ema
    # the estimate (with its headroom) holds each checkpoint, and is within 1 % of it without the headroom
    assert all(raw * 0.99 <= w <= raw * HEADROOM for w in written), (written, raw)


def test_a_disk_too_small_refuses_the_start_with_the_figures_and_writes_nothing(tmp_path, monkeypatch):
    real = shutil.disk_usage
    free = 30 * 1024**2  # 30 MiB: one checkpoint is about 12.6 MiB, four of them do not fit, two do
    monkeypatch.setattr(storage_checks.shutil, "disk_usage", lambda p: Usage(*real(p)[:2], free))
    with pytest.raises(ConfigError, match="disk is too small") as err:
        fly(tmp_path / "full", model=wide(), save_strategy="steps", save_steps=4)
    message = str(err.value)
    assert "all 4 (--save_total_limit unset)" in message and "30.0 MiB free" in message
    assert "--save_total_limit" in message.split("Fix:")[1]
    assert not (tmp_path / "full").exists() or list((tmp_path / "full").iterdir()) == []
    # keeping one (2 on disk while the next is written, 25 MiB with the final model) fits
    findings = fly(tmp_path / "kept", model=wide(), save_strategy="steps", save_steps=4, save_total_limit=1)
    assert "2 at once (--save_total_limit 1, the one being written)" in disk_finding(findings)["message"]
    assert len(list((tmp_path / "kept" / "checkpoints").glob("step-*"))) == 1


def test_what_the_peak_and_the_optimizer_state_count():
    config = TrainConfig(output_dir="x", save_total_limit=2)
    assert peak_checkpoints(config, 10) == 3 and peak_checkpoints(config, 2) == 2
    best = TrainConfig(output_dir="x", save_total_limit=2, load_best_model_at_end=True, eval_strategy="epoch",
                       save_strategy="epoch")
    assert peak_checkpoints(best, 10) == 4  # the best one is kept beside the newest two
    params = [torch.nn.Parameter(torch.zeros(10))]
    assert optimizer_state_bytes(torch.optim.AdamW(params)) == (80, [])
    assert optimizer_state_bytes(torch.optim.AdamW(params, amsgrad=True)) == (120, [])
    assert optimizer_state_bytes(torch.optim.SGD(params, lr=0.1)) == (0, [])
    assert optimizer_state_bytes(torch.optim.SGD(params, lr=0.1, momentum=0.9)) == (40, [])

    class Lion(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 1e-4})

    assert optimizer_state_bytes(Lion(params)) == (80, ["Lion"])  # assumed, and said


def test_a_run_without_checkpoints_needs_room_for_its_final_model_only(tmp_path):
    findings = fly(tmp_path / "plain", model=wide())  # fly's default: --save_strategy no
    message = disk_finding(findings)["message"]
    assert "no checkpoints (--save_strategy no)" in message
    weights = checkpoint_estimate(wide(), torch.optim.AdamW(wide().parameters()), None)["weights"]
    assert f"about {weights / 1024**2:.1f} MiB needed" in message
