"""The collectives the image-text losses and metrics share: every process's rows in rank order, with or without
gradients, padded where the processes' lengths differ, the distinct ids of a gathered batch, and which of its
columns only even out the last evaluation batch. One process (or no process group) is the identity everywhere."""

from __future__ import annotations

import torch
import torch.distributed as dist
from accelerate.state import GradientState


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if world_size() > 1 else 0


def gather_plain(x: torch.Tensor) -> torch.Tensor:
    """x of every process concatenated in rank order, without gradients (ids, masks, scores). Same shape on every
    process (pad first: `pad_to`, `longest`)."""
    if world_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts)


def gather_with_grad(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(x of every process concatenated in rank order, the offset of this process's rows in it). Gradients flow
    back to each process's own x. Needs the same batch size on every process, which Accelerate's prepared
    loaders guarantee (`even_batches`)."""
    if world_size() == 1:
        return x, 0
    from torch.distributed.nn.functional import all_gather

    # The group named now: all_gather's default is the world group of the moment torch.distributed.nn was imported,
    # which a process that ended that group and started another (a sweep, a notebook training twice) no longer has.
    return torch.cat(all_gather(x.contiguous(), group=dist.group.WORLD)), rank() * x.shape[0]


def repeated_columns(size: int, device) -> torch.Tensor | None:
    """[size] bool, True for the columns of a gathered evaluation batch of `size` pairs that are not pairs of this
    batch: in the last batch on several processes, Accelerate (`even_batches`) tops every process up with pairs from
    the start of the set, and the real pairs come first in rank order (what `gather_for_metrics` keeps). A loss over
    the global batch must not take them as negatives: on 1 process the last batch holds the real pairs alone, and
    2 processes x B/2 give the 1 x B loss only without them. None where there are none. Call it in evaluation only:
    a training loader that drops its last batch (the recipes') has no repeats, one that does not has them on purpose.
    """
    if world_size() == 1:  # no repeats; and Accelerate's count may be another loader's (an unprepared one's)
        return None
    state = GradientState()
    real = state.remainder  # len(dataset) % the global batch size, -1 for a loader of unknown length
    if not state.end_of_dataloader or not 0 < real < size:
        return None
    return torch.arange(size, device=device) >= real


def pad_to(x: torch.Tensor, length: int) -> torch.Tensor:
    """Pads dim 1 of x ([B, L, ...]) with zeros to `length`."""
    if x.shape[1] == length:
        return x
    pad = x.new_zeros(x.shape[0], length - x.shape[1], *x.shape[2:])
    return torch.cat([x, pad], 1)


def longest(x: torch.Tensor) -> int:
    """The largest dim 1 of x over all processes."""
    length = torch.tensor([x.shape[1]], device=x.device)
    if world_size() > 1:
        dist.all_reduce(length, op=dist.ReduceOp.MAX)
    return int(length)


def distinct(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(for each element, the number of its distinct id; for each distinct id, the position of its first element)."""
    unique, inverse = torch.unique(ids, return_inverse=True)
    first = torch.full((len(unique),), len(ids)).scatter_reduce(0, inverse, torch.arange(len(ids)), "amin")
    return inverse, first
