"""Data loaders for the loop: worker settings, per-worker seeding, and length-grouped batches.

Shuffling uses a plain RandomSampler, which `accelerator.prepare` swaps for its seedable sampler; the
length-grouped sampler here reseeds itself from (seed, epoch) for the same reason: the data order of any
epoch can be replayed exactly on resume.
"""

from __future__ import annotations

import functools
import os
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler
from transformers.trainer_pt_utils import get_length_grouped_indices

from ..config import TrainConfig
from ..errors import ConfigError
from .seeding import data_seed, seeded_generator
from .token_batches import FLAG as TOKEN_FLAG
from .token_batches import TokenBudgetBatchSampler, lengths_checksum, resolve_token_budget

# A packed batch (several sequences per row, told apart by position ids restarting at 0, no attention mask) carries
# its count of non-padding tokens under this key: nothing else in it says where the row-end padding is.
REAL_TOKENS = "real_tokens"


def take_real_tokens(batch):
    """The batch's non-padding tokens, removed from the batch when it carried them as `REAL_TOKENS` (they are no
    model input); else its attention mask's sum, left on the device (no sync) until the meter reports; else 0."""
    if not isinstance(batch, Mapping):
        return 0
    if REAL_TOKENS in batch:
        return batch.pop(REAL_TOKENS)
    mask = batch.get("attention_mask")
    return mask.sum() if isinstance(mask, torch.Tensor) else 0


# A batch whose rows are not its examples (padding-free: one row of all of them) carries their count under this key,
# for samples/s; the data position counts micro-batches, so it never depends on what a batch's rows hold.
EXAMPLES = "num_examples"


def take_examples(batch, rows: int) -> int:
    """The examples a micro-batch holds: the count it carried as `EXAMPLES` (removed: no model input), else `rows`."""
    if isinstance(batch, Mapping) and EXAMPLES in batch:
        return int(batch.pop(EXAMPLES))
    return rows


def seed_worker(worker_id: int, rank: int = 0) -> None:
    """Give each worker of each process its own reproducible seed, for torch, numpy and `random`.

    torch seeds a worker with (base seed + worker id), the base seed drawn from the loader's generator. The
    loop seeds that generator from (seed, epoch) alike on every process, so that data order replays on
    resume; without the process rank mixed in, worker k of every process would draw the same augmentations.
    """
    seed = int(np.random.SeedSequence([torch.initial_seed(), rank]).generate_state(1, dtype=np.uint64)[0])
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


class SeededItems(Dataset):
    """A map-style dataset whose items draw their randomness from (seed, epoch, index) alone.

    A dataset that augments in `__getitem__` with torch's, numpy's or Python's global random generators draws
    numbers that depend on what was drawn before: in another loader worker, after a resume (the workers restart, the
    loader prefetches), on another number of processes, each item gets other numbers, so a resumed run is not
    bitwise the uninterrupted one. Wrapped, each item is fetched with the three generators seeded from (seed, epoch,
    index) and put back afterwards: the same item of the same epoch is the same tensor in any worker, process or
    resumed run, and the step's own draws (dropout) are left where they were. The loop sets the epoch.

        train_set = SeededItems(MyAugmentedImages(...), seed=config.seed)
    """

    def __init__(self, dataset: Dataset, seed: int = 0):
        self.dataset, self.seed = dataset, seed
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()  # seen by persistent workers too

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        seed = int(np.random.SeedSequence([self.seed, int(self.epoch), int(index)]).generate_state(1, np.uint64)[0])
        numpy_state, python_state = np.random.get_state(), random.getstate()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            np.random.seed(seed % 2**32)
            random.seed(seed)
            try:
                return self.dataset[index]
            finally:
                np.random.set_state(numpy_state)
                random.setstate(python_state)


def global_rng_draws(dataset) -> list[str]:
    """The global generators (torch, numpy, random) that fetching item 0 of a map-style dataset draws from: a
    dataset that augments with them cannot resume bitwise (SeededItems). Their states are put back afterwards."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        return []
    try:
        if len(dataset) == 0:
            return []
    except TypeError:
        return []
    numpy_state, python_state = np.random.get_state(), random.getstate()
    with torch.random.fork_rng(devices=[]):
        torch_state = torch.get_rng_state()
        try:
            dataset[0]
        except Exception:  # noqa: BLE001 - a broken item is the pre-flight's and the loop's to report, not this probe's
            return []
        finally:
            drawn = [name for name, changed in (
                ("torch", not torch.equal(torch_state, torch.get_rng_state())),
                ("numpy", not _same_numpy_state(numpy_state, np.random.get_state())),
                ("random", python_state != random.getstate())) if changed]
            np.random.set_state(numpy_state)
            random.setstate(python_state)
    return drawn


def random_item_notes(loader) -> list[str]:
    """What the start-up report says of a training set whose items draw from the global generators."""
    drawn = global_rng_draws(getattr(loader, "dataset", None))
    if not drawn:
        return []
    return [f"the training set's items draw from the global random generator(s) of {', '.join(drawn)} (checked on "
            "item 0): their random augmentation depends on the loader's workers and on what was drawn before, so a "
            "resumed run, a rollback or another number of processes is not bitwise the uninterrupted run. Wrap the "
            "dataset in accel_train.SeededItems(dataset, seed) to draw each item's numbers from (seed, epoch, index)"]


def _same_numpy_state(a, b) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


class LengthGroupedSampler(Sampler[int]):
    """Random order, but each run of `group_size` consecutive indices has similar lengths, which cuts
    padding. Group by the optimizer step's *global* batch (per-device batch x processes x accumulation steps, as
    the Trainer does): the processes then split a group of similar lengths between them, N processes see the
    batches one process with N times the batch would see, and k accumulated micro-batches of B hold the examples
    one batch of kB holds (grouped by the micro-batch, the megabatches and the longest-first swap would differ).
    Uses transformers' `get_length_grouped_indices`, reseeded from (seed, epoch)."""

    def __init__(self, lengths: Sequence[int], group_size: int, seed: int = 0):
        self.lengths = list(lengths)
        self.group_size = group_size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self):
        generator = seeded_generator(self.seed, self.epoch)
        return iter(get_length_grouped_indices(self.lengths, self.group_size, generator=generator))


# =1 (accel-train verify sets it on every variant): the first optimizer step of the first epoch holds the training
# set's shortest and longest examples, ordered by length, so its micro-batches and processes hold the most unequal
# token counts the data has (UnequalFirstStep). Only where the loader knows the lengths (make_loader's `lengths`).
UNEQUAL_VARIABLE = "ACCEL_TRAIN_UNEQUAL_FIRST_STEP"


class UnequalFirstStep(Sampler[int]):
    """`sampler`'s order, but epoch 0 begins with one optimizer step's `window` examples (per-device batch x processes
    x accumulation) chosen and ordered by length: the window // 2 shortest of the set, then the rest of the window
    from its longest, ascending. Accelerate deals consecutive micro-batches to the processes, and accumulation takes
    them in order: the first micro-batch (process 0) holds the shortest rows, the last the longest. A normalisation
    per micro-batch or per process (a token mean over each, not over the step) then changes the update as much as
    this data can make it; one batch of the whole window, one process, one micro-batch, holds the same examples. The
    rest of the epoch is `sampler`'s order without them: still every example once. `first_step_lengths`: the
    window's lengths in the order fed (the fed record keeps them for verify)."""

    def __init__(self, sampler: Sampler[int], lengths: Sequence[int], window: int):
        self.sampler, self.lengths = sampler, list(lengths)
        by_length = sorted(range(len(self.lengths)), key=lambda i: (self.lengths[i], i))
        window = min(window, len(by_length))
        chosen = by_length[:window // 2] + by_length[len(by_length) - (window - window // 2):]
        self.first_step = sorted(chosen, key=lambda i: (self.lengths[i], i))
        self.first_step_lengths = [self.lengths[i] for i in self.first_step]

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.sampler.epoch = value

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        order = list(self.sampler)
        if self.epoch != 0:
            return iter(order)
        chosen = set(self.first_step)
        return iter(self.first_step + [i for i in order if i not in chosen])


def make_loader(
    dataset: Dataset,
    config: TrainConfig,
    *,
    train: bool,
    collate_fn: Callable | None = None,
    lengths: Sequence[int] | None = None,
    num_processes: int = 1,
    process_index: int | None = None,
) -> DataLoader:
    """A DataLoader set up as the config says: batch size, shuffling (train), workers, pinned memory.

    Pass `lengths` (one per sample) to group similar lengths into batches; with --max_tokens_per_batch the training
    batches hold as many examples as fit in that many padded tokens (core/token_batches.py). Workers are seeded per
    process (`process_index`, default: Accelerate's for this process). An iterable dataset (a stream) is read in its
    own order: shuffle it yourself (a `datasets.IterableDataset`: `.shuffle(seed=..., buffer_size=...)`).
    """
    if train and config.max_tokens_per_batch:  # batches of a token budget, not of a number of examples
        return _loader(dataset, config, collate_fn, process_index,
                       batch_sampler=token_budget_sampler(dataset, config, lengths, num_processes))
    batch_size = config.per_device_train_batch_size if train else config.per_device_eval_batch_size
    sampler = None
    if train and lengths is not None:
        # one optimizer step's examples over every process: the world the launcher started when the caller did not
        # say (grouped per process, 1 process and 2 would batch other examples: verify's world-size check saw it)
        step = batch_size * max(num_processes, _world()) * config.gradient_accumulation_steps
        sampler = LengthGroupedSampler(lengths, step, data_seed(config))
        if os.environ.get(UNEQUAL_VARIABLE) == "1":  # accel-train verify's variants
            sampler = UnequalFirstStep(sampler, lengths, step)
    return _loader(dataset, config, collate_fn, process_index, batch_size=batch_size,
                   shuffle=train and sampler is None and not isinstance(dataset, IterableDataset),
                   sampler=sampler, drop_last=train and config.dataloader_drop_last)


def _loader(dataset, config: TrainConfig, collate_fn, process_index: int | None, **batching) -> DataLoader:
    """A DataLoader batched as `batching` says, with the config's workers and pinned memory."""
    workers, persistent = loader_workers(config)
    return DataLoader(
        dataset,
        collate_fn=collate_fn,
        num_workers=workers,
        pin_memory=config.dataloader_pin_memory and torch.cuda.is_available(),
        persistent_workers=persistent and workers > 0,
        worker_init_fn=functools.partial(seed_worker, rank=_rank(process_index)) if workers > 0 else None,
        **batching,
    )


def token_budget_sampler(dataset, config: TrainConfig, lengths: Sequence[int] | None,
                         num_processes: int) -> TokenBudgetBatchSampler:
    """--max_tokens_per_batch's batch sampler over `lengths` (auto: its budget chosen from them); refused for a
    stream and for a loader without lengths."""
    budget = f"{TOKEN_FLAG} {config.max_tokens_per_batch}"
    if isinstance(dataset, IterableDataset):
        raise ConfigError(f"{budget}: the training set is a stream (an iterable dataset), whose examples' lengths are "
                          "not known ahead, and the plan of batches is made from them before training. Drop "
                          f"{TOKEN_FLAG} (batches of --per_device_train_batch_size examples), or load the data as a "
                          "map-style dataset.")
    if lengths is None:
        raise ConfigError(f"{budget}: the training loader was built without the examples' lengths "
                          "(make_loader(..., lengths=None)), and the batches are planned from them. Pass lengths= (a "
                          "text recipe: drop --no_group_by_length); a packed training set (--packing) fills rows to a "
                          f"token budget already: drop {TOKEN_FLAG} or --packing; images, boxes and image-text pairs "
                          f"(the vision and multimodal recipes) have no token lengths: drop {TOKEN_FLAG}.")
    if len(lengths) != len(dataset):
        raise ConfigError(f"{budget}: {len(lengths)} lengths for a training set of {len(dataset)} examples: pass one "
                          "length per example.")
    config = resolve_token_budget(config, lengths)  # auto: train() takes the sampler's number as the run's
    # every process plans for the world it runs in (a plan for fewer would leave Accelerate to repeat batches)
    return TokenBudgetBatchSampler(lengths, config.max_tokens_per_batch, max(num_processes, _world()),
                                   data_seed(config))


@dataclass
class SplitLoaders:
    """A recipe's loaders, one per split: `train` (shuffled), `eval` (the split evaluated during training, or None),
    `final` ({"test": loader} when a test split exists beside the evaluation split: evaluated once, at the end;
    else None) and `by_split`."""

    train: DataLoader
    eval: DataLoader | None
    final: dict[str, DataLoader] | None
    by_split: dict[str, DataLoader]


def split_loaders(splits: Mapping[str, Dataset], config: TrainConfig, accelerator, eval_split: str | None,
                  collate_fn: Callable | None = None) -> SplitLoaders:
    """`make_loader` for every split ("train" shuffled, workers seeded per process), and which one `train()`
    evaluates during training and at the end: the block every recipe with train / validation / test splits needs.

        loaders = split_loaders(data.splits, config, accelerator, data.eval_split, collate_fn=collate)
        train(model, loaders.train, eval_loader=loaders.eval, final_eval_loaders=loaders.final, ...)
    """
    by_split = {name: make_loader(ds, config, train=name == "train", collate_fn=collate_fn,
                                  num_processes=accelerator.num_processes, process_index=accelerator.process_index)
                for name, ds in splits.items()}
    final = {"test": by_split["test"]} if "test" in by_split and eval_split != "test" else None
    return SplitLoaders(by_split["train"], by_split.get(eval_split) if eval_split else None, final, by_split)


def pad_multiple(accelerator) -> int | None:
    """The multiple to pad sequence lengths to: 8 under fp16 / bf16 on a GPU (tensor cores want it), else None (on a
    CPU the extra padding is only extra work). A recipe asks the library instead of branching on the hardware."""
    half = accelerator.mixed_precision in ("fp16", "bf16")
    return 8 if half and accelerator.device.type == "cuda" else None


def loader_workers(config: TrainConfig) -> tuple[int, bool]:
    """(workers, persistent): the config's, else 4 persistent workers beside a GPU and none on a CPU (measured on
    this project's 2-core machines, workers only took cores from the step; beside a GPU they hide decoding and
    augmentation, benchmarks/GPU_RESULTS.md)."""
    gpu = torch.cuda.is_available()
    workers = config.dataloader_num_workers if config.dataloader_num_workers is not None else (4 if gpu else 0)
    persistent = config.dataloader_persistent_workers
    return workers, (workers > 0 and config.dataloader_num_workers is None) if persistent is None else persistent


def dataset_size(loader) -> int | None:
    """The number of samples in a loader's dataset, or None for a stream without a length."""
    try:
        return len(loader.dataset)
    except (TypeError, AttributeError):
        return None


def data_fingerprint(loader) -> list[int]:
    """What a checkpoint records of the training set its data position counts batches of: [its length, a checksum of
    the example lengths a length-grouping sampler orders by (0: none)]; [] for a stream (a stream saves its own
    position, core/stream.py)."""
    size = dataset_size(loader)
    if size is None or isinstance(getattr(loader, "dataset", None), IterableDataset):
        return []
    lengths = next((part.lengths for part in sampler_chain(loader.batch_sampler)
                    if isinstance(getattr(part, "lengths", None), (list, tuple))), None)  # a list, not a method
    return [size, lengths_checksum(lengths) if lengths is not None else 0]


def sampler_chain(batch_sampler: Any) -> list[Any]:
    """`batch_sampler` and every sampler inside it, through Accelerate's sharding and skipping wrappers (their
    `batch_sampler` / `sampler`), each once."""
    found, todo, seen = [], [batch_sampler], set()
    while todo:
        sampler = todo.pop()
        if sampler is None or id(sampler) in seen:
            continue
        seen.add(id(sampler))
        found.append(sampler)
        todo += [getattr(sampler, "batch_sampler", None), getattr(sampler, "sampler", None)]
    return found


def _rank(process_index: int | None) -> int:
    if process_index is not None:
        return process_index
    from accelerate import PartialState

    return PartialState().process_index


def _world() -> int:
    from accelerate import PartialState

    return PartialState().num_processes
