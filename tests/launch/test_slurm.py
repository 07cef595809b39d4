"""SLURM for real: a local cluster (.ci/slurm_local.sh: munged, slurmctld and two slurmd on this machine) runs the
shipped sbatch scripts (accelerate_configs/slurm/) on tests/scripts/toy_train.py. A job requeued by `scontrol requeue`
comes back, resumes where it stopped and ends with bitwise the weights of a job never interrupted, on one node and
on two; a job warned before its time limit saves, stops and requeues itself, and resumes where it stopped.

The time-limit job waits a minute for its warning: it is submitted first and runs beside the one-node requeue job, on
the other node; the two-node job runs after both."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ACCELERATE_CONFIGS, CI, ROOT, SCRIPTS, free_port, subprocess_env, toy_main, toy_records
from test_restarts import same_weights

from accel_train.rundir.checkpoint import list_checkpoints

MISSING = [name for name in ("slurmctld", "slurmd", "munged", "sbatch", "scontrol") if shutil.which(name) is None]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(MISSING), reason=f"{', '.join(MISSING)} not on PATH: the SLURM tests need Debian's SLURM "
                       "(apt-get install -y --no-install-recommends slurmctld slurmd slurm-client)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="the local SLURM's slurmd must run as root"),
]

SINGLE_NODE = ACCELERATE_CONFIGS / "slurm" / "single_node.sbatch"
MULTI_NODE = ACCELERATE_CONFIGS / "slurm" / "multi_node.sbatch"
STEPS = 1500  # about 10 s of training on 2 CPUs: a requeue after the first checkpoint (step 200) lands mid-run
TOY = ["--report_to", "none", "--disable_tqdm", "--max_steps", str(STEPS), "--eval_strategy", "no",
       "--save_strategy", "steps", "--save_steps", "200", "--logging_steps", "200"]
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A two-node SLURM on this machine for this module's tests; stopped afterwards, leaving nothing running."""
    folder = tmp_path_factory.mktemp("slurm")
    script = CI / "slurm_local.sh"
    started = subprocess.run(["bash", str(script), "start", str(folder), "2"], capture_output=True, text=True)
    try:
        assert started.returncode == 0, started.stderr
        yield {"SLURM_CONF": str(folder / "slurm.conf")}
    finally:
        stopped = subprocess.run(["bash", str(script), "stop", str(folder)], capture_output=True, text=True)
        assert stopped.returncode == 0, stopped.stderr


class Job:
    def __init__(self, slurm: dict[str, str], script: Path, output_dir: Path, per_node: int, args: list[str],
                 sbatch: tuple[str, ...] = ()):
        """`script` submitted on toy_train.py (2 CPUs of a GPU-less node per node), writing into `output_dir`."""
        self.output_dir, self.log = output_dir, output_dir.with_suffix(".out")
        self.env = subprocess_env(**slurm, ACCELERATE_USE_CPU="1", ACCEL_TRAIN_RECIPE=str(SCRIPTS / "toy_train.py"),
                                  ACCEL_TRAIN_OUTPUT_DIR=str(output_dir), ACCEL_TRAIN_PROCESSES_PER_NODE=str(per_node),
                                  MAIN_PROCESS_PORT=str(free_port()),
                                  PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
        # --gpus-per-node=0 overrides the scripts' GPU request, which this cluster could never meet
        self.id = self.run("sbatch", "--parsable", "--gpus-per-node=0", "--output", str(self.log), *sbatch,
                           str(script), *args).split(";")[0]

    def run(self, *cmd: str) -> str:
        done = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, f"{' '.join(cmd)}: {done.stderr}"
        return done.stdout.strip()

    def info(self) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Restarts, ...)."""
        return dict(f.split("=", 1) for f in self.run("scontrol", "show", "job", "--oneliner", self.id).split()
                    if "=" in f)

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def wait(self, ready, what: str, timeout: float = 600) -> float:
        """Poll until `ready()`; the seconds it took."""
        start = time.monotonic()
        while not ready():
            if time.monotonic() - start > timeout:
                raise AssertionError(f"job {self.id}: no {what} within {timeout} s; {self.info().get('JobState')}; "
                                     f"log:\n{self.text()[-6000:]}")
            time.sleep(0.2)
        return time.monotonic() - start

    def wait_ended(self) -> dict[str, str]:
        self.wait(lambda: self.info()["JobState"] in ENDED, "end")
        return self.info()


def attempts(log: str) -> list[int]:
    return [int(n) for n in re.findall(r"accel_train on SLURM: job \d+ attempt (\d+)", log)]


def stopped_at(log: str) -> list[int]:
    """The steps at which the run stopped on a SIGTERM with a checkpoint (one line per stop: the main process)."""
    return [int(n) for n in re.findall(r"SIGTERM received: stopped at step (\d+) after saving", log)]


def resumed_at(log: str) -> list[int]:
    """The steps attempts resumed from (each node's first process says it: one per node and resume)."""
    return sorted({int(n) for n in re.findall(r"resumed from \S+ at step (\d+)", log)})


@pytest.fixture(scope="module")
def never_interrupted(ranks, tmp_path_factory):
    """The toy job run whole on 2 processes, what every requeued job must end with: on the session's spawned gloo
    ranks, with the precision the sbatch scripts' launcher sets (fp32); SLURM is not what it is compared for."""
    out = tmp_path_factory.mktemp("reference") / "full"
    ranks.run(toy_main, [*TOY, "--output_dir", str(out), "--resume_from_checkpoint", "auto"],
              env={"ACCELERATE_MIXED_PRECISION": "no"})
    return out


@pytest.fixture(scope="module")
def warned(slurm, tmp_path_factory):
    """The time-limit job, submitted before the one-node requeue job so that the two run side by side on the
    cluster's two nodes: this one spends its first minute waiting for the warning, which no load can hasten."""
    # A real time limit: 2 minutes, and the scripts' warning (SIGUSR1 to the batch shell) 45 s before it, which SLURM
    # sent 46 to 69 s before here (it checks the limits every 30 s): well after the start-up, well before the end. No
    # checkpoint is due in 10**6 steps: a checkpoint is the warning's. The run never ends on its own; the test cancels
    # it once the second attempt has resumed.
    args = ["--report_to", "none", "--disable_tqdm", "--max_steps", str(10**6), "--eval_strategy", "no",
            "--save_strategy", "steps", "--save_steps", str(10**6), "--logging_steps", "1000"]
    job = Job(slurm, SINGLE_NODE, tmp_path_factory.mktemp("warned") / "run", 2, args,
              sbatch=("--time=2", "--signal=B:USR1@45"))
    yield job
    if job.info()["JobState"] not in ENDED:
        job.run("scancel", job.id)


def requeued_by_scontrol(slurm, never_interrupted, output_dir, script, nodes, per_node):
    job = Job(slurm, script, output_dir, per_node, TOY)
    to_checkpoint = job.wait(lambda: bool(list_checkpoints(job.output_dir)), "first checkpoint")
    requeued = time.monotonic()
    job.run("scontrol", "requeue", job.id)  # SIGTERM to every process of the job, then back into the queue
    back = job.wait(lambda: len(attempts(job.text())) == 2, "second attempt")
    info = job.wait_ended()
    log = job.text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-6000:]
    assert info["NumNodes"] == str(nodes)
    assert attempts(log) == [1, 2]  # SLURM_RESTART_COUNT 0, then 1: the same job (id) ran twice
    # the first attempt stopped on the SIGTERM at a step boundary with a checkpoint, before the end, and the second
    # resumed from exactly that step: no whole optimizer step was lost or redone
    stops = stopped_at(log)
    assert len(stops) == 1 and 0 < stops[0] < STEPS, log[-6000:]
    assert resumed_at(log) == stops
    assert "accel_train on SLURM: finished" in log
    # the second attempt trained only the steps after the resume (toy_train records the last attempt's steps)
    records = toy_records(job.output_dir)
    assert sorted(records) == [0, 1] and all(len(r[-1]["indices"]) == STEPS - stops[0] for r in records.values())
    assert same_weights(never_interrupted, job.output_dir)
    print(f"{nodes} node(s) x {per_node}: first checkpoint {to_checkpoint:.0f} s after submission; requeued at step "
          f"{stops[0]}, resumed at step {resumed_at(log)[0]} (0 steps lost); second attempt started {back:.0f} s "
          f"after the requeue, job ended {time.monotonic() - requeued:.0f} s after it; final weights bitwise equal")


def test_a_job_requeued_by_scontrol_comes_back_resumes_and_ends_with_bitwise_the_same_weights_one_node_x2(
        slurm, warned, never_interrupted, tmp_path):
    requeued_by_scontrol(slurm, never_interrupted, tmp_path / "cut", SINGLE_NODE, 1, 2)


def test_warned_before_its_time_limit_a_job_saves_stops_requeues_itself_and_resumes_where_it_stopped(warned):
    job = warned
    try:
        job.wait(lambda: resumed_at(job.text()), "resumed second attempt")
    finally:
        job.run("scancel", job.id)
    info = job.wait_ended()
    log = job.text()
    first = log.split("accel_train on SLURM: job")[1]  # the first attempt's lines
    warning = re.search(r"time limit near \((\d+):(\d+):(\d+)\): SIGTERM to the training processes", first)
    assert warning, first[-6000:]
    stop = stopped_at(first)
    assert len(stop) == 1, first[-6000:]
    assert f"stopped at {list_checkpoints(job.output_dir)[0].name} before the time limit: requeued" in first
    assert list_checkpoints(job.output_dir)[0].name == f"step-{stop[0]:08d}"  # the warning's checkpoint, complete
    assert attempts(log)[:2] == [1, 2] and int(info["Restarts"]) >= 1
    assert resumed_at(log)[0] == stop[0]  # no step lost
    assert not list(job.output_dir.glob("crash_rank*.json"))  # a stop on purpose, not a crash
    began = re.search(r"at (\d+):(\d+):(\d+) on", first)
    after = (seconds(warning) - seconds(began)) % 86400
    print(f"time limit (2 min, warning @45 s): warned {after} s after the attempt began, stopped at step {stop[0]} "
          f"with a checkpoint, requeued, resumed at step {resumed_at(log)[0]} (0 steps lost)")


def test_a_job_requeued_by_scontrol_comes_back_resumes_and_ends_with_bitwise_the_same_weights_two_nodes_x1(
        slurm, never_interrupted, tmp_path):
    """After the time-limit test: this job needs both nodes."""
    requeued_by_scontrol(slurm, never_interrupted, tmp_path / "cut", MULTI_NODE, 2, 1)


def seconds(match: re.Match) -> int:
    hours, minutes, secs = (int(g) for g in match.groups())
    return hours * 3600 + minutes * 60 + secs
