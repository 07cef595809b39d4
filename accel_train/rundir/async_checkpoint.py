"""--async_save: a checkpoint written while training goes on.

At the save step, every process writes what is small and its own (its random states, its loader's position, what
`rank_files` adds) and the main process copies what is large (the weights, the optimizer's and the scheduler's
state, a loss scaler's, objects registered for checkpointing) into memory; training then continues while a
background thread writes the copies with Accelerate's own writer (`save_accelerator_state`: the files and names
`load_state` reads), then train_state.json, the manifest, and the rename that makes the checkpoint visible: the same
directory a synchronous save writes, from the state of the same step. A kill at any point of the write leaves a
`.tmp-` directory, which `latest` never takes and the next rotation removes; the checkpoints before it stay.

Only the main process writes in the background, so no collective runs outside the training thread. One write at a
time: the next save, the end of training, a SIGTERM's save and a spike rollback wait for the pending one first, and
only then are its errors raised (agreed by every process), old checkpoints rotated and the on_save hooks called.
Not under FSDP or DeepSpeed: their engines write sharded state themselves, collectively (refused with the reason).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from ..errors import CheckpointError, ConfigError
from ..testing import faults
from . import checkpoint as ckpt
from .final_model import write_pretrained_files

# the background writer's own random-states file: Accelerate's writer always writes one, of the moment it runs; the
# checkpoint's are the ones every process wrote at the step, so this one is deleted before the manifest
LATE_RANDOM_STATES = "random_states_background.pkl"


@dataclasses.dataclass
class Frozen:
    """A state dict copied at the save step, in the place of the object Accelerate's writer asks for it."""

    state: Any

    def state_dict(self) -> Any:
        return self.state


def refuse_async(accelerator: Accelerator) -> None:
    engine = accelerator.distributed_type.value
    if engine in ("FSDP", "DEEPSPEED"):
        raise ConfigError(f"--async_save under {engine}: the engine writes its sharded state itself, collectively "
                          "across the processes, so it cannot be written from a copy in the background. Drop "
                          "--async_save (checkpoints are then written synchronously), or train under DDP or on one "
                          "device.")
    if accelerator.project_configuration.save_on_each_node:
        raise ConfigError("--async_save with save_on_each_node: only the main process writes in the background. "
                          "Drop one of them.")
    if getattr(accelerator, "_save_model_state_pre_hook", None):  # they would run on the copies, later
        raise ConfigError("--async_save with a save_state pre-hook (accelerator.register_save_state_pre_hook): "
                          "drop --async_save, or the hook.")


def copied(tree: Any, into: Any = None, memo: dict | None = None) -> Any:
    """A copy of a nested state (dicts, lists, tuples, tensors, plain values). A tensor is copied into `into`'s tensor
    at the same place when that has its shape, dtype and device (the previous save's copy, written and released by
    now): memory that is already mapped, which a fresh copy would first have to fault in (measured on MiniLM: most of
    the step's copy time). Tensors that are one view of the same memory (tied weights: a language model's embedding
    and its head) stay one tensor in the copy, so that Accelerate's writer keeps one name of them, as it does
    writing the live state (an OrderedDict, as a state dict is: the type its writer looks for tied names in; two
    separate copies would both be written, and load_state refuses the second)."""
    memo = {} if memo is None else memo
    if torch.is_tensor(tree):
        dense = tree.layout == torch.strided and tree.numel() > 0 and tree.device.type != "meta"
        view = (tree.device, tree.untyped_storage().data_ptr(), tree.storage_offset(), tree.shape, tree.stride(),
                tree.dtype) if dense else id(tree)
        if view not in memo:
            same = torch.is_tensor(into) and (into.shape, into.dtype, into.device) == (tree.shape, tree.dtype,
                                                                                        tree.device)
            memo[view] = into.copy_(tree.detach()) if same else tree.detach().clone()
        return memo[view]
    if isinstance(tree, dict):
        into = into if isinstance(into, dict) else {}
        items = {k: copied(v, into.get(k), memo) for k, v in tree.items()}
        return OrderedDict(items) if isinstance(tree, OrderedDict) else items  # a state dict, as Accelerate reads it
    if isinstance(tree, (list, tuple)):
        into = into if isinstance(into, (list, tuple)) and len(into) == len(tree) else [None] * len(tree)
        items = [copied(v, w, memo) for v, w in zip(tree, into, strict=True)]
        if isinstance(tree, list):
            return items
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)  # a namedtuple, or a tuple
    return copy.deepcopy(tree)


def snapshot_state(accelerator: Accelerator, previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """Copies of what Accelerate's save_state writes from the main process, taken now (into `previous`'s tensors
    where they fit)."""
    previous = previous or {}
    states = {"weights": [accelerator.get_state_dict(m, unwrap=False) for m in accelerator._models],
              "optimizers": [o.state_dict() for o in accelerator._optimizers],
              "schedulers": [s.state_dict() for s in accelerator._schedulers],
              "scaler": accelerator.scaler.state_dict() if accelerator.scaler is not None else None,
              "custom": [o.state_dict() for o in accelerator._custom_objects]}
    copies = {name: copied(state, previous.get(name)) for name, state in states.items()}
    return {**copies, "optimizers": [Frozen(o) for o in copies["optimizers"]],
            "schedulers": [Frozen(o) for o in copies["schedulers"]], "custom": [Frozen(o) for o in copies["custom"]],
            "scaler": Frozen(copies["scaler"]) if copies["scaler"] is not None else None, "raw": copies}


class CheckpointWriter:
    """Writes the run's checkpoints, synchronously or (--async_save) in the background; `settle()` returns what
    landed since it was last called."""

    def __init__(self, accelerator: Accelerator, asynchronous: bool, model: torch.nn.Module | None = None,
                 processing_class: Any = None, *rank_parts: Any):
        """With the prepared `model`, the main process adds a transformers model's config.json and its tokenizer
        (`processing_class`) to each checkpoint before the manifest, so that every checkpoint loads with
        from_pretrained. `rank_parts`: objects whose save(folder) every process calls in each checkpoint (a
        stream's position, the weight average; None: absent)."""
        if asynchronous:
            refuse_async(accelerator)
        self.accelerator, self.asynchronous = accelerator, asynchronous
        self.rank_parts = [part for part in rank_parts if part is not None]
        self.model, self.processing_class = model, processing_class
        self.landed: list[tuple[Path, Any]] = []  # (checkpoint, the state it was written from), for on_save
        self.thread: threading.Thread | None = None
        self.pending: tuple[Path, Any] | None = None
        self.error: BaseException | None = None
        self.buffers: dict[str, Any] | None = None  # the last copy's tensors (main process)

    def extra_files(self, folder: Path) -> None:
        if self.model is not None:
            write_pretrained_files(self.accelerator, self.model, folder, self.processing_class,
                                   weights_follow=self.asynchronous)

    def rank_files(self, folder: Path) -> None:
        for part in self.rank_parts:
            part.save(folder)

    def write(self, output_dir: str | Path, step: int, state: Any, shapes: dict) -> None:
        """Checkpoint `step` (every process calls it). Synchronous: written when it returns. Asynchronous: started;
        call settle() first (one write at a time, and rotation must not run during one)."""
        if not self.asynchronous:
            path = ckpt.save_checkpoint(self.accelerator, output_dir, step, dataclasses.asdict(state), shapes,
                                        extra_files=self.extra_files, rank_files=self.rank_files)
            self.landed.append((path, state))
            return
        assert self.thread is None, "settle() the pending checkpoint before writing the next"
        acc = self.accelerator
        final, tmp = ckpt.open_checkpoint(acc, output_dir, step)
        error = None
        try:  # every process: its random states and loader position (Accelerate's writer, no model: small)
            from accelerate.checkpointing import save_accelerator_state

            save_accelerator_state(str(tmp), [], [], [], acc._dataloaders, acc.process_index, acc.step, None)
            self.rank_files(tmp)
            if acc.is_main_process:
                train_state = json.dumps(dataclasses.asdict(state), indent=2)  # a state JSON cannot hold: agreed
                self.extra_files(tmp)
                copies = snapshot_state(acc, self.buffers)
                self.buffers = copies["raw"]  # reused by the next save, once this write is done
        except Exception as err:  # noqa: BLE001 - agreed below: the other processes must not wait for this one
            error = err
        if ckpt.any_rank(acc, error is not None):  # also the barrier: every process's part is on disk
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(f"could not write checkpoint {final}: {ckpt.why_not_written(error)}") from error
        snapshot = copy.deepcopy(state)  # on_save gets it when the write lands: the lists the loop goes on changing too
        if acc.is_main_process:
            self.thread = threading.Thread(target=self._background, name=f"accel_train-save-{step}", args=(
                tmp, final, step, copies, train_state, shapes, acc.num_processes, acc.step))
            self.thread.start()
        self.pending = (final, snapshot)

    def _background(self, tmp: Path, final: Path, step: int, copies: dict, train_state: str, shapes: dict,
                    world_size: int, accelerator_step: int) -> None:
        from accelerate.checkpointing import save_accelerator_state, save_custom_state

        try:
            faults.slow_write_point()
            save_accelerator_state(str(tmp), copies["weights"], copies["optimizers"], copies["schedulers"], [],
                                   "background", accelerator_step, copies["scaler"])
            (tmp / LATE_RANDOM_STATES).unlink()
            for i, obj in enumerate(copies["custom"]):
                save_custom_state(obj, str(tmp), i)
            faults.kill_point("kill_during_save", step, True)
            (tmp / ckpt.TRAIN_STATE).write_text(train_state)
            ckpt.write_manifest(tmp, step, shapes, world_size)
            failed = ckpt.publish(tmp, final)
            if failed is not None:
                raise failed
        except BaseException as err:  # noqa: BLE001 - kept for settle() to raise on the training thread
            shutil.rmtree(tmp, ignore_errors=True)
            self.error = err

    def wait_alone(self) -> str | None:
        """On an error's way out: let the pending background write finish on this process, without settle()'s
        collective (a peer may be gone), so that a checkpoint an error's message names is on disk before the process
        ends; None where it landed (or none was pending), else what to tell the user. It can be asked again."""
        if self.pending is None:
            return None
        if self.thread is not None:
            self.thread.join()
        if self.error is None:
            return None
        return (f"accel_train: checkpoint {self.pending[0]}, written in the background (--async_save), was not "
                f"written: {ckpt.why_not_written(self.error)}")

    def settle(self) -> list[tuple[Path, Any]]:
        """Wait for the pending write (every process calls it); raise its error, agreed by every process; return
        the checkpoints that landed since the last call, with the states they were written from."""
        if self.pending is not None:
            if self.thread is not None:
                self.thread.join()
            error, self.error, self.thread = self.error, None, None
            final, state = self.pending
            self.pending = None
            if ckpt.any_rank(self.accelerator, error is not None):
                raise CheckpointError(f"could not write checkpoint {final} (in the background, --async_save): "
                                      f"{ckpt.why_not_written(error)}") from error
            self.landed.append((final, state))
        landed, self.landed = self.landed, []
        return landed
