"""MLflow, for real and offline: --report_to mlflow logs into the run's own SQLite store (output_dir/mlflow.db), read
back through MLflow's own client — the same metric names, steps and values as metrics.jsonl, the resolved config as
parameters once, and on several processes one run from the main process only."""

from __future__ import annotations

import pytest
from conftest import read_jsonl, reset_accelerate, toy_process

pytest.importorskip("mlflow", reason="the test extra installs mlflow (pip install -e '.[test]')")

import mlflow  # noqa: E402
import toy_train  # noqa: E402

from accel_train import run_cli  # noqa: E402

QUIET = ["--disable_tqdm", "--run_report", "false", "--num_train_epochs", "2", "--logging_steps", "3"]


def logged_runs(out):
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    experiments = client.search_experiments()
    runs = [run for exp in experiments for run in client.search_runs([exp.experiment_id])]
    return client, runs


def assert_same_as_the_log(out):
    client, runs = logged_runs(out)
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    records = read_jsonl(out / "metrics.jsonl")
    for name in ("loss", "learning_rate", "eval_loss", "eval_accuracy"):
        expected = [(r["step"], r[name]) for r in records if isinstance(r.get(name), (int, float))]
        history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
        assert history == [(step, pytest.approx(value, rel=1e-6)) for step, value in expected], name
        assert expected, name
    assert run.data.params["learning_rate"] == "5e-05" and run.data.params["num_train_epochs"] == "2.0"
    assert run.data.params["hidden"] == "32", "the recipe's own arguments are in the config too"


def test_mlflow_logs_the_run_into_its_own_sqlite_store(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "unset-after-the-test")  # mlflow.set_tracking_uri sets it: undo that
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(tmp_path)  # MLflow's own default would be ./mlflow.db: nothing may land here
    out = tmp_path / "run"
    reset_accelerate()
    run_cli(toy_train.main, ["--output_dir", str(out), *QUIET, "--report_to", "mlflow", "tensorboard",
                             "--learning_rate", "5e-05"])
    assert f"mlflow           sqlite:///{(out / 'mlflow.db').resolve()}" in capsys.readouterr().out
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()
    assert_same_as_the_log(out)
    # a second run in the same process gets its own store (set_tracking_uri left the first one in the environment)
    reset_accelerate()
    run_cli(toy_train.main, ["--output_dir", str(tmp_path / "second"), *QUIET, "--report_to", "mlflow",
                             "--learning_rate", "5e-05"])
    assert_same_as_the_log(tmp_path / "second")
    assert_same_as_the_log(out)


@pytest.mark.slow
def test_on_two_processes_only_the_main_process_logs(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    proc = toy_process(["--output_dir", str(out), *QUIET, "--report_to", "mlflow", "--learning_rate", "5e-05",
                        "--per_device_train_batch_size", "4"], processes=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_as_the_log(out)
