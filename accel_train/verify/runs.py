"""The variants `accel-train verify` runs: the user's own command, with a small step budget, each in its own run
directory under the verify directory, as processes of their own (a SIGKILL and a process start are what the checks
are about).

A variant's command is the user's script and flags, then verify's flags (the last of a repeated flag wins):
`--max_steps N --logging_strategy steps --logging_steps 1 --save_strategy steps --save_steps S --report_to none
--output_dir DIR`. Without --launch_args it is `python SCRIPT ...` (one process); with them, `accel-train launch
LAUNCH_ARGS SCRIPT ...`, as `accel-train sweep` launches its trials.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.data import UNEQUAL_VARIABLE
from ..core.token_batches import FIXED_BATCHES_VARIABLE
from ..errors import ConfigError, UserError
from ..observe.fed_record import VARIABLE as FED_VARIABLE
from ..rundir.layout import HISTORY
from ..sweep.trial import Interrupts, end_process_tree

CHECKS = ("determinism", "resume", "accumulation", "world_size", "evaluation", "precision", "packing", "export",
          "data_accounting")
STATUS_FILE = "status.json"  # beside each variant's log: how its run ended (run_cli's ACCEL_TRAIN_STATUS_FILE)
LOGS_DIR = "logs"
# Asked by name only (--checks ...,export): the export check adds 6-10 s on the main job, more under load
OPT_IN = ("export",)
DEFAULT_CHECKS = tuple(name for name in CHECKS if name not in OPT_IN)


class VerifyError(UserError):
    """A variant of the user's run could not be run or read: the message names the variant, its log and what to do."""

    kind = "verify error"


@dataclass
class Verify:
    """What `accel-train verify` runs: the user's command, the checks, the step budget, where it writes."""

    script: str
    script_args: list[str]
    output_dir: Path
    checks: tuple[str, ...] = DEFAULT_CHECKS
    steps: int = 6
    accumulation: int = 2  # k: k micro-batches of B against one of kB
    accumulation_args: list[str] = field(default_factory=list)  # script flags of the accumulation variants only
    world_size_args: list[str] = field(default_factory=list)  # script flags of the world-size variants only
    launch_args: list[str] = field(default_factory=list)
    timeout: float = 1800.0  # seconds one variant may run before it is ended
    poll_seconds: float = 0.2

    @property
    def env(self) -> dict[str, str]:
        """What every variant's environment gets: the data-accounting check reads what each process fed, the
        accumulation check which examples each side's step 1 held; with accumulation or world size, step 1 holds the
        shortest and longest examples, ordered by length (core/data.py's UnequalFirstStep, where the loader knows the
        lengths), in every variant, so the runs the checks share stay one run."""
        env = {FED_VARIABLE: "1"} if {"data_accounting", "accumulation", "world_size"} & set(self.checks) else {}
        if {"accumulation", "world_size"} & set(self.checks):
            env[UNEQUAL_VARIABLE] = "1"
        # a recipe's default token budget is chosen per micro-batch size and dealt per process: the variants (B/2 x 2
        # against B, p x 2 processes against 2p x 1, another pad multiple) would batch other examples; batches of
        # examples unless the script's flags ask for a budget (core/token_batches.py: default_budget)
        env[FIXED_BATCHES_VARIABLE] = "1"
        return env

    @property
    def save_steps(self) -> int:
        """A checkpoint in mid-run, before the step the resume check's run is killed at."""
        return max(1, self.steps // 2)

    @property
    def kill_step(self) -> int:
        """After the mid-run checkpoint, before the end: the resumed run replays steps save_steps+1 .. kill_step."""
        return self.steps - 1

    def flags(self, output_dir: Path, **more: object) -> list[str]:
        values = {"max_steps": self.steps, "logging_strategy": "steps", "logging_steps": 1, "save_strategy": "steps",
                  "save_steps": self.save_steps, "report_to": "none", **more, "output_dir": output_dir}
        return [word for name, value in values.items() for word in (f"--{name}", str(value))]

    def command(self, output_dir: Path, script_args: Sequence[str] = (), processes: int = 1,
                **more: object) -> list[str]:
        """`script_args`: more of the script's own flags, after the user's (--accumulation_args). `processes` > 1:
        `accel-train launch --num_processes P` (gloo processes on CPU where there is no GPU), on a free port."""
        head = [sys.executable]
        if self.launch_args or processes > 1:
            head = [sys.executable, "-m", "accel_train.cli", "launch", *self.launch_args]
        if processes > 1:
            head += ["--num_processes", str(processes), "--main_process_port", str(free_port())]
        return [*head, self.script, *self.script_args, *script_args, *self.flags(output_dir, **more)]


@dataclass
class Variant:
    """One run of the user's script: its name (its directory under the verify directory), command and how it ended."""

    name: str
    command: list[str]
    output_dir: Path
    env: dict[str, str] = field(default_factory=dict)  # what verify adds to the environment
    processes: int = 1
    returncode: int | None = None
    attempts: list[dict] = field(default_factory=list)  # each process started in this run directory

    def record(self) -> dict:
        return {"output_dir": str(self.output_dir), "processes": self.processes, "attempts": self.attempts}


def run_variant(verify: Verify, name: str, interrupts: Interrupts, env: dict[str, str] | None = None,
                resume: bool = False, script_args: Sequence[str] = (), processes: int = 1,
                **more: object) -> Variant:
    """Run one variant to its end (or, resume=True, resume the variant `name` from its latest checkpoint)."""
    out = verify.output_dir / name
    extra = {"resume_from_checkpoint": "latest"} if resume else {}
    env = {**verify.env, **(env or {})}
    variant = Variant(name, verify.command(out, script_args, processes, **more, **extra), out, env, processes=processes)
    if not resume and out.exists():
        shutil.rmtree(out)  # verify's own variant directory, from an earlier verify
    logs = verify.output_dir / LOGS_DIR
    logs.mkdir(parents=True, exist_ok=True)
    stem = f"{name}.from-checkpoint" if resume else name
    log, status = logs / f"{stem}.log", logs / f"{stem}.{STATUS_FILE}"
    status.unlink(missing_ok=True)
    full_env = {**os.environ, **variant.env, "ACCEL_TRAIN_STATUS_FILE": str(status)}
    print(f"accel-train verify: {stem}: {' '.join(variant.command)}", file=sys.stderr, flush=True)
    with open(log, "w") as fh, interrupts.deferred():  # a signal here would leave the process behind
        proc = subprocess.Popen(variant.command, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env=full_env)
    try:
        _wait(proc, verify, interrupts)
    finally:
        if proc.poll() is None:  # interrupted or timed out: the run's whole tree goes (SIGTERM, then SIGKILL)
            end_process_tree(proc, 30.0, interrupts)
    variant.returncode = proc.returncode
    variant.attempts.append({"command": variant.command, "env": variant.env, "returncode": proc.returncode,
                             "log": str(log), "status": _read_status(status)})
    return variant


def free_port() -> int:
    """A TCP port free now, for a launched variant's rendezvous (another run on this machine may hold the default)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(proc: subprocess.Popen, verify: Verify, interrupts: Interrupts) -> None:
    deadline = time.monotonic() + verify.timeout
    while proc.poll() is None:
        interrupts.check()
        if time.monotonic() > deadline:
            raise VerifyError(f"a variant ran longer than --timeout {verify.timeout:g} s and was ended; "
                              f"see its log in {verify.output_dir / LOGS_DIR}. Lower --steps or raise --timeout.")
        time.sleep(verify.poll_seconds)


def _read_status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def require_finished(variant: Variant, verify: Verify) -> None:
    """A variant that should have trained to its end did, and wrote its history; else the reason, as an error."""
    attempt = variant.attempts[-1]
    status, log = attempt["status"], attempt["log"]
    if status.get("exit") == 2 or (variant.returncode == 2 and not status):
        said = status.get("message") or _tail(Path(log))
        raise ConfigError(f"{verify.script} refused the flags verify gives each variant ({variant.name}: "
                          f"{' '.join(verify.flags(variant.output_dir))}). verify needs a script that reads its "
                          "TrainConfig from flags (accel_train.parse_config) and passes it to train(). The run said: "
                          f"{said.strip()}")
    if variant.returncode != 0:
        raise VerifyError(f"variant {variant.name} of {verify.script} failed with exit code {variant.returncode} "
                          f"(see {log}): a run that fails cannot be verified; run it once on its own to see why.")
    if not (variant.output_dir / HISTORY).is_file():
        raise VerifyError(f"variant {variant.name} wrote no {HISTORY} in the --output_dir verify gave it "
                          f"({variant.output_dir}): does {verify.script} pass the TrainConfig parse_config returns "
                          "to train() (not an output_dir of its own)?")


def killed(variant: Variant, verify: Verify) -> bool:
    """The variant's last process died of SIGKILL: its exit says so, or (under a launcher, which reports any failure
    as 1) it ended with an error and wrote no status, which every other end through run_cli does."""
    code = variant.returncode
    if code in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return True
    return bool(verify.launch_args) and code not in (0, 2, None) and not variant.attempts[-1]["status"]


def _tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def one_process_side(verify: Verify, batch: int) -> tuple[str, int]:
    """The world-size check's 1-process variant for a per-device training batch `batch`, and the 2 processes'
    per-device batch: the reference itself (at B, against 2 x B/2) when B is even and the check adds no flags of its
    own, else a run of its own, world-size-one (at 2 x B/2, or 2B against 2 x B when B is odd)."""
    per_device = batch // 2 if batch % 2 == 0 else batch
    own = per_device < batch and not verify.world_size_args
    return ("reference" if own else "world-size-one"), per_device


def launch_refused(launch_args: list[str]) -> str | None:
    """Why the world-size check cannot run with these launcher flags (or on this machine), or None."""
    if torch.cuda.device_count() == 1 and "--cpu" not in launch_args:
        return ("one GPU: two processes cannot share it; rerun verify with --launch_args '--cpu' to compare 1 and 2 "
                "processes on CPU (every variant then runs on CPU)")
    named = [a for a in launch_args if a.split("=")[0] in ("--num_processes", "--num-processes", "--config_file",
                                                            "--config-file", "--preset")]
    if named:
        return (f"--launch_args {' '.join(launch_args)} choose the processes ({named[0]}): the check compares 1 "
                "process with 2 by itself; give --launch_args without them (e.g. '--cpu', '--mixed_precision no')")
    return None
