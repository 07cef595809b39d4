"""Going back to a checkpoint: at the start (--resume_from_checkpoint) or in the middle of a run (--on_spike rollback).

Both restore what Accelerate saved (weights, optimizer, schedule, random states, the weight average) and the loop's
JSON state, then re-derive the data position from the samples the epoch had consumed. `session` is the run's
core.session.Session.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError
from ..rundir import checkpoint as ckpt
from ..rundir.layout import checkpoint_step, checkpoints_dir
from ..rundir.outdir import supersede_newer
from .accelerator import precision_in_effect
from .data import data_fingerprint
from .guard import window_batches
from .hooks import hook_keys, saved_hook_state
from .hyperparameters import apply_hyperparameters, hyperparameter_changes, run_hyperparameters
from .objects import inner_object, own_setting_notes, own_settings
from .state import TrainState
from .stream import rereading_notes
from .token_batches import check_token_plan, token_plan


@dataclass
class Resumed:
    """What a resume gives the session: the state it starts at, what the start-up report must add, and whether a
    stream's loader starts at its saved position (then nothing is skipped)."""

    state: TrainState
    notes: list[str]
    position_restored: bool


def fresh_state(session) -> TrainState:
    """The state a run starts from without a checkpoint: what its data position and steps will count in."""
    acc, config = session.accelerator, session.config
    return TrainState(world_size=acc.num_processes, global_batch_size=session.plan.global_batch_size,
                      per_device_batch=config.per_device_train_batch_size, precision=precision_in_effect(acc),
                      token_plan=token_plan(config, session.train_loader), data=data_fingerprint(session.train_loader))


def check_data(state: TrainState, loader, path: Path) -> None:
    """A checkpoint's data position counts batches of the training set it was trained on: resuming it over another
    (more or fewer examples, or other lengths where batches are grouped by length) would train on other examples
    than the run it continues, silently. A checkpoint that recorded none (before 2026-12-05) is not compared."""
    then, now = state.data, data_fingerprint(loader)
    if not then or not now or then == now:
        state.data = now or then
        return
    if then[0] == now[0] and 0 in (then[1], now[1]):  # the same size, batches grouped by length in one run only
        grouped = "with" if then[1] else "without"
        raise CheckpointError(f"{path} was trained {grouped} batches grouped by length, this run batches "
                              f"{'without' if then[1] else 'with'} (--group_by_length, a loader's sampler): its data "
                              f"position (epoch {state.epoch}, batch {state.batch_in_epoch}) counts batches of the "
                              "other order. Resume with the batching it was trained with, or start a new run.")
    what = (f"{then[0]} training examples, this run has {now[0]}" if then[0] != now[0] else
            f"{then[0]} training examples of other lengths than this run's (its batches are grouped by length)")
    raise CheckpointError(f"{path} was trained on {what}: the data changed (another file or split, "
                          "--max_train_samples, --max_seq_length, the tokenizer), and its data position (epoch "
                          f"{state.epoch}, batch {state.batch_in_epoch}) counts batches of the set it was trained on, "
                          "so the resumed run would not train on the examples the run it continues would have. "
                          "Resume with the data it was trained with, or start a new run from its weights (a "
                          "checkpoint's folder loads with from_pretrained).")


def resume(session) -> Resumed:
    """--resume_from_checkpoint: load session.resume_path (the session's objects are loaded, its bookkeeping is the
    session's to set), take the data position, and start a new timeline there: newer checkpoints are moved aside,
    changed hyperparameters are applied."""
    acc, config, plan = session.accelerator, session.config, session.plan
    path = session.resume_path
    manifest = ckpt.verify_checkpoint(path)
    check_engine_world_size(path, manifest, acc)
    ckpt.check_compatible(path, manifest, session.shapes)
    state = TrainState(**ckpt.load_train_state(path))
    check_token_plan(state, config, acc.num_processes, path, session.train_loader)  # the same plan, the same steps
    check_data(state, session.train_loader, path)  # the same examples
    if state.global_batch_size != plan.global_batch_size:
        raise CheckpointError(
            f"{path} was trained with a global batch of {state.global_batch_size} samples per step, this run has "
            f"{plan.global_batch_size} (per-device batch x processes x accumulation). The schedule and data "
            "position would not line up: keep the same global batch when resuming.")
    if not state.token_plan:  # a budget's position counts its plan's micro-batches: no --per_device_train_batch_size
        unit = config.per_device_train_batch_size * acc.num_processes  # dataset items per micro-batch, all processes
        state.batch_in_epoch = position_in_epoch(state, unit, path)
        state.excluded_batches = remap_exclusions(state.excluded_batches, saved_unit(state), unit)
        state.per_device_batch = config.per_device_train_batch_size
    engine_owned = acc.distributed_type.value == "DEEPSPEED"
    current = session_hyperparameters(session)
    hyperparameter_changes(session.scheduler, state.hyperparameters, current, engine_owned)  # before torch loads it
    settings = own_settings(session)  # the user's own objects as their code built them now
    load_saved_state(session, path)
    notes = apply_hyperparameters(session.optimizer, session.scheduler, state.hyperparameters, current, engine_owned)
    notes += own_setting_notes(session, settings)
    # a stream that saves its position: the loader starts there, nothing re-read
    restored = session.stream is not None and session.stream.restore(path, acc.num_processes, state.batch_in_epoch)
    notes += rereading_notes(session.train_loader, state.batch_in_epoch, restored)
    state.world_size = acc.num_processes
    notes += precision_notes(state, precision_in_effect(acc))
    restore_hooks(session, state)
    notes += check_best(session, state, path)
    if acc.is_main_process:  # this run's timeline continues from `path`: `latest` must never go back to the old
        moved = supersede_newer(config.output_dir, state.step)
        if moved:
            notes.append(f"{len(moved)} checkpoint(s) newer than step {state.step} belong to the abandoned "
                         f"timeline: moved to {moved[0].parent} ({', '.join(p.name for p in moved)})")
    acc.wait_for_everyone()
    if manifest.get("world_size") != acc.num_processes:
        acc.print(f"note: {path} was written by {manifest.get('world_size')} process(es), resuming on "
                  f"{acc.num_processes}; the data position is re-derived from the samples consumed. Random "
                  "streams (dropout, augmentation) of processes the checkpoint did not have start afresh.")
    acc.print(f"resumed from {path} at step {state.step} (epoch {state.epoch}, batch {state.batch_in_epoch})")
    return Resumed(state, notes, restored)


def check_engine_world_size(path: Path, manifest: dict, acc) -> None:
    """DeepSpeed's checkpoints resume on the number of processes that wrote them: ZeRO partitions the optimizer state
    by process, and DeepSpeed refuses another number inside load_state (or misses a per-rank file). DDP and FSDP (whose
    DCP checkpoints reshard) move between world sizes."""
    saved = manifest.get("world_size")
    if acc.distributed_type.value == "DEEPSPEED" and saved is not None and saved != acc.num_processes:
        raise CheckpointError(
            f"{path} was written by DeepSpeed on {saved} process(es), this run has {acc.num_processes}: ZeRO "
            "partitions the optimizer state by process, and DeepSpeed cannot load it on another number of processes "
            f"(it stops inside load_state). Resume on {saved} processes (--num_processes {saved}), or start a new run "
            "from its weights: the run's exported final model, or the checkpoint's consolidated with the "
            "zero_to_fp32.py that DeepSpeed wrote into it.")


def session_hyperparameters(session) -> dict:
    """`run_hyperparameters` of the session's run, without the flags that built neither object of the user's own,
    with the classes of the optimizer and the scheduler inside Accelerate's and DeepSpeed's wrappers (as what_ran)."""
    classes = (type(inner_object(session.optimizer)).__name__, type(inner_object(session.scheduler)).__name__)
    return run_hyperparameters(session.config, session.plan, session.group_peaks,
                               (session.own_optimizer, not session.scheduler_built_here), classes)


def precision_notes(state: TrainState, now: str) -> list[str]:
    """Another precision than the checkpoint's is the user's choice (an fp16 run that overflows goes on in bf16): said,
    not refused; the state records the new one for the next resume."""
    then, state.precision = state.precision, now
    if not then or then == now:
        return []
    return [f"precision: the checkpoint was trained in {then}, this run goes on in {now}: the steps from here are "
            "not bitwise those of an uninterrupted run (a loss scaler's state is kept only between fp16 runs)"]


def saved_unit(state: TrainState) -> int:
    """Dataset items per micro-batch (all processes) of the run that saved `state`; 0 when it did not record it."""
    return state.per_device_batch * state.world_size


def position_in_epoch(state: TrainState, unit: int, path: Path) -> int:
    """The micro-batch of the epoch this process resumes at, for micro-batches of `unit` items over all processes.
    The checkpoint's own position when the layout is the same; else re-derived from the items the epoch consumed
    (another world size, or an automatic batch size that chose another micro-batch at the same global batch)."""
    if state.per_device_batch and saved_unit(state) == unit:
        return state.batch_in_epoch
    # counted in micro-batches since it was recorded: a padding-free row (one per micro-batch) is not one item
    consumed = state.batch_in_epoch * saved_unit(state) if state.per_device_batch else state.samples_in_epoch
    if consumed % unit:
        raise CheckpointError(
            f"{path}: {consumed} samples of the epoch were consumed, which is not a whole number of micro-batches "
            f"of {unit} (per-device batch x processes) in this run; resume with the world size and per-device "
            "batch of the run that saved it, or from a checkpoint at an epoch's end.")
    return consumed // unit


def remap_exclusions(excluded: list[list[int]], unit_then: int, unit_now: int) -> list[list[int]]:
    """Rollback exclusions ([epoch, micro-batch]) of micro-batches of `unit_then` items, as micro-batches of
    `unit_now`: those that start inside an excluded span of items. Exclusions are whole optimizer steps and the global
    batch cannot change on resume, so the spans stay whole steps of the new layout."""
    if not excluded or not unit_then or unit_then == unit_now:
        return excluded
    out = set()
    for epoch, batch in excluded:
        start, end = batch * unit_then, (batch + 1) * unit_then
        out.update((epoch, b) for b in range(-(-start // unit_now), -(-end // unit_now)))
    return [list(item) for item in sorted(out)]


def load_saved_state(session, path: Path) -> None:
    """What checkpoint `path` holds beside the loop's JSON: Accelerate's state, and the weight average if any. An
    optimizer state of other param groups than this run's (which the recorded hyperparameters do not show: the same
    number of groups, other parameters in them) is a CheckpointError, not torch's ValueError."""
    try:
        session.accelerator.load_state(str(path))
    except ValueError as error:
        if "parameter group" not in str(error):
            raise
        raise CheckpointError(
            f"{path}: its optimizer state does not fit this run's optimizer ({error}): which parameters train, or "
            "how they are grouped, changed (freezing, LoRA, per-group flags such as --layerwise_lr_decay). Resume "
            "with the model and flags it was trained with, or start a new run in another --output_dir.") from None
    if session.average is not None:
        session.average.load(path, session.accelerator.num_processes)


BEST_FIELDS = ("best_metric", "best_metric_name", "best_greater", "best_checkpoint")


def restore_in_place(session, state: TrainState, path: Path) -> None:
    """Put the run's objects back at checkpoint `path` of this run (verified), and `state` itself: weights,
    optimizer, schedule, random states, the weight average and the hooks as saved, and the checkpoint's data
    position. The session's own bookkeeping is the session's to reset (Session.roll_back). A checkpoint written before
    this run resumed with changed hyperparameters holds the old ones: they are applied again, as the resume did."""
    current, data = state.hyperparameters, state.data  # this run's (Session sets them at its start)
    best = {name: getattr(state, name) for name in BEST_FIELDS}
    load_saved_state(session, path)
    saved = TrainState(**ckpt.load_train_state(path))  # this run's own: the same micro-batch and world size
    for item in dataclasses.fields(TrainState):
        setattr(state, item.name, getattr(saved, item.name))
    state.data = data  # a checkpoint from before it was recorded (one this run resumed from) has none
    kept = checkpoint_step(best["best_checkpoint"] or "")
    if kept is not None and kept <= saved.step:
        # the best known now is no newer than this checkpoint, so it is still on disk and still the best: a step that
        # became best after its checkpoint was written (a resumed pending evaluation, an evaluation asked for after a
        # save) is best in memory and in later checkpoints only, and the one rolled back to would bring back an older
        for name, value in best.items():
            setattr(state, name, value)
    if current and saved.hyperparameters and saved.hyperparameters != current:
        lines = apply_hyperparameters(session.optimizer, session.scheduler, saved.hyperparameters, current,
                                      engine_owned=session.accelerator.distributed_type.value == "DEEPSPEED")
        for line in lines:
            session.accelerator.print(f"rollback to {path.name}: {line}")
    state.hyperparameters = current or state.hyperparameters
    restore_hooks(session, state)


def restore_hooks(session, state: TrainState) -> None:
    """Each hook with a load_state_dict gets the state the checkpoint saved for it (by its hook key)."""
    for key, hook in zip(hook_keys(session.hooks), session.hooks, strict=True):
        saved = saved_hook_state(state.hooks, key)
        if hasattr(hook, "load_state_dict") and saved is not None:
            hook.load_state_dict(saved)


def check_best(session, state: TrainState, resumed_from: Path) -> list[str]:
    """A best value is compared only with values of the same metric in the same direction, and names a
    checkpoint of this run's directory (resuming from another run's checkpoint, its best is not here). What the
    start-up report must say when the best is tracked afresh."""
    name, greater = session.config.best_metric_name, session.config.best_is_greater
    here = checkpoints_dir(session.config.output_dir)
    note = None
    if state.best_checkpoint and resumed_from.resolve().parent != here.resolve():
        note = (f"the checkpoint's best model ({state.best_checkpoint}) is in {resumed_from.parent}, not in this run's "
                f"{here}: the best is tracked afresh")
    elif state.best_checkpoint and not (here / state.best_checkpoint).is_dir():
        note = (f"the checkpoint's best model ({state.best_checkpoint}) is no longer in {here} (deleted by hand, or "
                "by the rotation of a run before 2026-12-05 with --async_save): the best is tracked afresh")
    elif state.best_metric_name is not None and (state.best_metric_name, state.best_greater) != (name, greater):
        note = (f"the checkpoint's best model was chosen by {state.best_metric_name} "
                f"({'higher' if state.best_greater else 'lower'} is better); this run chooses by {name}: the best is "
                "tracked afresh")
    if note:
        state.best_metric = state.best_metric_name = state.best_greater = state.best_checkpoint = None
    return [note] if note else []


def exclusions_after(state: TrainState, config) -> list[list[int]]:
    """--on_spike rollback: the exclusions so far plus the spiked step's micro-batches ([epoch, position], the same
    on every process). They outlive the restore: a checkpoint older than an earlier rollback does not hold them."""
    return sorted(state.excluded_batches + [[state.epoch, b] for b in window_batches(state, config)])
