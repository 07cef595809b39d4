"""Every installed tracker, for real and offline, read back through its own reader: TensorBoard's event files,
MLflow's client on the run's own SQLite store (output_dir/mlflow.db), W&B's transaction log (WANDB_MODE=offline, in
output_dir/wandb; what `wandb sync` would upload) through `wandb leet inspect`, and trackio's local SQLite store
(TRACKIO_DIR) through its storage API: the same metric names, steps and values as metrics.jsonl, the resolved config
once (the recipe's own arguments too), and one run, from the main process.

One 2-process run on the session's spawned gloo ranks (conftest's `ranks`) logs to all of them at once; MLflow's
second run in the same process runs here. Trackers are chosen by name (the others refused with the fix)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import toy_train
from conftest import read_jsonl, reset_accelerate, toy_main

from accel_train import ConfigError, TrainConfig, run_cli

TRACKERS = ("tensorboard", "mlflow", "wandb", "trackio")
INSTALLED = [name for name in TRACKERS if importlib.util.find_spec(name)]
OFFLINE = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
QUIET = ["--disable_tqdm", "--run_report", "false", "--num_train_epochs", "2", "--logging_steps", "3"]
LOGGED = ("loss", "learning_rate", "eval_loss", "eval_accuracy")
SUMMARY = ("train_loss", "train_runtime", "train_samples_per_second", "train_mfu")  # all_results.json's, at the end


def summary_of(out: Path) -> dict[str, float]:
    """The run's summary every tracker must hold, as all_results.json has it (logged once, at the last step)."""
    final = json.loads((out / "all_results.json").read_text())
    assert all(isinstance(final.get(name), float) for name in SUMMARY), final
    return {name: final[name] for name in SUMMARY}


def needs(name: str):
    reason = f"the test extra installs {name} (pip install -e '.[test]')"
    return pytest.mark.skipif(name not in INSTALLED, reason=reason)


def train_on_rank(argv: list[str]) -> None:
    """One rank of the tracked run (conftest's Ranks calls it on each): MLflow's own store whatever the environment
    says (a set MLFLOW_TRACKING_URI is the user's choice, which the run would follow)."""
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    toy_main(argv)


def read_trackio(names: list[str], into: str) -> None:
    """trackio's storage API on the ranks that logged, rank 0 writing what it read to `into`. trackio reads
    TRACKIO_DIR once, when imported: a rank that imported it for another store would read that one, so say so."""
    from trackio import SQLiteStorage, utils

    assert Path(utils.TRACKIO_DIR) == Path(os.environ["TRACKIO_DIR"]), "trackio was imported for another store"
    if os.environ["RANK"] != "0":
        return
    runs = SQLiteStorage.get_runs("accel_train")
    out = {"runs": runs, "config": SQLiteStorage.get_run_config("accel_train", runs[0]), "metrics": {}}
    for name in names:
        out["metrics"][name] = [(v["step"], v["value"]) for v in SQLiteStorage.get_metric_values("accel_train",
                                                                                                 runs[0], name)]
    Path(into).write_text(json.dumps(out, default=str))


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, ranks):
    """toy_train on 2 processes with --report_to every installed tracker (W&B offline, trackio into its own store),
    and trackio's record read back on the same ranks."""
    root = tmp_path_factory.mktemp("trackers")
    out, store = root / "run", root / "trackio"
    env = {**OFFLINE, "TRACKIO_DIR": str(store)}
    ranks.run(train_on_rank, ["--output_dir", str(out), *QUIET, "--learning_rate", "5e-05",
                              "--per_device_train_batch_size", "4", "--report_to", *INSTALLED], env=env)
    if "trackio" in INSTALLED:
        ranks.run(read_trackio, [*LOGGED, *SUMMARY], str(root / "trackio.json"), env=env)
    return out


def expected(out: Path, name: str) -> list[tuple[int, float]]:
    """(step, value) of every logged `name` in metrics.jsonl, which must hold some."""
    found = [(r["step"], r[name]) for r in read_jsonl(out / "metrics.jsonl") if isinstance(r.get(name), (int, float))]
    assert found, name
    return found


def approx(pairs):
    return [(step, pytest.approx(value, rel=1e-6)) for step, value in pairs]


# ------------------------------------------------------------------------------------------------ TensorBoard


@needs("tensorboard")
def test_tensorboard_gets_the_logged_numbers_offline(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = sorted((tracked / "runs").rglob("events.out.tfevents.*"), key=lambda path: len(path.parts))
    assert len({path.name.rsplit(".", 2)[1] for path in files}) == 1, f"one process wrote them: {files}"  # ...<pid>.<n>
    events = EventAccumulator(str(files[0].parent))  # the scalars; a sub-folder holds the hyperparameters
    events.Reload()
    for name in LOGGED:
        assert [(e.step, e.value) for e in events.Scalars(name)] == approx(expected(tracked, name)), name
    last = max(step for step, _ in expected(tracked, "loss"))
    for name, value in summary_of(tracked).items():
        assert [(e.step, e.value) for e in events.Scalars(name)] == approx([(last, value)]), name


@needs("tensorboard")
def test_a_resumed_run_leaves_tensorboard_one_timeline(tmp_path):
    """TensorBoard reads every event file of the run's folder: the steps an interrupted attempt logged after the
    checkpoint a run resumes from stayed beside the resumed run's own (loss at steps 5-8 twice), where metrics.jsonl
    drops them. The resumed run hides them (purge_step): one value per step, the resumed run's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    flags = ["--output_dir", str(out), "--disable_tqdm", "--run_report", "false", "--report_to", "tensorboard",
             "--max_steps", "8", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "4",
             "--eval_strategy", "no"]
    reset_accelerate()
    run_cli(toy_train.main, flags)
    reset_accelerate()
    run_cli(toy_train.main, [*flags, "--resume_from_checkpoint", str(out / "checkpoints" / "step-00000004")])
    folder = sorted((out / "runs").rglob("events.out.tfevents.*"), key=lambda path: len(path.parts))[0].parent
    events = EventAccumulator(str(folder))
    events.Reload()
    steps = [e.step for e in events.Scalars("loss")]
    assert steps == list(range(1, 9)), steps
    assert [(e.step, e.value) for e in events.Scalars("loss")] == approx(expected(out, "loss"))


# ------------------------------------------------------------------------------------------------ MLflow


def mlflow_runs(out):
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{(out / 'mlflow.db').resolve()}")
    experiments = client.search_experiments()
    return client, [run for exp in experiments for run in client.search_runs([exp.experiment_id])]


def assert_same_as_the_log(out):
    client, runs = mlflow_runs(out)
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    for name in LOGGED:
        history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
        assert history == approx(expected(out, name)), name
    assert run.data.params["learning_rate"] == "5e-05" and run.data.params["num_train_epochs"] == "2.0"
    assert run.data.params["hidden"] == "32", "the recipe's own arguments are in the config too"
    for name, value in summary_of(out).items():  # the summary, as the Trainer gives it: metrics.train_loss, ...
        assert run.data.metrics[name] == pytest.approx(value, rel=1e-6), name


@pytest.mark.slow  # MLflow's SQLite store starts a process of its own
@needs("mlflow")
def test_mlflow_logs_the_run_into_its_own_sqlite_store(tmp_path, monkeypatch, capsys):
    """Two runs in this process (what is tested: the second gets its own store)."""
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
    # a run that fails ends its MLflow run as FAILED (left open, MLflow's exit handler marked it FINISHED, and the
    # next run in this process could not start its own: "Run ... is already active")
    reset_accelerate()
    with pytest.raises(SystemExit) as failed:
        run_cli(toy_train.main, ["--output_dir", str(tmp_path / "failed"), *QUIET, "--report_to", "mlflow",
                                 "--poison_index", "13"])
    assert failed.value.code == 2
    client, runs = mlflow_runs(tmp_path / "failed")
    assert [r.info.status for r in runs] == ["FAILED"]
    reset_accelerate()
    run_cli(toy_train.main, ["--output_dir", str(tmp_path / "after"), *QUIET, "--report_to", "mlflow",
                             "--learning_rate", "5e-05"])
    assert_same_as_the_log(tmp_path / "after")


@needs("mlflow")
def test_on_two_processes_only_the_main_process_logs(tracked):
    assert_same_as_the_log(tracked)


# ------------------------------------------------------------------------------------------------ W&B


def inspect(capfd, monkeypatch, run_dir, *flags) -> list[dict]:
    """`wandb leet inspect --json` (the `wandb` command, here): W&B's reader of a .wandb transaction log, one JSON
    document per record. It runs W&B's core binary, whose output is read from this process's stdout."""
    from wandb.cli.cli import cli

    for name, value in {**OFFLINE, "WANDB_ERROR_REPORTING": "false"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_DIR", raising=False)
    capfd.readouterr()
    with pytest.raises(SystemExit) as done:
        cli.main(["leet", "inspect", "--json", *flags, str(run_dir)], prog_name="wandb", standalone_mode=False)
    printed = capfd.readouterr()
    assert done.value.code == 0, printed.err[-3000:]
    if "--summary" in flags:
        return [json.loads(printed.out)]
    return [json.loads(line) for line in printed.out.splitlines() if line.strip()]


@needs("wandb")
@pytest.mark.slow
def test_wandb_offline_logs_the_run_of_the_main_process_into_the_run_dir(tracked, capfd, monkeypatch):
    """The reader runs W&B's core binary: a process of its own."""
    runs = sorted((tracked / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, f"one run, from the main process: {runs}"
    records = inspect(capfd, monkeypatch, runs[0])
    history = [r["history"] for r in records if r["type"] == "history"]
    for name in LOGGED:
        got = [(h["step"]["num"], h["item"][name]) for h in history if name in h["item"]]
        assert got == approx(expected(tracked, name)), name
    configs = [r["config"]["update"] for r in records
               if r["type"] == "config" and "learning_rate" in r["config"]["update"]]
    assert len(configs) == 1, "the hyperparameters are logged once"
    assert configs[0]["learning_rate"] == 5e-05 and configs[0]["hidden"] == 32, "the recipe's arguments too"
    summary = inspect(capfd, monkeypatch, runs[0], "--summary")[0]
    final = json.loads((tracked / "all_results.json").read_text())
    assert summary["state"] == "finished" and summary["exit_code"] == 0
    assert summary["summary"]["eval_accuracy"] == pytest.approx(final["eval_accuracy"], rel=1e-6)
    assert summary["summary"]["eval_loss"] == pytest.approx(final["eval_loss"], rel=1e-6)
    for name, value in summary_of(tracked).items():
        assert summary["summary"][name] == pytest.approx(value, rel=1e-6), name


# ------------------------------------------------------------------------------------------------ trackio


@needs("trackio")
def test_trackio_logs_the_run_into_its_local_store(tracked):
    logged = json.loads((tracked.parent / "trackio.json").read_text())
    assert len(logged["runs"]) == 1, "one run, from the main process"
    for name in LOGGED:
        assert [tuple(v) for v in logged["metrics"][name]] == approx(expected(tracked, name)), name
    assert logged["config"]["learning_rate"] == 5e-05 and logged["config"]["hidden"] == 32
    for name, value in summary_of(tracked).items():
        assert [v for _, v in logged["metrics"][name]] == [pytest.approx(value, rel=1e-6)], name


# ------------------------------------------------------------------------------------------------ by name


def test_trackers_are_chosen_by_name():
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS
    from accelerate.utils import imports

    from accel_train.core.accelerator import KNOWN_TRACKERS, resolve_trackers

    for name in KNOWN_TRACKERS:  # every name accel_train accepts is an Accelerate tracker with an install check
        assert name in LOGGER_TYPE_TO_CLASS and hasattr(imports, f"is_{name}_available")
    assert resolve_trackers(TrainConfig(report_to=["tensorboard"])) == ["tensorboard"]
    assert resolve_trackers(TrainConfig(report_to=["none"])) == []
    with pytest.raises(ConfigError, match="--report_to neptune: unknown tracker; choose from tensorboard, wandb"):
        resolve_trackers(TrainConfig(report_to=["neptune"]))
    missing = [n for n in KNOWN_TRACKERS if not getattr(imports, f"is_{n}_available")()]
    for name in missing:  # installed ones would be accepted; the others say how to get them
        with pytest.raises(ConfigError, match=f"the '{name}' package is not installed \\(pip install {name}\\)"):
            resolve_trackers(TrainConfig(report_to=[name]))
