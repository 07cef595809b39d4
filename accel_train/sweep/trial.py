"""One trial of a sweep: its run's processes, followed and ended.

The run's evaluations are reported to the pruner at the percent of the run's own schedule they were made at
(`TrialWatch`); a pruned or interrupted run is ended with its whole process tree (`end_process_tree`), and SIGINT /
SIGTERM to the sweep raise where the sweep is, or once a trial's processes are started or ended (`Interrupts`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import yaml

from ..rundir.layout import CONFIG, HISTORY

GRID = 100  # the pruner's steps: percents of each trial's own schedule


class TrialFailed(Exception):
    """A trial's run failed (not for bad input): the study records it as failed and goes on."""


class SweepInterrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached the sweep (a KeyboardInterrupt, so Optuna fails the running trial and lets it
    through); the trial's processes are ended first."""

    def __init__(self, signum: int, message: str = ""):
        super().__init__(message or f"{signal.Signals(signum).name} received.")
        self.signum = signum


class Interrupts:
    """SIGINT and SIGTERM while a sweep runs. The first raises SweepInterrupted where the sweep is, or, received
    inside `deferred()`, at the next `check()`; later ones only cut short the wait for a trial's processes to end.
    Installed from the main thread only (Python runs signal handlers there)."""

    def __init__(self):
        self.received: list[int] = []
        self.raised = False
        self.deferring = False
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        for handler in logging.getLogger("optuna").handlers:  # a logger's own filters miss its children's records
            handler.addFilter(self.quiet)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        for handler in logging.getLogger("optuna").handlers:
            handler.removeFilter(self.quiet)

    def quiet(self, record: logging.LogRecord) -> bool:
        """Optuna's log of the interrupted trial (a traceback of the interrupt) is left out: the sweep says it."""
        return not self.raised

    def handle(self, signum, frame) -> None:
        self.received.append(signum)
        if not self.deferring:
            self.check()

    def check(self) -> None:
        """Raise the signal received, once."""
        if self.received and not self.raised:
            self.raised = True
            raise SweepInterrupted(self.received[0])

    @contextlib.contextmanager
    def deferred(self):
        """A signal does not raise inside the block (starting or ending a trial's processes is not left half done),
        but at the next check()."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False


def watch_run(watch: TrialWatch, proc: subprocess.Popen, interrupts: Interrupts, poll_seconds: float) -> Stop | None:
    """Follow the run until it ends (None) or must be stopped (where, and why); a signal received raises here."""
    while True:
        interrupts.check()
        ended = proc.poll() is not None
        stop = watch.poll(ended)
        if stop is not None or ended:
            return stop
        time.sleep(poll_seconds)


@dataclass(frozen=True)
class Stop:
    """Where and why the sweep stops a trial's run: the pruner's verdict, or an evaluation that is not finite."""

    step: int  # the optimizer step of the evaluation
    percent: int  # ... in percent of the run's schedule: the pruner's step
    why: str


@dataclass(frozen=True)
class Schedule:
    """A run's schedule, from its config.yaml: --max_steps optimizer steps when > 0, else --num_train_epochs."""

    max_steps: int
    epochs: float

    @classmethod
    def of_run(cls, out: Path) -> Schedule:
        try:
            config = yaml.safe_load((out / CONFIG).read_text())
            return cls(int(config["max_steps"]), float(config["num_train_epochs"]))
        except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError) as err:
            raise TrialFailed(f"{out / CONFIG}: the run's schedule (max_steps, num_train_epochs) cannot be read "
                              f"({err!r}), and the pruner compares trials at fractions of it.") from None

    def percent(self, step: int, epoch: float | None) -> int:
        """The percent of the schedule done at an evaluation, rounded down (the evaluation is at or after it)."""
        done = step / self.max_steps if self.max_steps > 0 else (epoch or 0.0) / self.epochs
        return max(0, min(GRID, int(done * GRID + 1e-6)))  # 1e-6: an epoch logged to 4 decimals (0.3 -> 0.29999..)


class TrialWatch:
    """Reports a trial's evaluations of the metric to the pruner as its run logs them (metrics.jsonl), each at the
    percent of the run's own schedule it was made at. Each percent from the first evaluation on holds the latest
    evaluation made by then, so that trials evaluated at different fractions still meet at every percent."""

    def __init__(self, trial, out: Path, metric: str):
        self.trial = trial
        self.metric = metric
        self.out = out
        self.offset = 0  # what of metrics.jsonl was read: each poll reads only the complete lines appended since
        self.inode = None  # ... of that file: a resume's or a rollback's truncation renames a shorter one into place
        self.reported = -1  # the last percent reported
        self.latest = math.nan  # the value of the latest evaluation
        self.schedule: Schedule | None = None  # read at the first evaluation (config.yaml is written before it)

    def poll(self, ended: bool) -> Stop | None:
        history = self.out / HISTORY
        if not history.is_file():
            return None
        with open(history, "rb") as fh:
            inode = os.fstat(fh.fileno()).st_ino
            if inode != self.inode:  # its history was cut back (--on_spike rollback): read it again from the start;
                self.inode, self.offset = inode, 0  # percents reported already are not reported twice (report())
            fh.seek(self.offset)
            appended = fh.read()
        complete = appended if ended else appended[:appended.rfind(b"\n") + 1]  # a last line may be half written
        self.offset += len(complete)
        for line in complete.decode().splitlines():
            record = json.loads(line) if line.strip() else {}
            if self.metric in record and not record.get("final"):
                stop = self.evaluation(int(record["step"]), record.get("epoch"), record[self.metric])
                if stop is not None:
                    return stop
        return None

    def evaluation(self, step: int, epoch: float | None, value: float | None) -> Stop | None:
        if self.schedule is None:
            self.schedule = Schedule.of_run(self.out)
        percent = self.schedule.percent(step, epoch)
        where = f"at step {step}, {percent}% of the run's schedule"
        if value is None or not math.isfinite(value):
            self.report(math.nan, percent)
            return Stop(step, percent, f"{self.metric} is not finite (null in {HISTORY}) {where}: diverged")
        if self.report(float(value), percent) and self.trial.should_prune():
            return Stop(step, percent, f"{self.metric} = {value:.6g} {where} is worse than the median of the "
                                       "completed trials' there")
        return None

    def report(self, value: float, percent: int) -> bool:
        """`value` at `percent`, and at each percent since the last reported the evaluation before it (the latest
        made by then); False: `percent` had its value already (an earlier evaluation within the same percent)."""
        new = percent > self.reported
        if new:
            for step in range(percent if self.reported < 0 else self.reported + 1, percent):
                self.trial.report(self.latest, step)
            self.trial.report(value, percent)
            self.reported = percent
        self.latest = value
        return new


def end_process_tree(proc: subprocess.Popen, timeout: float, interrupts: Interrupts) -> bool:
    """SIGTERM a trial's process group (the loop saves a checkpoint and exits), wait up to `timeout` seconds for its
    whole process tree, then SIGKILL what is left; True: it ended by itself. The tree is listed before the signal and
    while waiting: torchrun starts each worker in a session of its own (out of the group's reach), and a worker whose
    launcher exited is out of sight."""
    tree = set(_descendants(proc.pid))
    with interrupts.deferred():
        ended = _ended_on_sigterm(proc, tree, timeout, interrupts)
        if not ended:
            for process in _alive(tree):
                with contextlib.suppress(psutil.Error):
                    process.kill()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    interrupts.check()  # a signal received meanwhile
    return ended


def _ended_on_sigterm(proc: subprocess.Popen, tree: set[psutil.Process], timeout: float,
                      interrupts: Interrupts) -> bool:
    signals = len(interrupts.received)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while True:
        tree.update(_descendants(proc.pid))
        if proc.poll() is not None and not _alive(tree):
            return True
        if time.monotonic() >= deadline or len(interrupts.received) > signals:  # one more signal: no more waiting
            return False
        time.sleep(0.2)


def _descendants(pid: int) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        return psutil.Process(pid).children(recursive=True)
    return []


def _alive(processes) -> list[psutil.Process]:
    alive = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
    return alive
