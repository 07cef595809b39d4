"""Which training examples each process fed: the record `accel-train verify`'s data-accounting check reads.

Opt-in, free when off: with ACCEL_TRAIN_RECORD_FED=1 in the environment (verify sets it on its variants) train() adds
a `FedRecorder` hook, which appends JSON lines to output_dir/diagnostics/fed_rank<R>.jsonl:

    {"plan": E, "batches": [[i, ...], ...], "dataset_length": N, "num_processes": W, "batch_size": B,
     "drop_last": bool}                 the dataset indices of every micro-batch of epoch E on this process, in order
                                        (epoch 0 with ACCEL_TRAIN_UNEQUAL_FIRST_STEP=1: "first_step_lengths", the
                                        lengths of the first optimizer step's examples in the order fed)
    {"step": S, "segments": [[E, P0, P1], ...], "rows": R}
                                        the micro-batches fed since the last record (positions P0..P1-1 of epoch E's
                                        plan) and the rows they held when they reached the loss; the first record of
                                        a process has "start": [E, P, S] (epoch, micro-batches consumed, step)
    {"probe": {...}}                    main process, at the end: what dataset[len(dataset)] and the last index gave

The plan is the prepared loader's batch sampler replayed for the epoch (its order is a function of (seed, epoch):
Accelerate's seedable sampler, the length-grouped one), with the samplers' epochs and the global generators put back,
and the probe runs after training: recording changes nothing the run computes. A stream has no indices: its records
hold rows only.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from ..core.data import sampler_chain
from ..rundir.layout import DIAGNOSTICS_DIR

VARIABLE = "ACCEL_TRAIN_RECORD_FED"
FED_FILE = "fed_rank{rank}.jsonl"


def fed_recorder(session: Any) -> list:
    """[a FedRecorder for the session's training loader] when ACCEL_TRAIN_RECORD_FED=1, else []."""
    if os.environ.get(VARIABLE) != "1":
        return []
    return [FedRecorder(session.train_loader, session.accelerator, session.config)]


def fed_file(output_dir: Path | str, rank: int) -> Path:
    return Path(output_dir) / DIAGNOSTICS_DIR / FED_FILE.format(rank=rank)


class FedRecorder:
    """The hook that writes fed_rank<R>.jsonl (module docstring). It logs at each logging step: the micro-batches
    consumed since the last one (the loop's data position) and the rows they held (the examples the loop counted)."""

    def __init__(self, loader: Any, accelerator: Any, config: Any):
        self.loader, self.config = loader, config
        self.world, self.main = accelerator.num_processes, accelerator.is_main_process
        self.path = fed_file(config.output_dir, accelerator.process_index)
        self.plans: dict[int, int | None] = {}  # epoch -> its number of micro-batches on this process (None: a stream)
        self.position, self.seen = (0, 0), 0
        self.start: list[int] | None = None  # [epoch, micro-batches of it consumed, step] where this process began

    def on_train_start(self, state) -> None:
        # written with the first step's record: on a fresh start the main process clears diagnostics/ in its own
        # on_train_start, which another rank's may precede
        self.start = [state.epoch, state.batch_in_epoch, state.step]
        self.position, self.seen = (state.epoch, state.batch_in_epoch), state.samples_seen

    def on_log(self, state, logs) -> None:
        epoch, first = self.position
        segments = []
        while epoch < state.epoch:  # the interval ended an epoch (or more): the rest of it was fed
            segments.append([epoch, first, self._plan_length(epoch)])
            epoch, first = epoch + 1, 0
        if state.batch_in_epoch > first:
            self._plan_length(epoch)
            segments.append([epoch, first, state.batch_in_epoch])
        # samples_seen counts each micro-batch's rows times the processes (loop.py): this process's rows
        record = {"step": state.step, "segments": segments, "rows": (state.samples_seen - self.seen) // self.world}
        if self.start is not None:
            record["start"], self.start = self.start, None
        self._write(record)
        self.position, self.seen = (state.epoch, state.batch_in_epoch), state.samples_seen

    def on_train_end(self, state, metrics) -> None:
        if self.main:
            self._write({"probe": probe_length(self.loader.dataset)})

    def _plan_length(self, epoch: int) -> int | None:
        """Record epoch `epoch`'s plan once per process run; its number of micro-batches."""
        if epoch not in self.plans:
            batches = replay_epoch(self.loader, epoch)
            self.plans[epoch] = None if batches is None else len(batches)
            if batches is not None:
                record = {"plan": epoch, "batches": batches, "dataset_length": len(self.loader.dataset),
                          "num_processes": self.world, "batch_size": self.config.per_device_train_batch_size,
                          "drop_last": bool(self.config.dataloader_drop_last)}
                chosen = next((sampler.first_step_lengths for sampler in _sampler_chain(self.loader.batch_sampler)
                               if hasattr(sampler, "first_step_lengths")), None)  # core/data.py: UnequalFirstStep
                if epoch == 0 and chosen is not None:
                    record["first_step_lengths"] = chosen
                self._write(record)
        return self.plans[epoch]

    def _write(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as fh:  # a line at a time: a killed run keeps what it fed
            fh.write(json.dumps(record) + "\n")


def replay_epoch(loader: Any, epoch: int) -> list[list[int]] | None:
    """This process's micro-batches of epoch `epoch` as dataset indices: the prepared loader's batch sampler iterated
    with every sampler in it set to the epoch, then put back as it was (Accelerate's seedable sampler moves its epoch
    on when an iteration ends). None for a stream (no indices)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is None or isinstance(getattr(loader, "dataset", None), IterableDataset):
        return None
    samplers = _sampler_chain(batch_sampler)
    epochs = [(sampler, sampler.epoch) for sampler in samplers]
    with _global_generators_kept():
        try:
            for sampler, _ in epochs:
                sampler.epoch = epoch
            iterator = iter(batch_sampler)
            batches = [[int(i) for i in batch] for batch in itertools.islice(iterator, len(batch_sampler))]
            getattr(iterator, "close", lambda: None)()
        finally:
            for sampler, value in epochs:
                sampler.epoch = value
    return batches


def _sampler_chain(batch_sampler: Any) -> list[Any]:
    """The samplers inside a (sharded) batch sampler that keep an integer epoch."""
    return [sampler for sampler in sampler_chain(batch_sampler) if isinstance(getattr(sampler, "epoch", None), int)]


@contextlib.contextmanager
def _global_generators_kept():
    """torch's, numpy's and Python's global generators as they were before the block."""
    numpy_state, python_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            np.random.set_state(numpy_state)
            random.setstate(python_state)


def probe_length(dataset: Any) -> dict:
    """What the sequence protocol says of the dataset's __len__: item len(dataset) must raise (IndexError) and item
    len(dataset) - 1 must load. An item at len(dataset) means the data holds more than __len__ says (the sampler never
    draws the items past it) or __getitem__ wraps indices around."""
    try:
        length = len(dataset)
    except TypeError:
        return {"dataset_length": None}
    found: dict[str, Any] = {"dataset_length": length, "dataset_class": type(dataset).__name__}
    with _global_generators_kept():
        found["item_at_length"] = _loads(dataset, length)
        found["last_item"] = _loads(dataset, length - 1) if length > 0 else None
    return found


def _loads(dataset: Any, index: int) -> str | bool:
    """True when dataset[index] returned, else the error it raised ("IndexError: ...")."""
    try:
        dataset[index]
    except Exception as error:  # noqa: BLE001 - the error is the finding, reported by name
        return f"{type(error).__name__}: {error}"[:200]
    return True
