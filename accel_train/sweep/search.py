"""`accel-train sweep`: a hyperparameter search over a recipe's flags, with Optuna.

    accel-train sweep --space space.yaml --trials 6 --metric eval_accuracy --study_dir sweeps/sst2 \\
        -- recipes/nlp_finetune.py --max_train_samples 2000

The search space is a YAML mapping of the recipe's flags to ranges or choices:

    learning_rate: {low: 1.0e-5, high: 1.0e-3, log: true}    # a float (log-uniform)
    num_train_epochs: {low: 1, high: 3}                      # an int: both bounds are ints
    lr_scheduler_type: {choices: [linear, cosine]}          # one of these values

Each trial is one run of the recipe, launched with `accel-train launch [--launch_args]`, in its own run directory
(`study_dir/trial-0003/`), with the sampled flags after the recipe's own. `--launch_args` takes the next word whatever
it starts with, so quote several flags as one: `--launch_args '--cpu --num_processes 2'` (or `--launch_args=--cpu`;
repeated, they add up). The study lives in a SQLite file (`study_dir/study.db`), so a sweep that stops resumes where
it was when run again with the same command; several sweeps started against one study (separate launches, one after
another or at once) share its trials. A trial whose process died with its sweep is failed by Optuna's heartbeat and
its flags tried again.

Pruning reads each evaluation as the run logs it (metrics.jsonl) and reports it at the percent of the run's own
schedule it was made at (its --max_steps, else its --num_train_epochs): trials whose schedules differ in length (batch
size, accumulation, epochs, processes) are compared after the same share of their schedules, as their final values
are compared at the end of theirs; compared at the same optimizer step, a short schedule would be judged at its end
against a long one in mid-schedule. A trial the pruner stops gets SIGTERM, which the loop turns into a checkpoint and
a clean exit (killed after --stop_timeout seconds). An evaluation that is not finite (NaN or inf: null in
metrics.jsonl, or in all_results.json at the end) prunes its trial with the reason, whatever --pruner says: it is the
worst value there is (Optuna's pruners and TPE take a NaN so), not a crash. A completed trial's value is its final
evaluation (all_results.json). At the end the sweep writes `best_trial.json` (value, flags, the full command, run
directory), `trials.csv` and `study.png` (the optimization history). A trial refused for bad input (exit code 2: an
unknown flag, a value out of range) stops the sweep with its message: every other trial would be refused the same way.

SIGINT (Ctrl-C) or SIGTERM to the sweep ends the trial it runs, whose processes are in a session of their own: SIGTERM
to them (a checkpoint), every process of the trial killed after --stop_timeout seconds (at once on a second signal);
the trial is marked failed ("interrupted") and the sweep exits with 128 + the signal's number. Run the same command
again to go on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..config import greater_is_better_for
from ..errors import ConfigError, UserError
from ..rundir.layout import RESULTS
from .trial import GRID, Interrupts, SweepInterrupted, TrialFailed, TrialWatch, end_process_tree, watch_run

STUDY_DB = "study.db"
STUDY_NAME = "accel_train"
BEST_TRIAL = "best_trial.json"
TRIALS_TABLE = "trials.csv"
STUDY_PLOT = "study.png"
TRIAL_LOG = "sweep_trial.log"  # in each trial's run directory: what the launch printed
TRIAL_STATUS = "trial_status.json"  # in each trial's run directory: how it ended (run_cli's status file)


@dataclass(frozen=True)
class Param:
    """One flag of the search space: a float or int range (`log` for log-uniform), or a list of choices."""

    name: str
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    choices: tuple[Any, ...] | None = None

    def suggest(self, trial) -> Any:
        if self.choices is not None:
            return trial.suggest_categorical(self.name, list(self.choices))
        if isinstance(self.low, int) and isinstance(self.high, int):
            return trial.suggest_int(self.name, self.low, self.high, log=self.log)
        return trial.suggest_float(self.name, float(self.low), float(self.high), log=self.log)


def load_space(path: str | Path) -> list[Param]:
    """The search space of a YAML file (see the module docstring); errors name the flag and the file."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"--space {path}: cannot read it ({err}).") from None
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"--space {path}: expected a mapping of flags to ranges or choices, got {type(raw).__name__}")
    space = []
    for name, spec in raw.items():
        where = f"--space {path}, flag {name}"
        if not isinstance(spec, dict) or not (set(spec) <= {"low", "high", "log", "choices"}):
            raise ConfigError(f"{where}: give {{low: A, high: B}} (optionally log: true) or {{choices: [...]}}, "
                              f"got {spec!r}.")
        if "choices" in spec:
            if not isinstance(spec["choices"], list) or not spec["choices"] or len(spec) > 1:
                raise ConfigError(f"{where}: choices must be a non-empty list, and alone.")
            space.append(Param(name, choices=tuple(spec["choices"])))
            continue
        low, high = spec.get("low"), spec.get("high")
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high))
        if not numbers or low >= high or (spec.get("log") and low <= 0):
            raise ConfigError(f"{where}: low and high must be numbers with low < high (and low > 0 with log: "
                              f"true), got low={low!r}, high={high!r}.")
        space.append(Param(name, low, high, bool(spec.get("log", False))))
    return space


@dataclass
class Sweep:
    """What a sweep runs: the recipe and its flags, the space, the metric, and where the study lives."""

    script: str
    script_args: list[str]
    space: list[Param]
    metric: str
    study_dir: Path
    trials: int
    greater: bool
    launch_args: list[str] = field(default_factory=list)
    pruner: str = "median"
    seed: int = 0
    max_failures: int = 3  # trials that fail (not pruned, not refused) before the sweep gives up
    stop_timeout: float = 120.0  # seconds a trial's run has to checkpoint and exit after SIGTERM before it is killed
    poll_seconds: float = 0.5

    def command(self, flags: dict[str, Any], output_dir: Path) -> list[str]:
        values = [item for name, value in flags.items() for item in (f"--{name}", str(value))]
        return [sys.executable, "-m", "accel_train.cli", "launch", *self.launch_args, self.script,
                *self.script_args, *values, "--output_dir", str(output_dir)]


def run_sweep(sweep: Sweep):
    """Run trials until the study holds `sweep.trials` finished ones (completed or pruned); return the study."""
    optuna = _optuna()
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
    from optuna.study import MaxTrialsCallback
    from optuna.trial import TrialState

    sweep.study_dir.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # the heartbeat is "experimental"
        # a trial whose sweep died stops beating: after the grace period it is failed and its flags tried again
        storage = RDBStorage(f"sqlite:///{sweep.study_dir / STUDY_DB}", heartbeat_interval=10, grace_period=60,
                             heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=1))
    pruner = optuna.pruners.MedianPruner(n_startup_trials=1) if sweep.pruner == "median" else \
        optuna.pruners.NopPruner()
    study = optuna.create_study(storage=storage, study_name=STUDY_NAME, load_if_exists=True, pruner=pruner,
                                direction="maximize" if sweep.greater else "minimize",
                                sampler=optuna.samplers.TPESampler(seed=sweep.seed))
    finished = (TrialState.COMPLETE, TrialState.PRUNED)
    left = sweep.trials - len(study.get_trials(deepcopy=False, states=finished))
    failures: list[str] = []
    if sweep.pruner != "none" and {"num_train_epochs", "max_steps"} & {p.name for p in sweep.space}:
        print("accel-train sweep: the space sets the schedule's length; the pruner compares trials at the same "
              "fraction of their own schedules, where a longer one has trained longer (--pruner none: no pruning).",
              file=sys.stderr, flush=True)

    with Interrupts() as interrupts:
        def objective(trial) -> float:
            try:
                return _objective(sweep, trial, interrupts)
            except TrialFailed as failed:
                failures.append(str(failed))
                raise

        def stop_on_failures(study, trial) -> None:
            if len(failures) >= sweep.max_failures:
                study.stop()

        if left > 0:
            study.optimize(objective, catch=(TrialFailed,),
                           callbacks=[MaxTrialsCallback(sweep.trials, states=finished), stop_on_failures])
    if len(failures) >= sweep.max_failures:
        raise UserError(f"{len(failures)} trials failed in this sweep (--max_failures {sweep.max_failures}); the "
                        f"last: {failures[-1]}. The study keeps its trials: run the sweep again once fixed.")
    write_results(study, sweep)
    return study


def _objective(sweep: Sweep, trial, interrupts: Interrupts) -> float:
    flags = {p.name: p.suggest(trial) for p in sweep.space}
    out = sweep.study_dir / f"trial-{trial.number:04d}"
    command = sweep.command(flags, out)
    trial.set_user_attr("command", shlex.join(command))
    trial.set_user_attr("output_dir", str(out))
    print(f"accel-train sweep: trial {trial.number}: {' '.join(f'--{k} {v}' for k, v in flags.items())}",
          file=sys.stderr, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    # how the run ended: `accelerate launch` reports every failure as exit code 1; none left from an earlier run here
    (out / TRIAL_STATUS).unlink(missing_ok=True)
    env = {**os.environ, "ACCEL_TRAIN_STATUS_FILE": str(out / TRIAL_STATUS)}
    watch = TrialWatch(trial, out, sweep.metric)
    with open(out / TRIAL_LOG, "w") as log, interrupts.deferred():  # a signal here would orphan the process
        # a session of its own: a Ctrl-C at the terminal does not cut it mid-step; the sweep ends it on purpose
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        stop = watch_run(watch, proc, interrupts, sweep.poll_seconds)
        if stop is not None:
            end_process_tree(proc, sweep.stop_timeout, interrupts)
    except BaseException as err:  # the sweep is stopping (a signal, an error of its own): its trial must not go on
        ended = end_process_tree(proc, sweep.stop_timeout, interrupts)
        if not isinstance(err, SweepInterrupted):
            raise
        name = signal.Signals(err.signum).name
        how = "ended on SIGTERM (a checkpoint)" if ended else f"killed after --stop_timeout {sweep.stop_timeout:g} s"
        trial.set_user_attr("interrupted", f"{name} to the sweep: the trial's run was {how}")
        raise SweepInterrupted(err.signum, f"{name}: trial {trial.number}'s run was {how} and the trial is marked "
                                           f"failed (its run directory: {out}).") from None
    if stop is not None:
        trial.set_user_attr("pruned_at_step", stop.step)
        trial.set_user_attr("pruned_at_percent", stop.percent)
        trial.set_user_attr("stopped_early", not (out / RESULTS).is_file())  # False: it had ended by itself
        _pruned(trial, stop.why)
    return _value(sweep, trial, proc.returncode, watch)


def _value(sweep: Sweep, trial, returncode: int, watch: TrialWatch) -> float:
    """The value of a trial whose run ended by itself: its final --metric; a refusal, a failure or a non-finite
    value otherwise."""
    out = watch.out
    try:  # the run writes it at its end; one cut short (a kill mid-write) says nothing
        status = json.loads((out / TRIAL_STATUS).read_text()) if (out / TRIAL_STATUS).is_file() else {}
    except ValueError:
        status = {}
    if status.get("exit") == 2 and status.get("kind") == ConfigError.kind:  # a diverged run is a failed trial
        raise ConfigError(f"trial {trial.number} was refused, and every trial would be: fix the sweep's flags or "
                          f"space. The run said: {status.get('message', '').strip()}")
    if returncode != 0:  # the run's own message where it left one (a data error: every trial fails the same way)
        said = f": {status['message'].strip()}" if status.get("exit") and status.get("message") else ""
        raise TrialFailed(f"trial {trial.number} failed with exit code {returncode}{said} (see {out / TRIAL_LOG})")
    results = json.loads((out / RESULTS).read_text())
    if sweep.metric not in results:
        raise ConfigError(f"--metric {sweep.metric}: trial {trial.number}'s final metrics have only "
                          f"{sorted(results)}.")
    value = results[sweep.metric]
    if value is None or not math.isfinite(value):
        watch.report(math.nan, GRID)  # the worst value there is, for the sampler too
        _pruned(trial, f"the final {sweep.metric} is not finite (null in {RESULTS})")
    return float(value)


def _pruned(trial, why: str):
    import optuna

    trial.set_user_attr("pruned_because", why)
    raise optuna.TrialPruned(why)


def write_results(study, sweep: Sweep) -> None:
    """best_trial.json, trials.csv and study.png beside the study."""
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        raise UserError(f"no trial of the study in {sweep.study_dir} completed: see the trial-*/{TRIAL_LOG} "
                        "files.")
    best = study.best_trial
    summary = {"metric": sweep.metric, "direction": study.direction.name.lower(), "value": best.value,
               "trial": best.number, "flags": best.params, "command": best.user_attrs.get("command"),
               "output_dir": best.user_attrs.get("output_dir"),
               "trials": {state.name.lower(): len(study.get_trials(deepcopy=False, states=(state,)))
                          for state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)}}
    (sweep.study_dir / BEST_TRIAL).write_text(json.dumps(summary, indent=2))
    study.trials_dataframe().to_csv(sweep.study_dir / TRIALS_TABLE, index=False)
    import matplotlib

    matplotlib.use("Agg")
    from optuna.visualization.matplotlib import plot_optimization_history

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # optuna marks its matplotlib plots experimental
        axes = plot_optimization_history(study, target_name=sweep.metric)
    axes.figure.set_size_inches(8, 4.5)
    axes.figure.savefig(sweep.study_dir / STUDY_PLOT, dpi=100, bbox_inches="tight")
    print(f"accel-train sweep: best trial {best.number}: {sweep.metric} = {best.value:.6g} with "
          f"{' '.join(f'--{k} {v}' for k, v in best.params.items())}; {summary['trials']}; wrote "
          f"{sweep.study_dir / BEST_TRIAL}", file=sys.stderr)


def _optuna():
    try:
        import optuna
    except ImportError:
        raise ConfigError("accel-train sweep needs Optuna: pip install 'accel_train[sweep]' (or optuna).") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


def main(argv: Sequence[str]) -> int:
    """`accel-train sweep ... -- SCRIPT [script flags]`; 128 + the signal's number when SIGINT / SIGTERM stopped it."""
    sweep = parse_args(argv)
    try:
        run_sweep(sweep)
    except SweepInterrupted as stop:
        print(f"accel-train sweep: {stop} The study in {sweep.study_dir} keeps its trials: run the same command to "
              "go on.", file=sys.stderr)
        return 128 + stop.signum
    return 0


def parse_args(argv: Sequence[str]) -> Sweep:
    """The sweep of an `accel-train sweep` argv: its own flags, then `--`, the recipe and the recipe's flags."""
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    own, recipe = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(prog="accel-train sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--space", required=True, help="YAML file: flag -> {low, high[, log]} or {choices}")
    parser.add_argument("--trials", type=int, default=6, help="finished trials to reach (completed + pruned)")
    parser.add_argument("--metric", default="eval_loss", help="a final metric of the recipe (all_results.json)")
    parser.add_argument("--direction", choices=("maximize", "minimize"), default=None,
                        help="default: from the metric's name (lower is better for loss, error, perplexity ...)")
    parser.add_argument("--study_dir", default="sweep", help="the study (study.db) and one directory per trial")
    parser.add_argument("--pruner", choices=("median", "none"), default="median",
                        help="median: stop a trial whose evaluation is worse than the median of the completed "
                             "trials' at the same percent of their own schedules")
    parser.add_argument("--launch_args", action="append", default=[], help="flags for accel-train launch, as one "
                        "word: --launch_args '--cpu --num_processes 2' (or --launch_args=--cpu; repeated, they add up)")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    parser.add_argument("--max_failures", type=int, default=3, help="failed trials (crashes, not pruned ones) "
                        "after which the sweep stops")
    parser.add_argument("--stop_timeout", type=float, default=120.0, help="seconds a trial's run has to save a "
                        "checkpoint and exit after SIGTERM (pruned, or the sweep interrupted) before it is killed")
    args = parser.parse_args(_launch_args_joined(own))
    if not recipe:
        raise ConfigError("accel-train sweep: put the recipe and its flags after `--`, e.g. accel-train sweep "
                          "--space space.yaml -- recipes/nlp_finetune.py")
    if any(a == "--output_dir" or a.startswith("--output_dir=") for a in recipe):
        raise ConfigError("accel-train sweep: the recipe's flags name --output_dir; each trial gets its own "
                          "(STUDY_DIR/trial-NNNN). Give --study_dir instead.")
    if args.trials < 1:
        raise ConfigError(f"--trials {args.trials}: at least one trial.")
    if args.stop_timeout < 0:
        raise ConfigError(f"--stop_timeout {args.stop_timeout:g}: seconds, 0 or more (0: kill at once).")
    greater = args.direction == "maximize" if args.direction else greater_is_better_for(args.metric)
    return Sweep(script=recipe[0], script_args=recipe[1:], space=load_space(args.space), metric=args.metric,
                 study_dir=Path(args.study_dir), trials=args.trials, greater=greater,
                 launch_args=[a for given in args.launch_args for a in shlex.split(given)], pruner=args.pruner,
                 seed=args.seed, max_failures=args.max_failures, stop_timeout=args.stop_timeout)


def _launch_args_joined(own: list[str]) -> list[str]:
    """`--launch_args VALUE` as `--launch_args=VALUE`: argparse takes a value starting with '-' (`--cpu`) for a flag
    of its own and refuses the option ("expected one argument")."""
    out = []
    words = iter(own)
    for word in words:
        value = next(words, None) if word == "--launch_args" else None
        out.append(word if value is None else f"--launch_args={value}")
    return out
