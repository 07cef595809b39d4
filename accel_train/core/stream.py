"""A stream's position in a checkpoint: an iterable dataset resumes where it was, without re-reading.

A map-style dataset resumes by skipping the batches its sampler would give again: indices, no data read. A stream has
no indices, so skipping means reading and dropping everything before the position, which grows with the position
(156 s at 10^6 samples of a parquet stream here). A stream that can say where it is (`state_dict()` /
`load_state_dict()`: a `datasets.IterableDataset` keeps a shard and an example within it, in each loader worker) is
loaded instead by torchdata's StatefulDataLoader, through Accelerate; each process writes its loader's position into
the checkpoint, and a resumed run's loader starts there.

    position = StreamPosition.of(train_loader, config, accelerator.num_processes)  # None: not such a stream
    with stateful_loaders(accelerator, position is not None):
        ... = accelerator.prepare(model, optimizer, train_loader, scheduler)
    position.attach(prepared_loader, accelerator.process_index)
    position.save(checkpoint_folder)            # every process, with each checkpoint
    position.restore(checkpoint_folder, ...)    # on resume: True when the loader now starts at the saved position

A resume on a different number of processes is refused, with the reason (each process reads its own shards). A
stream whose position would not bring it back exactly resumes by re-reading instead, exactly, and the resume says so:
a shuffle buffer (datasets does not save its content: a loaded position would lose up to `buffer_size` examples and
repeat others; re-read, the buffer refills as it did, seeded by (seed, epoch)), a plain torch IterableDataset (no
position), and a `datasets` stream with fewer shards than processes (Accelerate splits it by reading all of it in
every process).
"""

from __future__ import annotations

import pickle
import re
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils.data import IterableDataset

from ..errors import CheckpointError
from ..rundir.layout import stream_position_file


class StreamPosition:
    """The training loader's position, saved per process with each checkpoint and restored on resume."""

    def __init__(self) -> None:
        self.loader, self.process_index = None, 0

    @classmethod
    def of(cls, loader, config, num_processes: int) -> StreamPosition | None:
        """A StreamPosition for a training loader over a stream that can save its position, else None (a resume
        inside an epoch re-reads): a shuffle buffer's content is in no position datasets saves (a resume that loaded
        the position would lose up to a buffer of examples and repeat others), so a shuffled stream re-reads."""
        dataset = getattr(loader, "dataset", None)
        if not isinstance(dataset, IterableDataset):
            return None
        buffer = shuffle_buffer(dataset)
        if buffer is None or buffer > 1:  # unreadable, or a buffer: its content is in no saved position
            return None  # re-read: the buffer refills as it did, seeded by (seed, epoch), and the order replays
        if not (callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))):
            return None
        if num_processes > 1 and getattr(dataset, "n_shards", 0) < num_processes:
            return None  # Accelerate gives each process a share of the whole stream (IterableDatasetShard): re-read
        return cls()

    def attach(self, loader, process_index: int) -> None:
        """Keep the prepared loader. Accelerate's save_state would write every process's loader state into one file
        (the last writer wins, and every process would load that one): this class saves them per process instead."""
        loader.use_stateful_dataloader = False  # read by Accelerate's save_state / load_state only
        # Accelerate asked the new loader for its state_dict(), which made StatefulDataLoader start an iterator
        # (and its workers) with the dataset as it is now, and keep it for the first iteration: a run resumed at
        # epoch 2 would read epoch 0's shard order. Loading an empty state drops that iterator.
        loader.load_state_dict({})
        self.loader, self.process_index = loader, process_index

    def save(self, folder: Path) -> None:
        """Write this process's loader position into the checkpoint folder (every process, before the manifest)."""
        torch.save(self.loader.state_dict(), folder / stream_position_file(self.process_index))

    def restore(self, folder: Path, num_processes: int, batch_in_epoch: int) -> bool:
        """Load the position saved with checkpoint `folder`; False when the checkpoint is at an epoch's start
        (a new epoch starts from the beginning anyway) or holds no position (saved before: re-read instead)."""
        if batch_in_epoch == 0:
            return False
        saved = len(list(folder.glob(stream_position_file("*"))))  # counted by every process, which all see them
        if saved and saved != num_processes:  # (a process without a file of its own went on alone before: a hang)
            raise CheckpointError(
                f"{folder} holds the stream positions of {saved} process(es), this run has {num_processes}: each "
                f"process reads its own shards of the stream, so the position cannot carry over. Resume on "
                f"{saved} process(es), or from a checkpoint at an epoch's end.")
        path = folder / stream_position_file(self.process_index)
        if not path.is_file():
            return False
        self.loader.load_state_dict(_load_position(path))
        return True


def _load_position(path: Path) -> dict:
    """A saved loader position: plain Python data (dicts, lists, numbers, strings; tensors allowed), loaded with
    `weights_only=True`. The manifest's SHA-256 proves only that the file is the one written with the checkpoint,
    not who wrote it, and a full unpickle of a crafted file would run whatever call it holds."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as err:
        named = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        what = named.group(1) if named else str(err).splitlines()[0]
        raise CheckpointError(
            f"{path}: not a loader position accel_train wrote: it holds {what}, not plain data, and unpickling it "
            f"could run code, so it is not loaded. Resume from another checkpoint (--resume_from_checkpoint "
            f"{path.parent.parent}/step-N).") from None


def rereading_notes(loader, batch_in_epoch: int, restored: bool) -> list[str]:
    """What a resume says when a stream resumes inside an epoch by re-reading what it had consumed."""
    if restored or not batch_in_epoch or not isinstance(getattr(loader, "dataset", None), IterableDataset):
        return []
    return [f"the training stream resumes by re-reading, not from a saved position (a shuffle buffer, whose content no "
            f"position holds; no state_dict(); or fewer shards than processes): it re-reads the {batch_in_epoch} "
            "batches of this epoch it had consumed, which takes time in proportion"]


def idle_worker_notes(loader) -> list[str]:
    """A `datasets` stream gives each loader worker whole shards: workers beyond its shards read nothing (a shuffled
    stream of few files may report one shard, huggingface/datasets#8669)."""
    shards = getattr(getattr(loader, "dataset", None), "n_shards", None)
    workers = getattr(loader, "num_workers", 0)
    if not isinstance(shards, int) or workers <= shards:
        return []
    return [f"the training stream has {shards} shard(s) for {workers} loader workers: {workers - shards} of them get "
            "no shard and read nothing (datasets gives each worker whole shards). Use at most "
            f"{shards} worker(s), or write the data as more files"]


@contextmanager
def stateful_loaders(accelerator, on: bool):
    """With `on`, Accelerate builds the loaders of a `prepare` call inside this block as StatefulDataLoaders."""
    config = accelerator.dataloader_config
    before = config.use_stateful_dataloader
    config.use_stateful_dataloader = before or on
    try:
        yield
    finally:
        config.use_stateful_dataloader = before


def shuffle_buffer(dataset) -> int | None:
    """The shuffle buffer size of a `datasets.IterableDataset` (0: none), found along its chain of iterables; None
    when it is one but the chain is not where datasets kept it (a version accel_train was not checked with)."""
    if type(dataset).__module__.startswith("datasets.") and not hasattr(dataset, "_ex_iterable"):
        return None
    node, size = getattr(dataset, "_ex_iterable", None), 0
    while node is not None:
        size = max(size, getattr(node, "buffer_size", 0) or 0)
        node = getattr(node, "ex_iterable", None)
    return size


def end_loader_workers(loader) -> None:
    """End the worker processes of a training pass that stopped mid-epoch (--max_steps, a hook's stop), once its last
    checkpoint is written. A stateful loader keeps its iterator, and with it the workers, until the loader is
    garbage-collected; torchdata's shutdown run from inside Python's cycle collector cannot flush the workers' queues
    and waits 5 s per worker before killing it (a 2-worker stream run's teardown: 10 s, here 0.03 s)."""
    base = getattr(loader, "base_dataloader", loader)
    shutdown = getattr(getattr(base, "_iterator", None), "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
        base._iterator = None
