"""Fault-injection seams for the reliability tests, driven by ``ACCEL_TRAIN_FAULT``.

Named points (the value of ``ACCEL_TRAIN_FAULT``):

* ``kill_after_step:<step>`` — SIGKILL the main process once optimizer step <step> is done, before anything of the
  step is logged or saved;
* ``sigterm_after_step:<step>`` — send SIGTERM to this process (every rank) once optimizer step <step> is done, as
  a scheduler's preemption does: the loop saves at the next step boundary and stops;
* ``sigterm_in_finish:<where>`` — send SIGTERM to this process in the finish: ``evaluation`` as the final evaluation
  starts, ``seam`` once the final model is written (before the hooks' on_finish);
* ``kill_during_save:<step>`` — SIGKILL the main process while checkpoint <step> is written: Accelerate's files are
  on disk, the manifest that completes the checkpoint is not;
* ``slow_background_write:<seconds>`` — a background checkpoint write (--async_save) waits this long before it
  writes, as a slow disk does: training goes on several steps meanwhile, so a state copied too late shows;
* ``oom_above:<n>[@<rank>]`` — a micro-batch larger than n runs out of memory (on every rank, or only <rank>) in
  the automatic batch-size probe;
* ``hang_after_step:<step>@<rank>`` — rank <rank> stops answering once step <step> is done (it sleeps, outside any
  collective), as a stuck data loader or a wedged node does; the other ranks wait for it in their next collective.
  It ends on the launcher's SIGTERM (a rank that ignores it costs torch's fixed 30 s before its SIGKILL);
* ``elastic_kill:<seed>:<times>:<span>`` — under torchrun's elastic agent (``accelerate launch --max_restarts``):
  until <times> kills are recorded in the file ``ACCEL_TRAIN_FAULT_LOG`` names (one line each, written before the
  kill: restart count, rank, step, the step the attempt started from), each attempt that trains SIGKILLs one rank,
  drawn from <seed> and the kills so far, after a step drawn from the <span> steps that follow its start.
"""

from __future__ import annotations

import os
import random
import signal
import time

import torch

VARIABLE = "ACCEL_TRAIN_FAULT"


def kill_point(name: str, step: int, main_process: bool) -> None:
    """SIGKILL this (main) process if ``ACCEL_TRAIN_FAULT`` is ``<name>:<step>``."""
    if main_process and os.environ.get(VARIABLE) == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def signal_point(step: int) -> None:
    """SIGTERM this process if ``ACCEL_TRAIN_FAULT`` is ``sigterm_after_step:<step>``."""
    if os.environ.get(VARIABLE) == f"sigterm_after_step:{step}":
        os.kill(os.getpid(), signal.SIGTERM)


def finish_signal_point(where: str) -> None:
    """SIGTERM this process if ``ACCEL_TRAIN_FAULT`` is ``sigterm_in_finish:<where>``."""
    if os.environ.get(VARIABLE) == f"sigterm_in_finish:{where}":
        os.kill(os.getpid(), signal.SIGTERM)


def slow_write_point() -> None:
    """Sleep if ``ACCEL_TRAIN_FAULT`` is ``slow_background_write:<seconds>``."""
    fault = os.environ.get(VARIABLE, "")
    if fault.startswith("slow_background_write:"):
        time.sleep(float(fault.split(":", 1)[1]))


def oom_point(batch_size: int, rank: int) -> None:
    """Raise an out-of-memory error if ``ACCEL_TRAIN_FAULT`` is ``oom_above:<n>[@<rank>]`` and batch_size > n."""
    fault = os.environ.get(VARIABLE, "")
    if not fault.startswith("oom_above:"):
        return
    limit, _, only = fault.split(":", 1)[1].partition("@")
    if batch_size > int(limit) and (not only or int(only) == rank):
        raise torch.OutOfMemoryError(f"injected: micro-batch {batch_size} > {limit}")


_attempt_start: list[int] = []  # the first step this process finished: where its attempt started from


def peer_fault_point(step: int, rank: int) -> None:
    """The faults of one rank among several: a hang, or a kill under the elastic agent (module docstring)."""
    fault = os.environ.get(VARIABLE, "")
    if fault.startswith("hang_after_step:"):
        at, _, only = fault.split(":", 1)[1].partition("@")
        if step == int(at) and rank == int(only or 0):
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(3600)
    elif fault.startswith("elastic_kill:"):
        seed, times, span = (int(x) for x in fault.split(":")[1:])
        log = os.environ["ACCEL_TRAIN_FAULT_LOG"]
        if not _attempt_start:  # once per process: its start and the kills before it
            kills = len(open(log).read().splitlines()) if os.path.exists(log) else 0
            rng = random.Random(seed * 1000 + kills)
            victim = rng.randrange(int(os.environ.get("WORLD_SIZE", "1")))
            _attempt_start.extend([step - 1, kills, victim, step - 1 + rng.randint(1, span)])
        start, kills, victim, at = _attempt_start
        if kills < times and rank == victim and step == at:
            with open(log, "a") as out:
                out.write(f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')} {rank} {step} {start}\n")
            os.kill(os.getpid(), signal.SIGKILL)
