"""`accel-train sweep`: trials of a recipe run one after another from an Optuna study in SQLite, each in its own run
directory with its sampled flags; a sweep run again resumes its study; the pruner stops a trial through SIGTERM (a
checkpoint and a clean exit); the best trial, a table and a plot are written; bad input stops the sweep with a
message."""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from conftest import SCRIPTS, run_process_tree, subprocess_env

from accel_train import ConfigError
from accel_train.sweep import STUDY_NAME, load_space

optuna = pytest.importorskip("optuna")

TOY = [str(SCRIPTS / "toy_train.py"), "--report_to", "none", "--disable_tqdm", "--run_report", "false"]


def sweep(study_dir, space: dict, *flags, recipe=()):
    (study_dir.parent / "space.yaml").write_text(yaml.safe_dump(space))
    cmd = [sys.executable, "-m", "accel_train.cli", "sweep", "--space", str(study_dir.parent / "space.yaml"),
           "--study_dir", str(study_dir), *flags, "--", *TOY, *recipe]
    return run_process_tree(cmd, subprocess_env(), timeout=900)


def study(study_dir):
    return optuna.load_study(study_name=STUDY_NAME, storage=f"sqlite:///{study_dir / 'study.db'}")


def test_a_sweep_runs_its_trials_in_their_own_runs_resumes_its_study_and_writes_the_best(tmp_path):
    out = tmp_path / "sweep"
    space = {"learning_rate": {"low": 1e-3, "high": 0.3, "log": True},
             "per_device_train_batch_size": {"choices": [8, 16]}}
    recipe = ["--num_train_epochs", "2", "--eval_strategy", "epoch"]
    proc = sweep(out, space, "--trials", "2", "--pruner", "none", recipe=recipe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = study(out).trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 2
    for t in trials:  # each trial ran with its own flags, in its own directory, and its value is its final metric
        run = out / f"trial-{t.number:04d}"
        config = yaml.safe_load((run / "config.yaml").read_text())
        assert config["learning_rate"] == t.params["learning_rate"]
        assert config["per_device_train_batch_size"] == t.params["per_device_train_batch_size"]
        assert json.loads((run / "all_results.json").read_text())["eval_loss"] == t.value
    best = json.loads((out / "best_trial.json").read_text())
    assert best["value"] == min(t.value for t in trials) and best["direction"] == "minimize"
    assert best["flags"] == trials[best["trial"]].params and f"trial-{best['trial']:04d}" in best["output_dir"]
    assert (out / "study.png").stat().st_size > 0 and len((out / "trials.csv").read_text().splitlines()) == 3
    # the same command with more trials: the study resumes, the earlier runs are left as they were
    before = (out / "trial-0000" / "all_results.json").read_text()
    proc = sweep(out, space, "--trials", "3", "--pruner", "none", recipe=recipe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [t.state.name for t in study(out).trials] == ["COMPLETE"] * 3
    assert (out / "trial-0002" / "all_results.json").is_file()
    assert (out / "trial-0000" / "all_results.json").read_text() == before


def test_the_pruner_stops_a_worse_trial_through_sigterm_with_a_checkpoint(tmp_path):
    out = tmp_path / "sweep"
    out.mkdir()
    planned = optuna.create_study(study_name=STUDY_NAME, storage=f"sqlite:///{out / 'study.db'}")
    planned.enqueue_trial({"learning_rate": 0.05})
    planned.enqueue_trial({"learning_rate": 1e-6})  # learns nothing: worse than the first trial at every evaluation
    # 2000 steps, evaluated every 100: the second trial is worse at step 100 and must stop long before step 2000
    recipe = ["--num_samples", "4000", "--max_steps", "2000", "--per_device_train_batch_size", "8",
              "--eval_strategy", "steps", "--eval_steps", "100", "--save_strategy", "no"]
    proc = sweep(out, {"learning_rate": {"low": 1e-6, "high": 0.1, "log": True}}, "--trials", "2", recipe=recipe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = study(out).trials
    assert first.state.name == "COMPLETE" and second.state.name == "PRUNED"
    assert second.user_attrs["pruned_at_step"] == 100 and second.user_attrs["stopped_early"]
    pruned = out / "trial-0001"
    assert not (pruned / "all_results.json").exists()
    checkpoints = sorted((pruned / "checkpoints").glob("step-*"))  # SIGTERM: a checkpoint at the step boundary
    assert len(checkpoints) == 1 and 100 <= int(checkpoints[0].name.split("-")[1]) < 2000
    assert "SIGTERM received" in (pruned / "sweep_trial.log").read_text()
    assert json.loads((out / "best_trial.json").read_text())["trials"] == {"complete": 1, "pruned": 1, "fail": 0}


def test_bad_input_stops_the_sweep_with_a_message(tmp_path):
    for spec, fragment in (({"learning_rate": {"low": 0.1, "high": 0.01}}, "low < high"),
                           ({"learning_rate": {"low": 0, "high": 1, "log": True}}, "low > 0"),
                           ({"lr_scheduler_type": {"choices": []}}, "non-empty list"),
                           ({"learning_rate": [0.1, 0.2]}, "{low: A, high: B}")):
        (tmp_path / "space.yaml").write_text(yaml.safe_dump(spec))
        with pytest.raises(ConfigError, match=fragment.replace("{", r"\{").replace("}", r"\}")):
            load_space(tmp_path / "space.yaml")
    out = tmp_path / "sweep"
    proc = sweep(out, {"no_such_flag": {"choices": [1, 2]}}, "--trials", "3")
    assert proc.returncode == 2
    assert "was refused, and every trial would be" in proc.stderr
    assert "no_such_flag" in proc.stderr and not (out / "trial-0001").exists()
    # a trial that crashes is failed and the sweep goes on, until --max_failures of them
    proc = sweep(tmp_path / "crashing", {"learning_rate": {"choices": [0.1]}}, "--trials", "5", "--max_failures",
                 "2", recipe=["--poison_index", "3", "--on_nonfinite", "stop", "--num_train_epochs", "1"])
    assert proc.returncode == 2 and "2 trials failed in this sweep (--max_failures 2)" in proc.stderr
    assert [t.state.name for t in study(tmp_path / "crashing").trials] == ["FAIL", "FAIL"]
    proc = sweep(out, {"learning_rate": {"choices": [0.1]}}, "--trials", "1", recipe=["--output_dir", "x"])
    assert proc.returncode == 2 and "each trial gets its own" in proc.stderr
