"""Weights & Biases, for real and offline: --report_to wandb with WANDB_MODE=offline writes the run's transaction log
(what `wandb sync` would upload) into output_dir/wandb, read back through W&B's own reader (`wandb leet inspect`):
the same metric names, steps and values as metrics.jsonl, the resolved config once, the run finished, and on two
processes one run, from the main process only."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, read_jsonl, subprocess_env, toy_process

pytest.importorskip("wandb", reason="the test extra installs wandb (pip install -e '.[test]')")

OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}


def inspect(run_dir, *flags) -> list[dict]:
    """`wandb leet inspect --json`: W&B's reader of a .wandb transaction log; one JSON document per record."""
    env = subprocess_env(**OFFLINE)
    env.pop("WANDB_DIR", None)
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", *flags, str(run_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "--summary" in flags:
        return [json.loads(proc.stdout)]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


@pytest.mark.slow
def test_wandb_offline_logs_the_run_of_the_main_process_into_the_run_dir(tmp_path):
    out = tmp_path / "run"
    proc = toy_process(["--output_dir", str(out), "--disable_tqdm", "--run_report", "false", "--num_train_epochs", "2",
                        "--logging_steps", "3", "--learning_rate", "5e-05", "--report_to", "wandb",
                        "--per_device_train_batch_size", "4"], processes=2, env=OFFLINE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, f"one run, from the main process: {runs}"
    records = inspect(runs[0])
    history = [r["history"] for r in records if r["type"] == "history"]
    logged = read_jsonl(out / "metrics.jsonl")
    for name in ("loss", "learning_rate", "eval_loss", "eval_accuracy"):
        expected = [(r["step"], r[name]) for r in logged if isinstance(r.get(name), (int, float))]
        got = [(h["step"]["num"], h["item"][name]) for h in history if name in h["item"]]
        assert expected and got == [(step, pytest.approx(value, rel=1e-6)) for step, value in expected], name
    configs = [r["config"]["update"] for r in records
               if r["type"] == "config" and "learning_rate" in r["config"]["update"]]
    assert len(configs) == 1, "the hyperparameters are logged once"
    assert configs[0]["learning_rate"] == 5e-05 and configs[0]["hidden"] == 32, "the recipe's arguments too"
    summary = inspect(runs[0], "--summary")[0]
    final = json.loads((out / "all_results.json").read_text())
    assert summary["state"] == "finished" and summary["exit_code"] == 0
    assert summary["summary"]["eval_accuracy"] == pytest.approx(final["eval_accuracy"], rel=1e-6)
    assert summary["summary"]["eval_loss"] == pytest.approx(final["eval_loss"], rel=1e-6)
