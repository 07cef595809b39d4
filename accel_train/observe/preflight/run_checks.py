"""The pre-flight checks of the run as set up: precision, world size, global batch, steps, data order (see
the package docstring for the levels). Each takes the run's core.session.Session and returns findings."""

from __future__ import annotations

import torch
from torch.utils.data import IterableDataset

from ...core.accelerator import holds_whole_model, precision_in_effect, requested_world_size, resolve_precision
from .findings import Finding, Level, loader_batch


def check_precision(f) -> list[Finding]:
    acc, asked = f.accelerator, resolve_precision(f.config.mixed_precision)  # auto: what it resolves to here
    running, effect = acc.mixed_precision, precision_in_effect(acc)
    out = []
    if asked is not None and asked != running:
        out.append(Finding("precision", "error", f"--mixed_precision {f.config.mixed_precision} was asked"
                           + (f" ({asked} on this machine)" if asked != f.config.mixed_precision else "")
                           + ", the Accelerator runs "
                           f"{running}.", "build the Accelerator with build_accelerator(config), or give both the "
                           "same precision."))
    elif running in ("fp16", "bf16") and effect == "fp32":
        out.append(Finding("precision", "error", f"{running} was asked but no autocast is in effect (fp32).",
                           "check the device supports it; run `accelerate env`."))
    halves = {p.dtype for p in f.model.parameters() if p.requires_grad and p.dtype in (torch.float16, torch.bfloat16)}
    if halves and holds_whole_model(f.accelerator):
        dtype = str(sorted(halves, key=str)[0]).removeprefix("torch.")
        level: Level = "error" if running == "fp16" and torch.float16 in halves else "warning"
        out.append(Finding("precision", level, f"trainable parameters are stored in {dtype}: updates smaller than "
                           f"{dtype}'s resolution are lost (low-precision training, not mixed precision)"
                           + (", and the fp16 loss scaler refuses fp16 gradients." if level == "error" else "."),
                           "load the model in float32 (from_pretrained(..., dtype=torch.float32)) and let "
                           "--mixed_precision bf16/fp16 autocast."))
    if not out:
        word = f.config.mixed_precision
        asked_by = (f"--mixed_precision {word}" + (f", {asked} here" if word != asked else "")) if asked \
            else f"the launcher's {running}"
        out.append(Finding("precision", "ok", f"{effect} (asked: {asked_by})."))
    return out


def check_world_size(f) -> list[Finding]:
    acc = f.accelerator
    wanted, source = requested_world_size(f.config.expected_world_size)
    if wanted is not None and wanted != acc.num_processes:
        return [Finding("world_size", "error", f"{wanted} processes were asked ({source}), {acc.num_processes} "
                        "are running.", "launch with accel-train launch (see README, 'Choosing hardware').")]
    return [Finding("world_size", "ok", f"{acc.num_processes} process(es), {acc.distributed_type.value}, "
                    f"device {acc.device}" + (f" (asked {wanted} via {source})." if wanted else "."))]


def check_batch(f) -> list[Finding]:
    cfg, plan, n = f.config, f.plan, f.accelerator.num_processes
    gas, per_device = cfg.gradient_accumulation_steps, loader_batch(f.train_loader)
    if cfg.max_tokens_per_batch:  # the plan's micro-batches hold varying numbers of examples (core/token_batches.py)
        return [Finding("global_batch", "ok", f"micro-batches of at most {cfg.max_tokens_per_batch} padded tokens "
                        f"(--max_tokens_per_batch) x {n} process(es) x {gas} accumulation.")]
    formula = f"{cfg.per_device_train_batch_size} per device x {n} process(es) x {gas} accumulation"
    if per_device is not None and per_device != cfg.per_device_train_batch_size:
        return [Finding("global_batch", "error", f"the training loader yields micro-batches of {per_device} "
                        f"samples, --per_device_train_batch_size is {cfg.per_device_train_batch_size}: the global "
                        f"batch ({plan.global_batch_size} = {formula}), the plan and the resume position are computed "
                        "from the flag.", "build the loader with make_loader(dataset, config, train=True) or "
                        "batch_size=config.per_device_train_batch_size.")]
    note = "" if per_device is not None else " (the loader's own batch sampler: its size was not checked)"
    return [Finding("global_batch", "ok", f"global batch {plan.global_batch_size} = {formula}{note}.")]


def check_steps(f) -> list[Finding]:
    cfg, plan, n = f.config, f.plan, f.accelerator.num_processes
    gas, total = cfg.gradient_accumulation_steps, plan.total_steps
    if plan.batches_per_epoch is None:
        out = [Finding("steps", "ok", f"a stream without a length: {total} optimizer step(s) in total (--max_steps), "
                       f"{gas} micro-batch(es) per process each; its epochs are counted where it runs out.")]
    else:
        out = [Finding("steps", "ok", f"{plan.steps_per_epoch} optimizer step(s) per epoch = {plan.batches_per_epoch} "
                       f"micro-batches per process (after sharding over {n}) / {gas} accumulation; {total} in total "
                       f"over {plan.num_epochs} epoch(s).")]
    if plan.batches_per_epoch is not None and gas > plan.batches_per_epoch:
        out.append(Finding("steps", "warning", f"--gradient_accumulation_steps {gas} exceeds the "
                           f"{plan.batches_per_epoch} micro-batches each process gets per epoch: every step averages "
                           f"only {plan.batches_per_epoch}, not the {gas} the global batch counts.",
                           "lower --gradient_accumulation_steps or the batch size, or use more data."))
    for name, strategy, every in (("logging", cfg.logging_strategy, cfg.logging_steps),
                                  ("evaluation", cfg.eval_strategy if f.eval_loader is not None else "no",
                                   cfg.eval_steps or cfg.logging_steps),
                                  ("checkpoint", cfg.save_strategy, cfg.save_steps)):
        if strategy == "steps" and every > total:
            out.append(Finding("intervals", "warning", f"{name} every {every} steps, but the run has {total}: none "
                               "happens before the end.", f"lower the {name} interval or use the epoch strategy."))
    return out


def _order(sampler) -> str:
    from torch.utils.data import RandomSampler, SequentialSampler, SubsetRandomSampler, WeightedRandomSampler
    from torch.utils.data.distributed import DistributedSampler

    if isinstance(sampler, (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)):
        return "shuffled"
    if isinstance(sampler, DistributedSampler):
        return "shuffled" if sampler.shuffle else "sequential"
    if isinstance(sampler, SequentialSampler):
        return "sequential"
    if type(sampler).__name__ in ("LengthGroupedSampler", "TokenBudgetOrder"):  # seeded by (seed, epoch)
        return "shuffled"
    return "unknown"


def _stream_order(loader) -> list[Finding]:
    """A stream has no sampler: it is read in its own order, and resumes at its saved position or by re-reading."""
    saved = callable(getattr(loader.dataset, "state_dict", None))
    return [Finding("train_order", "ok", "training order: the stream's own (a datasets stream reorders its shards at "
                    "every epoch; shuffle any other stream yourself)."),
            Finding("seedable_sampler", "ok", "a resumed run starts at the stream position its checkpoint saved."
                    if saved else "a resumed run re-reads the stream up to its position (the dataset has no "
                    "state_dict()): exact, in a time that grows with the position.")]


def _sampler_order(train, overfit_batches: int) -> list[Finding]:
    """A map-style dataset's training order: shuffled or not, and replayable on resume (its sampler's set_epoch)."""
    order = _order(train)
    if order == "sequential" and not overfit_batches:
        out = [Finding("train_order", "warning", "the training loader is not shuffled: every epoch sees the samples "
                       "in the same order (a dataset sorted by label trains on one class at a time).",
                       "DataLoader(..., shuffle=True) or make_loader(dataset, config, train=True); ignore this only "
                       "if the data is shuffled already or the order is a curriculum.")]
    else:
        out = [Finding("train_order", "ok", f"training order: {order} ({type(train).__name__}).")]
    if train is not None and order != "sequential" and not hasattr(train, "set_epoch"):
        out.append(Finding("seedable_sampler", "warning", f"the training sampler ({type(train).__name__}) has no "
                           "set_epoch(): its order cannot be replayed, so a resumed run sees other batches than an "
                           "uninterrupted one.", "build the Accelerator with build_accelerator(config) (seedable "
                           "sampler) or give the sampler set_epoch(epoch) and seed it from (seed, epoch)."))
    elif train is not None:
        out.append(Finding("seedable_sampler", "ok", f"the training order is replayable ({type(train).__name__})."))
    return out


def check_loaders(f) -> list[Finding]:
    from accelerate.data_loader import get_sampler

    if isinstance(f.train_loader.dataset, IterableDataset):
        out = _stream_order(f.train_loader)
    else:
        out = _sampler_order(get_sampler(f.train_loader), f.config.overfit_batches)
    if f.eval_loader is not None:
        evaluation = get_sampler(f.eval_loader)
        if _order(evaluation) == "shuffled":
            out.append(Finding("eval_order", "warning", "the evaluation loader is shuffled: predictions come in "
                               "another order each time and cannot be matched to samples or compared across runs.",
                               "DataLoader(..., shuffle=False) or make_loader(dataset, config, train=False)."))
        batches = getattr(f.eval_loader, "batch_sampler", None)
        if getattr(f.eval_loader, "drop_last", False) or getattr(batches, "drop_last", False):
            out.append(Finding("eval_order", "warning", "the evaluation loader drops its last incomplete batch: "
                               "those samples are never evaluated.", "DataLoader(..., drop_last=False)."))
        if not [x for x in out if x.check == "eval_order"]:
            out.append(Finding("eval_order", "ok", f"evaluation order: {_order(evaluation)}, every sample evaluated."))
    return out
