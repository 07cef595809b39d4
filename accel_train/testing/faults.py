"""Fault-injection seams for the reliability tests, driven by ``ACCEL_TRAIN_FAULT``.

Named points (the value of ``ACCEL_TRAIN_FAULT``):

* ``kill_after_step:<step>`` — SIGKILL the main process once optimizer step <step> is done, before anything of the
  step is logged or saved;
* ``kill_during_save:<step>`` — SIGKILL the main process while checkpoint <step> is written: Accelerate's files are
  on disk, the manifest that completes the checkpoint is not;
* ``oom_above:<n>[@<rank>]`` — a micro-batch larger than n runs out of memory (on every rank, or only <rank>) in
  the automatic batch-size probe.
"""

from __future__ import annotations

import os
import signal

import torch

VARIABLE = "ACCEL_TRAIN_FAULT"


def kill_point(name: str, step: int, main_process: bool) -> None:
    """SIGKILL this (main) process if ``ACCEL_TRAIN_FAULT`` is ``<name>:<step>``."""
    if main_process and os.environ.get(VARIABLE) == f"{name}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def oom_point(batch_size: int, rank: int) -> None:
    """Raise an out-of-memory error if ``ACCEL_TRAIN_FAULT`` is ``oom_above:<n>[@<rank>]`` and batch_size > n."""
    fault = os.environ.get(VARIABLE, "")
    if not fault.startswith("oom_above:"):
        return
    limit, _, only = fault.split(":", 1)[1].partition("@")
    if batch_size > int(limit) and (not only or int(only) == rank):
        raise torch.OutOfMemoryError(f"injected: micro-batch {batch_size} > {limit}")
