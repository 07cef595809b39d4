"""Token-budget batches (--max_tokens_per_batch N): each training micro-batch holds as many examples as fit in N
padded tokens, instead of a fixed number of examples.

What counts: a batch of `rows` examples whose longest has `longest` tokens costs rows x longest tokens — what dynamic
padding makes it, so the activations' memory is bounded by N whatever the lengths (fairseq's --max-tokens and the
Trainer-style token batching count the same). Counting real tokens instead (the sum of lengths) would let one long
example and many short ones pad to a batch far over N.

The plan (fairseq's `batch_by_size`): the examples sorted longest first, cut greedily into batches that fit the
budget. Its shape (the rows of each batch and their lengths) depends on the sorted lengths alone, so it is the same in
every epoch: the number of micro-batches — and so the steps per epoch the schedule is built for — never changes. Each
epoch draws from (seed, epoch) which examples of equal length go together and the order of the batches, so a resumed
run replays the epoch exactly.

Several processes: Accelerate deals a batch sampler's batches round-robin (batch i to process i mod P) and would
repeat batches from the start to even out a count that is not a multiple of P. The plan therefore has a multiple of P
batches (the batches with the most rows are halved until it has) and deals them in rounds of P batches of similar
token counts, each round's batches in a seeded order: every process runs the same number of micro-batches (no rank
waits for a step the others never take), every example is trained once per epoch, and the ranks' token counts match
round by round.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from pathlib import Path

import torch
from accelerate.utils import broadcast_object_list
from torch.utils.data import Sampler
from transformers.trainer_pt_utils import get_length_grouped_indices

from ..config.validation import AUTO_TOKENS, AUTO_TOKENS_VARY
from ..errors import CheckpointError, ConfigError
from ..rundir.checkpoint import list_checkpoints, load_train_state
from .seeding import data_seed, seeded_generator

FLAG = "--max_tokens_per_batch"


def padded_tokens(lengths: Sequence[int], batch: Sequence[int]) -> int:
    """What a batch costs in the budget: its rows x its longest row."""
    return len(batch) * max(lengths[i] for i in batch)


def auto_budget(lengths: Sequence[int], batch_size: int, seed: int = 0) -> int:
    """--max_tokens_per_batch auto: the mean padded tokens (rows x longest row) of the micro-batches of `batch_size`
    examples in the length-grouped order of the first epoch at `seed` (what batches of a fixed size cost with
    length grouping), at least the longest example. About as many micro-batches an epoch as that fixed size, each
    holding as many examples as that mean allows: more short examples, fewer long ones, less padding. Grouped by
    the micro-batch alone, so the number does not depend on the processes or the accumulation."""
    if not lengths:
        raise ConfigError(f"{FLAG} {AUTO_TOKENS}: the training set is empty.")
    lengths = list(lengths)
    order = get_length_grouped_indices(lengths, batch_size, generator=seeded_generator(seed, 0))
    cost = [padded_tokens(lengths, order[i:i + batch_size]) for i in range(0, len(order), batch_size)]
    return max(round(sum(cost) / len(cost)), max(lengths))


def resolve_token_budget(config, lengths: Sequence[int] | None):
    """`config` with --max_tokens_per_batch auto replaced by its number of tokens over the training examples'
    `lengths` (the widths the collator pads them to), so the start-up report, the checkpoints' plan and the
    refusals name the budget that ran; any other config as it is. Call it where the lengths are known, before
    make_loader and train()."""
    if config.max_tokens_per_batch != AUTO_TOKENS:
        return config
    if lengths is None:
        raise ConfigError(f"{FLAG} {AUTO_TOKENS}: the budget is chosen from the training examples' lengths, and "
                          "the loader was given none (make_loader(..., lengths=None); a recipe: drop "
                          "--no_group_by_length). Pass lengths=, or give the budget as a number of tokens.")
    budget = auto_budget(lengths, config.per_device_train_batch_size, data_seed(config))
    return config.replace(max_tokens_per_batch=budget)


# what asks for batches of a fixed number of examples: a recipe's default budget gives way to it (default_budget)
FIXED_BATCHES = {"auto_find_batch_size": "--auto_find_batch_size searches for a number of examples per micro-batch",
                 "dataloader_drop_last": "--dataloader_drop_last drops an incomplete batch of examples",
                 "scale_lr": "--scale_lr scales the learning rate with a fixed global batch of examples",
                 "overfit_batches": "--overfit_batches repeats batches of examples"}


# =1 (accel-train verify sets it on its runs): a recipe's default batching is batches of examples (default_budget)
FIXED_BATCHES_VARIABLE = "ACCEL_TRAIN_FIXED_BATCHES"


def default_budget(config, accelerator, refused: str | None = None):
    """A recipe's default batching, (config, the line that says it): --max_tokens_per_batch auto (issue 42: the
    targets sooner on two tasks of three at equal final quality), unless the run chose its batching
    (--max_tokens_per_batch given: a number, auto, or 0 for batches of examples), or something in it needs batches
    of --per_device_train_batch_size examples: `refused` (the recipe's reason: --packing, an encoder-decoder, ...), a
    flag of FIXED_BATCHES, DeepSpeed, or a checkpoint it resumes that was trained with them. Those fall back to
    batches of examples, and the line says why."""
    if "max_tokens_per_batch" in config.given:
        return config, ""
    fixed = [reason for name, reason in FIXED_BATCHES.items() if getattr(config, name) not in (False, 0, "none")]
    if accelerator.distributed_type.value == "DEEPSPEED":
        fixed.append("DeepSpeed needs a fixed number of examples per micro-batch")
    if os.environ.get(FIXED_BATCHES_VARIABLE) == "1":
        fixed.append("accel-train verify compares runs of other micro-batch sizes and numbers of processes, which a "
                     "budget chosen per micro-batch would batch differently")
    why = refused or (fixed[0] if fixed else None) or _resumed_with_fixed_batches(config, accelerator)
    if why:
        return config.replace(max_tokens_per_batch=0), (
            f"batches: {config.per_device_train_batch_size} examples each (--per_device_train_batch_size), not the "
            f"default token budget: {why}")
    return config.replace(max_tokens_per_batch=AUTO_TOKENS), (
        "batches: the default token budget (--max_tokens_per_batch auto: as many padded tokens as the length-grouped "
        f"batches of {config.per_device_train_batch_size} examples hold on average; --max_tokens_per_batch 0 for "
        "batches of examples)")


def _resumed_with_fixed_batches(config, accelerator=None) -> str | None:
    """Why a resume keeps batches of examples: its checkpoint was trained with them (its data position counts them).
    The main process looks and tells the others (as resume_target decides), so that every rank batches alike."""
    spec = config.resume_from_checkpoint
    if not spec:
        return None
    why: list = [None]
    if getattr(accelerator, "is_main_process", True):
        paths = list_checkpoints(config.output_dir)[-1:] if spec in ("latest", "auto") else [Path(spec)]
        try:
            plan = load_train_state(paths[0]).get("token_plan") if paths else [0]
            why = [None if plan else f"the checkpoint it resumes ({paths[0].name}) was trained with batches of "
                                     "examples"]
        except CheckpointError:  # the resume itself says what is wrong with it
            pass
    if getattr(accelerator, "num_processes", 1) > 1:
        broadcast_object_list(why)
    return why[0]


def plan_batches(lengths: Sequence[int], max_tokens: int, num_processes: int = 1, seed: int = 0,
                 epoch: int = -1) -> list[list[int]]:
    """The batches (lists of example indices) of `epoch` (-1: the run's plan, before any epoch), in rounds of
    `num_processes` batches of similar token counts (rounds in the longest-first order): every batch costs at most
    `max_tokens` padded tokens; every example is in exactly one batch. Refused when an example alone is longer than
    the budget, or when the examples cannot be dealt to the processes evenly."""
    return cut_batches(lengths, max_tokens, num_processes, seeded_generator(seed, epoch))


def cut_batches(lengths: Sequence[int], max_tokens: int, num_processes: int,
                generator: torch.Generator) -> list[list[int]]:
    """plan_batches with the order of equal lengths drawn from `generator`. The batches' shape — how many rows, which
    lengths — depends on the sorted lengths alone, so every draw gives the same number of batches, each with the same
    padded and real tokens; only which of the examples of equal length go together changes."""
    if not lengths:
        raise ConfigError(f"{FLAG} {max_tokens}: the training set is empty.")
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    if lengths[longest] > max_tokens:
        raise ConfigError(f"{FLAG} {max_tokens}: training example {longest} has {lengths[longest]} tokens, more than "
                          f"a whole batch may hold. Raise {FLAG} to at least {lengths[longest]}, or truncate the "
                          "examples (--max_seq_length).")
    ties = torch.randperm(len(lengths), generator=generator).tolist()
    order = sorted(ties, key=lambda i: -lengths[i])  # stable: equal lengths stay in the drawn order
    batches: list[list[int]] = []
    for index in order:  # longest first: a batch's first example is its longest
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
            batches[-1].append(index)
        else:
            batches.append([index])
    batches = _even_out(batches, num_processes, max_tokens)
    real = [sum(lengths[i] for i in batch) for batch in batches]
    ranked = sorted(range(len(batches)), key=lambda b: (-real[b], b))  # rounds of batches of similar token counts
    return [batches[b] for b in ranked]


def _even_out(batches: list[list[int]], num_processes: int, max_tokens: int) -> list[list[int]]:
    """Halve the batches with the most rows until their count is a multiple of `num_processes` (halves fit the
    budget too): Accelerate would otherwise repeat examples to give every process as many batches."""
    while len(batches) % num_processes:
        largest = max(range(len(batches)), key=lambda b: len(batches[b]))
        batch = batches[largest]
        if len(batch) < 2:
            raise ConfigError(f"a token budget of {max_tokens} padded tokens ({FLAG}, given or the NLP recipes' "
                              f"default auto): every batch holds a single example and the {len(batches)} examples "
                              f"cannot be dealt evenly to {num_processes} processes. Raise {FLAG}, give {FLAG} 0 "
                              "(batches of --per_device_train_batch_size examples), or train on a number of examples "
                              "divisible by the number of processes.")
        batches[largest:largest + 1] = [batch[:len(batch) // 2], batch[len(batch) // 2:]]
    return batches


def token_plan(config, loader=None) -> list[int]:
    """What a checkpoint records of the plan its data position counts in: [budget, accumulation, micro-batches an
    epoch, a checksum of the lengths planned over] (the last two from `loader`'s sampler), or [] without a budget."""
    if not config.max_tokens_per_batch:
        return []
    sampler = budget_sampler(loader)
    shape = [len(sampler), lengths_checksum(sampler.lengths)] if sampler is not None else []
    return [config.max_tokens_per_batch, config.gradient_accumulation_steps, *shape]


def lengths_checksum(lengths: Sequence[int]) -> int:
    """A checksum of example lengths (in order): what a checkpoint keeps of the lengths its batches were made from."""
    return zlib.crc32(",".join(map(str, lengths)).encode())


def budget_sampler(loader) -> TokenBudgetBatchSampler | None:
    """The TokenBudgetBatchSampler that batches `loader`, through Accelerate's sharding wrapper, or None."""
    sampler = getattr(loader, "batch_sampler", None)
    for _ in range(3):
        if isinstance(sampler, TokenBudgetBatchSampler):
            return sampler
        sampler = getattr(sampler, "batch_sampler", None)
    return None


class RoundExamples:
    """The examples a micro-batch index of an epoch feeds on all processes together, under a plan dealt to several:
    rank r's b-th micro-batch is the plan's batch b x P + r, so round b's examples are those of its P batches (one
    rank's micro-batch times P would count the others' as its own size). The epoch's plan is drawn once."""

    def __init__(self, sampler: TokenBudgetBatchSampler):
        self.sampler, self.epoch, self.sizes = sampler, -1, []

    def __call__(self, epoch: int, index: int) -> int:
        if epoch != self.epoch:
            p = self.sampler.num_processes
            batches = self.sampler.epoch_batches(epoch)
            self.epoch, self.sizes = epoch, [sum(map(len, batches[r:r + p])) for r in range(0, len(batches), p)]
        return self.sizes[index]


def round_examples(loader, num_processes: int) -> RoundExamples | None:
    """A RoundExamples for a loader batched by a token budget's plan on several processes, else None (every
    process's micro-batch then holds as many examples as this one's)."""
    sampler = budget_sampler(loader)
    return RoundExamples(sampler) if sampler is not None and num_processes > 1 else None


def check_token_plan(state, config, num_processes: int, path, loader=None) -> None:
    """A checkpoint's data position counts micro-batches of its run's plan, its steps windows of them: resuming it
    needs the same plan (the same budget over the same example lengths, as many processes: the plan is dealt in
    rounds of one batch per process) and the same accumulation (a fixed batch's global batch is checked as such; a
    budget's has no fixed size). A checkpoint that recorded no lengths (before 2026-12-05) is compared without."""
    then, now = state.token_plan or [], token_plan(config, loader)
    if then[:2] != now[:2]:
        raise CheckpointError(f"{path} was trained with {_batching(then)}, this run asks for {_batching(now)}: its "
                              "data position counts the micro-batches of its own plan, and its steps windows of "
                              "them. Resume with the flags it was trained with, or start a new run."
                              + (f" ({AUTO_TOKENS_VARY}.)" if then and now else ""))
    if now and state.world_size not in (0, num_processes):
        raise CheckpointError(f"{path} was trained on {state.world_size} process(es) with {FLAG} {now[0]}, this run "
                              f"has {num_processes}: the plan of batches is dealt in rounds of one batch per process, "
                              f"so its data position does not carry over. Resume on {state.world_size} process(es) (a "
                              f"run that must move between world sizes trains with {FLAG} 0: batches of examples).")
    if then[2:] and now[2:] and then[2:] != now[2:]:
        raise CheckpointError(f"{path} was trained on a plan of {then[2]} micro-batches an epoch over other example "
                              f"lengths than this run's ({now[2]} micro-batches): the data or the widths examples are "
                              "padded to changed (--length_buckets, --max_seq_length, a GPU's pad multiple under "
                              "another precision), and its data position counts the micro-batches of its own plan. "
                              "Resume with the data and flags it was trained with, or start a new run.")


def check_token_loader(loader, config, num_processes: int):
    """`config` as the run uses it: with --max_tokens_per_batch auto, the budget of the loader's plan (make_loader
    chose it from the lengths). A training loader batched by a TokenBudgetBatchSampler of one's own: its budget
    must be the run's --max_tokens_per_batch (what the checkpoints' data position, the report and the refusals count
    in), and it must plan for the processes that run (its rounds are made for that number: Accelerate would repeat
    batches to even out another count, or pair batches of unequal tokens). ConfigError otherwise, before training."""
    sampler = budget_sampler(loader)
    if sampler is None:
        if config.max_tokens_per_batch:  # its batches are not the budget's, which the run would claim and count in
            raise ConfigError(f"{FLAG} {config.max_tokens_per_batch}: the training loader is not batched by a token "
                              "budget's plan (a loader of one's own, or a stream), so the run would train on the "
                              "loader's batches while its start-up report, config.yaml and checkpoints (the data "
                              "position a resume skips) count in the budget's. Build it with make_loader(dataset, "
                              f"config, train=True, lengths=...), which plans the budget, or drop {FLAG} to train on "
                              "the loader's own batches.")
        return config
    if config.max_tokens_per_batch == AUTO_TOKENS:
        config = config.replace(max_tokens_per_batch=sampler.max_tokens)
    if sampler.max_tokens != config.max_tokens_per_batch:
        raise ConfigError(f"the training loader's TokenBudgetBatchSampler plans batches of {sampler.max_tokens} padded "
                          f"tokens and {FLAG} is {config.max_tokens_per_batch or '0 (off)'}: set {FLAG} "
                          f"{sampler.max_tokens} (the run's steps, checkpoints and start-up report count in its plan), "
                          "or let make_loader(..., lengths=...) build the loader from the config.")
    if sampler.num_processes != num_processes:
        raise ConfigError(f"the training loader's TokenBudgetBatchSampler was planned for {sampler.num_processes} "
                          f"process(es) and this run has {num_processes}: its plan is dealt in rounds of one batch "
                          "per process, made for that number (Accelerate would repeat batches to even out another "
                          "count, or deal batches of unequal tokens side by side). Build it "
                          f"with TokenBudgetBatchSampler(lengths, {sampler.max_tokens}, accelerator.num_processes, "
                          "seed), or with make_loader(..., lengths=...), which plans for the processes that run.")
    return config


def _batching(plan: list[int]) -> str:
    if not plan:
        return f"batches of --per_device_train_batch_size (no {FLAG})"
    return f"{FLAG} {plan[0]} and --gradient_accumulation_steps {plan[1]}"


class TokenBudgetOrder:
    """The epoch a TokenBudgetBatchSampler shuffles for: Accelerate's prepared loader tells its batch sampler's
    `sampler` the epoch (`set_epoch`), through the sharding wrapper it puts around the batch sampler."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Batches of at most `max_tokens` padded tokens (rows x longest row) over examples of `lengths` tokens:
    `DataLoader(dataset, batch_sampler=TokenBudgetBatchSampler(lengths, 4096, num_processes, seed))`, or
    make_loader with --max_tokens_per_batch. The same plan on every process; each epoch the rounds (one batch per
    process) come in an order drawn from (seed, epoch). No `batch_size`: Accelerate then takes the batches as they
    are (no evening out by size)."""

    def __init__(self, lengths: Sequence[int], max_tokens: int, num_processes: int = 1, seed: int = 0):
        self.lengths = list(lengths)
        self.max_tokens, self.num_processes, self.seed = max_tokens, num_processes, seed
        self.batches = plan_batches(self.lengths, max_tokens, num_processes, seed)
        self.sampler = TokenBudgetOrder()

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batches)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """The batches of `epoch` in the order they are dealt (batch i to process i mod P): the plan's shape, with
        examples of equal length grouped anew and the rounds in a new order, both drawn from (seed, epoch)."""
        generator = seeded_generator(self.seed, epoch)
        p = self.num_processes
        batches = cut_batches(self.lengths, self.max_tokens, p, generator)
        rounds = [batches[r:r + p] for r in range(0, len(batches), p)]
        dealt = []
        for r in torch.randperm(len(rounds), generator=generator).tolist():
            dealt.extend(rounds[r][k] for k in torch.randperm(p, generator=generator).tolist())
        return dealt

    def __iter__(self):
        return iter(self.epoch_batches(self.sampler.epoch))

    def padding_share(self, real: Sequence[int] | None = None) -> float:
        """The share of pad tokens in the plan's batches (the same in every epoch): of `real` tokens per example when
        the lengths planned with are the widths the collator pads to (a pad multiple, length buckets)."""
        padded = sum(padded_tokens(self.lengths, batch) for batch in self.batches)
        return 1 - sum(self.lengths if real is None else real) / padded
