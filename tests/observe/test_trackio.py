"""Trackio, for real and offline: --report_to trackio logs into trackio's local SQLite store (TRACKIO_DIR), read back
through trackio's own storage API — the same metric names, steps and values as metrics.jsonl, the config once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import ROOT, read_jsonl, subprocess_env, toy_process

pytest.importorskip("trackio", reason="the test extra installs trackio (pip install -e '.[test]')")

# trackio reads TRACKIO_DIR when it is imported: the run and the read-back each run in a process of their own
READ_BACK = """
import json, sys
from trackio import SQLiteStorage
runs = SQLiteStorage.get_runs("accel_train")
out = {"runs": runs, "config": SQLiteStorage.get_run_config("accel_train", runs[0]), "metrics": {}}
for name in sys.argv[1:]:
    values = SQLiteStorage.get_metric_values("accel_train", runs[0], name)
    out["metrics"][name] = [(v["step"], v["value"]) for v in values]
print(json.dumps(out, default=str))
"""


def test_trackio_logs_the_run_into_its_local_store(tmp_path):
    store, out = tmp_path / "trackio", tmp_path / "run"
    env = {"TRACKIO_DIR": str(store)}
    proc = toy_process(["--output_dir", str(out), "--disable_tqdm", "--run_report", "false", "--num_train_epochs", "2",
                        "--logging_steps", "3", "--learning_rate", "5e-05", "--report_to", "trackio"], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = ["loss", "learning_rate", "eval_loss", "eval_accuracy"]
    read = subprocess.run([sys.executable, "-c", READ_BACK, *names], cwd=ROOT, env=subprocess_env(**env),
                          capture_output=True, text=True, timeout=300)
    assert read.returncode == 0, read.stderr[-3000:]
    logged = json.loads(read.stdout.strip().splitlines()[-1])
    assert len(logged["runs"]) == 1
    records = read_jsonl(out / "metrics.jsonl")
    for name in names:
        expected = [(r["step"], r[name]) for r in records if isinstance(r.get(name), (int, float))]
        assert expected and [tuple(v) for v in logged["metrics"][name]] == [
            (step, pytest.approx(value, rel=1e-6)) for step, value in expected], name
    assert logged["config"]["learning_rate"] == 5e-05 and logged["config"]["hidden"] == 32
