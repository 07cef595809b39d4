"""`accel-train sweep`: trials of a recipe run one after another from an Optuna study in SQLite, each in its own run
directory with its sampled flags; a sweep run again resumes its study; the pruner compares trials at the same fraction
of their own schedules and stops a trial through SIGTERM (a checkpoint and a clean exit); a non-finite evaluation
prunes its trial; SIGINT / SIGTERM of the sweep ends its trial's processes too; the best trial, a table and a plot are
written; bad input stops the sweep with a message.

The sweeps run in this process (`main(argv)`), except where the sweep process itself is what is tested (a signal)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import yaml
from conftest import ROOT, SCRIPTS, kill_tree, read_jsonl, subprocess_env

from accel_train import ConfigError, UserError
from accel_train import sweep as sweep_module
from accel_train.sweep import STUDY_NAME, load_space, search

optuna = pytest.importorskip("optuna")

TOY = [str(SCRIPTS / "toy_train.py"), "--report_to", "none", "--disable_tqdm", "--run_report", "false",
       "--num_samples", "32"]


@pytest.fixture
def trial_env(monkeypatch):
    """A sweep run in this process starts its trials with this process's environment: make it the one launched tests
    get (no launcher variables, one OpenMP thread)."""
    env = subprocess_env()
    for key in set(os.environ) - set(env):
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def sweep_argv(study_dir, space: dict, *flags, recipe=()) -> list[str]:
    (study_dir.parent / "space.yaml").write_text(yaml.safe_dump(space))
    return ["--space", str(study_dir.parent / "space.yaml"), "--study_dir", str(study_dir), *flags, "--", *TOY,
            *recipe]


def sweep(study_dir, space: dict, *flags, recipe=()) -> int:
    return sweep_module.main(sweep_argv(study_dir, space, *flags, recipe=recipe))


def study(study_dir):
    return optuna.load_study(study_name=STUDY_NAME, storage=f"sqlite:///{study_dir / 'study.db'}")


def test_launch_args_may_start_with_dashes(tmp_path, monkeypatch):
    planned = []
    monkeypatch.setattr(search, "run_sweep", planned.append)  # what the sweep would run, not run
    for given, expected in ((["--launch_args", "--cpu"], ["--cpu"]),
                            (["--launch_args", "--cpu --num_processes 2"], ["--cpu", "--num_processes", "2"]),
                            (["--launch_args=--cpu"], ["--cpu"]),
                            (["--launch_args", "--cpu", "--launch_args", "--num_processes 2", "--trials", "2"],
                             ["--cpu", "--num_processes", "2"])):
        assert sweep(tmp_path / "sweep", {"learning_rate": {"choices": [0.1]}}, *given) == 0
        command = planned[-1].command({"learning_rate": 0.1}, tmp_path / "trial")
        assert command[3:6 + len(expected)] == ["launch", *expected, *TOY[:2]], given
    assert planned[-1].trials == 2  # the flag after the launch arguments is the sweep's own


class Reports:
    """An optuna trial as the pruner's watch sees it: what it was told, never pruned."""

    def __init__(self):
        self.values: dict[int, float] = {}

    def report(self, value, step):
        self.values[step] = value

    def should_prune(self):
        return False


def test_the_pruner_follows_a_history_a_rollback_cut_back(tmp_path):
    """--on_spike rollback cuts metrics.jsonl back to its checkpoint and the replay grows it again: the watch read on
    from its old byte position, mid-line (a JSONDecodeError ended the whole sweep), and saw none of the replay's
    evaluations until the file outgrew that position. It reads the new file from its start: the replay's later
    evaluations reach the pruner, each percent once."""
    from accel_train.rundir.metrics_log import truncate_history
    from accel_train.sweep.trial import TrialWatch

    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"max_steps": 10, "num_train_epochs": 1}))
    history = tmp_path / "metrics.jsonl"

    def append(*records):
        with open(history, "a") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in records)

    append(*({"step": s, "loss": 1.0, "learning_rate": 0.1} for s in range(1, 9)),
           *({"step": s, "eval_loss": 2.0 - s / 10, "epoch": s / 10} for s in (2, 4, 6, 8)))
    trial = Reports()
    watch = TrialWatch(trial, tmp_path, "eval_loss")
    assert watch.poll(False) is None and trial.values[80] == pytest.approx(1.2)
    truncate_history(history, 4)  # the rollback to step 4's checkpoint
    append({"step": 4, "rollback": True}, *({"step": s, "eval_loss": 3.0 - s / 10, "epoch": s / 10} for s in (6, 8)),
           *({"step": s, "loss": 1.0, "learning_rate": 0.1} for s in range(5, 11)),
           {"step": 10, "eval_loss": 0.5, "epoch": 1.0})
    assert watch.poll(True) is None
    assert trial.values[80] == pytest.approx(1.2) and trial.values[100] == 0.5  # 80% was reported before the cut


@pytest.mark.slow
def test_a_sweep_runs_its_trials_in_their_own_runs_resumes_its_study_and_writes_the_best(tmp_path, trial_env):
    out = tmp_path / "sweep"
    space = {"learning_rate": {"low": 1e-3, "high": 0.3, "log": True},
             "per_device_train_batch_size": {"choices": [8, 16]}}
    flags = ("--pruner", "none", "--launch_args", "--cpu")
    recipe = ["--num_train_epochs", "1", "--eval_strategy", "epoch"]
    assert sweep(out, space, "--trials", "1", *flags, recipe=recipe) == 0
    before = (out / "trial-0000" / "all_results.json").read_text()
    # the same command with more trials: the study resumes, the earlier run is left as it was
    assert sweep(out, space, "--trials", "2", *flags, recipe=recipe) == 0
    trials = study(out).trials
    assert [t.state.name for t in trials] == ["COMPLETE"] * 2
    assert (out / "trial-0000" / "all_results.json").read_text() == before
    for t in trials:  # each trial ran with its own flags, in its own directory, and its value is its final metric
        run = out / f"trial-{t.number:04d}"
        config = yaml.safe_load((run / "config.yaml").read_text())
        assert config["learning_rate"] == t.params["learning_rate"]
        assert config["per_device_train_batch_size"] == t.params["per_device_train_batch_size"]
        assert json.loads((run / "all_results.json").read_text())["eval_loss"] == t.value
        assert " launch --cpu " in t.user_attrs["command"]
    best = json.loads((out / "best_trial.json").read_text())
    assert best["value"] == min(t.value for t in trials) and best["direction"] == "minimize"
    assert best["flags"] == trials[best["trial"]].params and f"trial-{best['trial']:04d}" in best["output_dir"]
    assert (out / "study.png").stat().st_size > 0 and len((out / "trials.csv").read_text().splitlines()) == 3


def evaluations(run) -> dict[int, float | None]:
    return {r["step"]: r["eval_loss"] for r in read_jsonl(run / "metrics.jsonl") if "eval_loss" in r}


@pytest.mark.slow
def test_the_pruner_compares_trials_at_the_same_fraction_of_their_schedules(tmp_path, trial_env):
    out = tmp_path / "sweep"
    out.mkdir()
    planned = optuna.create_study(study_name=STUDY_NAME, storage=f"sqlite:///{out / 'study.db'}")
    # each trial evaluates at every tenth of its own schedule, half of which is warmup
    for flags in ({"learning_rate": 1e37, "max_steps": 10, "eval_steps": 1},  # diverges: eval_loss inf from step 2
                  {"learning_rate": 0.05, "max_steps": 20, "eval_steps": 2},
                  {"learning_rate": 0.05, "max_steps": 100, "eval_steps": 10},  # behind the last at step 20 (warmup)
                  {"learning_rate": 1e-6, "max_steps": 2000, "eval_steps": 200}):  # learns nothing: worse at 10%
        planned.enqueue_trial(flags)
    space = {"learning_rate": {"low": 1e-6, "high": 1e37, "log": True}, "max_steps": {"low": 10, "high": 2000},
             "eval_steps": {"low": 1, "high": 200}}
    recipe = ["--per_device_train_batch_size", "8", "--warmup_ratio", "0.5", "--eval_strategy", "steps",
              "--save_strategy", "no", "--logging_steps", "1000"]
    assert sweep(out, space, "--trials", "4", recipe=recipe) == 0
    diverged, short, long, stalled = study(out).trials
    assert [t.state.name for t in study(out).trials] == ["PRUNED", "COMPLETE", "COMPLETE", "PRUNED"]
    # a NaN / inf evaluation (null in metrics.jsonl) prunes its trial with the reason, and the sweep goes on
    assert evaluations(out / "trial-0000")[2] is None
    assert diverged.user_attrs["pruned_at_step"] == 2
    assert "eval_loss is not finite" in diverged.user_attrs["pruned_because"]
    assert math.isnan(diverged.intermediate_values[20])
    # the long schedule is behind the short one at the same step, ahead at the same fraction: compared at fractions,
    # it is not pruned (compared at steps, it was: at step 20)
    assert evaluations(out / "trial-0002")[20] > evaluations(out / "trial-0001")[20]
    assert long.intermediate_values[10] == evaluations(out / "trial-0002")[10]
    assert short.intermediate_values[10] == evaluations(out / "trial-0001")[2]
    assert long.intermediate_values[19] == evaluations(out / "trial-0002")[10]  # the latest evaluation by then
    assert sorted(long.intermediate_values) == list(range(10, 101))  # each percent from its first evaluation
    # the trial that learns nothing is worse than the median at 10% of its schedule: SIGTERM, a checkpoint, no end
    assert stalled.user_attrs["pruned_at_step"] == 200 and stalled.user_attrs["stopped_early"]
    pruned = out / "trial-0003"
    assert not (pruned / "all_results.json").exists()
    checkpoints = sorted((pruned / "checkpoints").glob("step-*"))  # SIGTERM: a checkpoint at the step boundary
    assert len(checkpoints) == 1 and 200 <= int(checkpoints[0].name.split("-")[1]) < 2000
    assert "SIGTERM received" in (pruned / "sweep_trial.log").read_text()
    best = json.loads((out / "best_trial.json").read_text())
    assert best["trial"] == 2 and best["trials"] == {"complete": 2, "pruned": 2, "fail": 0}


def start_sweep(out, space, recipe) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "accel_train.cli", "sweep", *sweep_argv(out, space, "--trials", "2", recipe=recipe)]
    return subprocess.Popen(cmd, cwd=ROOT, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def training(run) -> bool:
    history = run / "metrics.jsonl"
    return history.is_file() and any("loss" in r for r in read_jsonl(history))


def interrupt(proc: subprocess.Popen, run, signum: int) -> tuple[int, str, list[psutil.Process]]:
    """Send `signum` to the sweep `proc` once its trial in `run` trains; its exit code, stderr, and the processes of
    its trial (seen before the signal) still alive after it exited."""
    deadline = time.monotonic() + 600
    while not training(run) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    tree = psutil.Process(proc.pid).children(recursive=True)
    assert len(tree) >= 2  # the launcher and the run
    proc.send_signal(signum)
    try:
        _, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        raise
    alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for p in alive:  # an orphan must not outlive the test
        kill_tree(p.pid)
    return proc.returncode, stderr, alive


@pytest.mark.slow
def test_sigterm_or_ctrl_c_ends_the_trial_running_and_a_rerun_finds_none(tmp_path):
    out = tmp_path / "sweep"
    space = {"learning_rate": {"choices": [0.01]}}
    recipe = ["--max_steps", "1000000", "--logging_steps", "10", "--eval_strategy", "no", "--save_strategy", "no"]
    code, stderr, alive = interrupt(start_sweep(out, space, recipe), out / "trial-0000", signal.SIGTERM)
    assert alive == []
    assert code == 128 + signal.SIGTERM and "SIGTERM" in stderr and "run the same command" in stderr, stderr[-3000:]
    first = study(out).trials[0]
    assert first.state.name == "FAIL" and "SIGTERM" in first.user_attrs["interrupted"]
    assert len(list((out / "trial-0000" / "checkpoints").glob("step-*"))) == 1  # the trial's own SIGTERM checkpoint
    ended = (out / "trial-0000" / "metrics.jsonl").read_text()
    # a rerun trains its next trial alone; Ctrl-C (SIGINT) ends it the same way
    code, stderr, alive = interrupt(start_sweep(out, space, recipe), out / "trial-0001", signal.SIGINT)
    assert alive == []
    assert code == 128 + signal.SIGINT and "SIGINT" in stderr, stderr[-3000:]
    assert [t.state.name for t in study(out).trials] == ["FAIL", "FAIL"]
    assert "SIGINT" in study(out).trials[1].user_attrs["interrupted"]
    assert (out / "trial-0000" / "metrics.jsonl").read_text() == ended  # nothing went on training in trial 0


@pytest.mark.slow
def test_bad_input_stops_the_sweep_with_a_message(tmp_path, trial_env):
    for spec, fragment in (({"learning_rate": {"low": 0.1, "high": 0.01}}, "low < high"),
                           ({"learning_rate": {"low": 0, "high": 1, "log": True}}, "low > 0"),
                           ({"lr_scheduler_type": {"choices": []}}, "non-empty list"),
                           ({"learning_rate": [0.1, 0.2]}, "{low: A, high: B}")):
        (tmp_path / "space.yaml").write_text(yaml.safe_dump(spec))
        with pytest.raises(ConfigError, match=fragment.replace("{", r"\{").replace("}", r"\}")):
            load_space(tmp_path / "space.yaml")
    out = tmp_path / "sweep"
    with pytest.raises(ConfigError, match="was refused, and every trial would be") as refused:
        sweep(out, {"no_such_flag": {"choices": [1, 2]}}, "--trials", "3")
    assert "no_such_flag" in str(refused.value) and not (out / "trial-0001").exists()
    # a trial that crashes is failed and the sweep goes on, until --max_failures of them; the last one's own message
    # is in the sweep's (the run's exit code 2 reaches the sweep as accelerate launch's 1)
    with pytest.raises(UserError, match=r"2 trials failed in this sweep \(--max_failures 2\)") as crashed:
        sweep(tmp_path / "crashing", {"learning_rate": {"choices": [0.1]}}, "--trials", "5", "--max_failures", "2",
              recipe=["--poison_index", "3", "--on_nonfinite", "stop", "--num_train_epochs", "1", "--no_preflight"])
    assert [t.state.name for t in study(tmp_path / "crashing").trials] == ["FAIL", "FAIL"]
    said = json.loads((tmp_path / "crashing" / "trial-0001" / "trial_status.json").read_text())["message"].strip()
    assert said and f"failed with exit code 1: {said} (see " in str(crashed.value)
    with pytest.raises(ConfigError, match="each trial gets its own"):
        sweep(out, {"learning_rate": {"choices": [0.1]}}, "--trials", "1", recipe=["--output_dir", "x"])
