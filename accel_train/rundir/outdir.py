"""The output directory: refuse to mix two runs, to write over files no run wrote, or a directory that cannot be
written; decide where a run resumes (`--resume_from_checkpoint auto`: the newest complete checkpoint, a first start,
or nothing to do when the run finished); clear a replaced run of what runs wrote there (run_files.py), and write the
resolved config."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from ..config import TrainConfig, save_config
from ..config.validation import AUTO_TOKENS_VARY
from ..errors import CheckpointError, ConfigError, RunFinished, UserError
from . import run_files
from .checkpoint import fsync_dir, put_back_aside, resolve_checkpoint
from .layout import (
    CONFIG,
    CRASH_GLOB,
    EARLIER_CONFIG,
    FINAL_WEIGHTS,
    PACKAGE_NAMES,
    RESULTS,
    RUN_FILES,
    SUPERSEDED_DIR,
    checkpoint_step,
    checkpoints_dir,
    crash_file,
    earlier_config,
    earlier_config_step,
)


def refuse_mixed_runs(config: TrainConfig, model_names: Callable[[], Sequence[str]] | None = None) -> None:
    """`ConfigError` when output_dir holds an earlier run that this one would mix with (neither resumed nor
    overwriting), or files no run of this package wrote there (a base model's config.json and weights, a Trainer's
    all_results.json) that this run would write over: by this package's layout names, and by `model_names()` (what
    the final model writes, once the model is known; else its weights' names). Reads only: `build_accelerator`
    calls it, so a clash is refused before a recipe loads its model and data. The message names flags or
    TrainConfig fields, the way the config was made."""
    out = Path(config.output_dir)
    where = "--output_dir" if config.origin == "flags" else "output_dir"
    files = run_files.survey(out)
    existing = [name for name in RUN_FILES if name in files.written]
    if existing and not config.resume_from_checkpoint and not config.overwrite_output_dir:
        raise ConfigError(
            f"{where} {out} already holds a run ({', '.join(existing)}). Continue it with "
            f"{config.setting('resume_from_checkpoint', 'latest')}, replace it with "
            f"{config.setting('overwrite_output_dir', True)}, or choose another {where}."
        )
    if files.foreign:
        names = (*PACKAGE_NAMES, *(model_names() if model_names is not None else FINAL_WEIGHTS))
        clash = run_files.collisions(files, names)
        if clash:
            unrecorded = "" if files.recorded else (
                " (if they are the files of a run made before accel_train kept run_files.json, delete them)")
            raise ConfigError(
                f"{where} {out} holds {', '.join(clash)}, which no run of accel_train wrote there, and this run "
                f"would write over them: its results, logs and final model use those names. Move them out of "
                f"{out}{unrecorded}, or choose another {where}. "
                f"{config.setting('overwrite_output_dir', True)} deletes only what runs of accel_train wrote.")


def check_output_dir(config: TrainConfig, rank: int,
                     model_names: Callable[[], Sequence[str]] | None = None) -> None:
    """Refuse to mix two runs in one directory, to write over files no run wrote (`refuse_mixed_runs`), or a
    directory that cannot be written. Writes nothing that could be mistaken for a run, so a refused start leaves
    the directory as it was. Every rank checks."""
    out = Path(config.output_dir)
    refuse_mixed_runs(config, model_names)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f"{run_files.WRITE_PROBE}{rank}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"--output_dir {out} is not writable ({err.strerror}). Choose another directory.") from None


# What a restarted job may change without being another run: how it resumes, and the batch split the automatic
# batch-size search found (it may find another on other hardware; the global batch is checked on resume)
RESTART_FIELDS = {"resume_from_checkpoint", "overwrite_output_dir"}
FITTED_FIELDS = {"per_device_train_batch_size", "gradient_accumulation_steps"}


def resume_target(accelerator: Accelerator, config: TrainConfig, extra_configs=()) -> Path | None:
    """The checkpoint this run resumes from, or None for a fresh start. `auto` is the flag for restarted and
    requeued jobs, the same command at the first start and at every restart: the newest complete checkpoint of
    this run, or a fresh start when there is none; when the run there finished and there is nothing to continue,
    `RunFinished` (nothing is trained, nothing deleted). Decided by the main process and sent to every rank, so the
    ranks cannot disagree (node-local disks, a checkpoint appearing between two ranks' looks). A directory that
    holds a run with another config is refused, naming the fields (`latest` resumes with changes)."""
    spec = config.resume_from_checkpoint
    if not spec:
        return None
    if accelerator.is_main_process:  # a checkpoint a crash left aside is resumed under its own name
        put_back_aside(config.output_dir)
    accelerator.wait_for_everyone()
    if spec != "auto":
        return resolve_checkpoint(config.output_dir, spec)
    decision: list = [None]
    if accelerator.is_main_process:
        try:
            changed = changed_fields(config, extra_configs)
            path = None if changed else resolve_checkpoint(config.output_dir, "auto")
            finished = None if changed else finished_run(config, path)
            decision = [("changed", changed) if changed else ("finished", finished) if finished else
                        ("ok", None if path is None else str(path))]
        except CheckpointError as err:
            decision = [("error", str(err))]
    if accelerator.num_processes > 1:
        broadcast_object_list(decision)
    kind, value = decision[0]
    if kind == "error":
        raise CheckpointError(value)
    if kind == "finished":
        raise RunFinished(value)
    if kind == "changed":
        raise ConfigError(
            f"--resume_from_checkpoint auto: {config.output_dir} holds a run with another config ("
            + ", ".join(f"{k}: {old!r} there, {new!r} now" for k, (old, new) in value.items())
            + "). auto restarts the same job; to continue that run with changes use --resume_from_checkpoint "
            "latest, or choose another --output_dir."
            + (f" ({AUTO_TOKENS_VARY}.)" if "max_tokens_per_batch" in value else ""))
    return None if value is None else Path(value)


def changed_fields(config: TrainConfig, extra_configs=(), saved_file: Path | None = None) -> dict[str, tuple]:
    """Fields whose value differs from the config.yaml the run in output_dir saved ({} when there is none), or from
    the config in `saved_file`."""
    saved_file = saved_file or Path(config.output_dir) / CONFIG
    if not saved_file.is_file():
        return {}
    saved = yaml.safe_load(saved_file.read_text()) or {}
    current: dict = {}
    for cfg in [*extra_configs, config]:
        current.update(dataclasses.asdict(cfg))
    current = yaml.safe_load(yaml.safe_dump(current, sort_keys=False))  # the types a YAML round trip gives
    ignored = RESTART_FIELDS | (FITTED_FIELDS if config.auto_find_batch_size else set())
    return {k: (saved[k], v) for k, v in current.items() if k in saved and k not in ignored and saved[k] != v}


def finished_run(config: TrainConfig, checkpoint: Path | None) -> str | None:
    """`auto` on a run that finished (run_files.json says so, all_results.json is there) with nothing to continue
    (no checkpoint, or the last one is where it finished after all its steps): the message saying so, else None.
    A run a hook stopped early continues from its checkpoint, as a clean interruption does, but for one that early
    stopping ended (run_files records `ended_by`): a restart trained on to its next evaluation and replaced the
    model and results."""
    out = Path(config.output_dir)
    record = run_files.read(out)
    done = record.finished if record is not None else None
    if not done or not (out / RESULTS).is_file():
        return None
    ended = done.get("ended_by")  # early stopping: finished for good, not interrupted
    if checkpoint is not None and (checkpoint_step(checkpoint.name) != done["step"]
                                   or (done["step"] < done["total_steps"] and not ended)):
        return None
    early = f" (stopped early by {ended or 'a hook'}; {done['total_steps']} planned)" \
        if done["step"] < done["total_steps"] else ""
    return (f"{out} holds a run that already finished at step {done['step']}{early}: there is nothing to resume, so "
            f"nothing was trained or deleted. Its results are in {out / RESULTS}, its model in {out}. To train it "
            f"again, add {config.setting('overwrite_output_dir', True)} (deletes that run's files) or choose "
            f"another output_dir.")


def start_run_dir(accelerator: Accelerator, config: TrainConfig, extra_configs=(), resumed_at: int | None = None,
                  record: dict | None = None) -> list[str]:
    """Record what output_dir holds and that an attempt is open (run_files.py), clear a replaced run
    (--overwrite_output_dir, or `auto` starting afresh over an attempt that saved no checkpoint: everything runs
    wrote there, so that no old model, export or prediction is later taken for the new run's, and nothing else),
    and write the resolved config (with `record`, what the run's objects are; a resume at step `resumed_at` with
    changed settings keeps the config that trained the steps before it, `keep_earlier_config`). Returns the notes for
    the start-up report (main process)."""
    out = Path(config.output_dir)
    resumed = resumed_at is not None
    replace = (config.overwrite_output_dir or config.resume_from_checkpoint == "auto") and not resumed
    notes = []
    if accelerator.is_main_process:
        deleted, kept = run_files.begin_attempt(out, replace)
        if deleted:  # what replacing a run deleted, and what it left because no run wrote it
            notes.append(f"replaced the earlier run: deleted what runs wrote in {out} ({_some(deleted)})"
                         + (f"; kept {_some(kept)}: not written by a run, never deleted by one" if kept else ""))
        if resumed:
            notes += keep_earlier_config(out, config, extra_configs, resumed_at)
        save_config([*extra_configs, config], out / CONFIG, record)
        for stale in out.glob(CRASH_GLOB):  # this attempt's errors, not an earlier one's
            stale.unlink()
    accelerator.wait_for_everyone()
    return notes


def keep_earlier_config(out: Path, config: TrainConfig, extra_configs, step: int) -> list[str]:
    """A resume at `step` rewrites config.yaml with this run's; the run directory still says which config trained
    each step of the history: config.until-step-<K>.yaml those after the previous such file up to K, config.yaml the
    rest. With changed settings, the config that trained `step` is kept as config.until-step-<step>.yaml: the
    config.yaml replaced here, or the first such file at `step` or after. A second resume from one checkpoint keeps
    the one that is there (the config.yaml then is the abandoned attempt's, which trained none of the steps kept);
    the files after `step` describe the abandoned timeline and move to checkpoints/superseded/ with its checkpoints.
    The change is said."""
    earlier = sorted((at, path) for path in out.glob(EARLIER_CONFIG)
                     if (at := earlier_config_step(path.name)) is not None)
    trained = next((path for at, path in earlier if at >= step), out / CONFIG)  # the config that trained `step`
    changed = changed_fields(config, extra_configs, trained)
    kept = out / earlier_config(step)
    if changed and trained != kept:
        kept.write_text(trained.read_text())
    for at, path in earlier:
        if at > step:
            os.replace(path, superseded_place(out, path.name))
    if not changed:
        return []
    since = max((at for at, _ in earlier if at < step), default=0)
    listed = ", ".join(f"{name} {old} -> {new}" for name, (old, new) in changed.items())
    return [f"resumed at step {step} with changed settings ({listed}): config.yaml holds this run's, {kept.name} "
            f"the one that trained steps {since + 1}-{step}"]


def _some(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def record_crash(output_dir: str | Path, rank: int, step: int, error: BaseException) -> Path | None:
    """Write why the run stopped (error type, message, traceback, step) to crash_rank<R>.json in the run directory,
    where `accel-train report` shows it. Every rank that raised writes its own; never raises itself."""
    record = {"rank": rank, "step": step, "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "error": type(error).__name__, "message": str(error),
              "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__))[-8000:]}
    path = crash_file(output_dir, rank)
    if rank == 0:  # the attempt ended: what it wrote is the run's (run_files.json)
        with contextlib.suppress(OSError, UserError):  # the original error matters more than this record
            run_files.end_attempt(output_dir)
    try:
        path.write_text(json.dumps(record, indent=2))
    except OSError:  # the original error matters more than this record
        return None
    return path


def is_collective_timeout(error: BaseException) -> bool:
    """A collective that gave up waiting for the other processes (gloo's "Timed out waiting", NCCL's watchdog)."""
    import torch.distributed as dist

    backend_error = getattr(dist, "DistBackendError", ())
    text = str(error).lower()
    return isinstance(error, RuntimeError) and (isinstance(error, backend_error) or "timed out" in text
                                                or "timeout" in text) and dist.is_initialized()


def silent_ranks(output_dir: str | Path, world_size: int, rank: int, wait: float) -> list[int]:
    """The ranks that wrote no crash record within `wait` seconds of this rank's own: the processes that hung or
    were killed (every rank that raised writes crash_rank<R>.json; the others waiting in the same collective time
    out about when this one did)."""
    deadline = time.monotonic() + wait
    while True:
        silent = [r for r in range(world_size) if r != rank and not crash_file(output_dir, r).exists()]
        if not silent or time.monotonic() > deadline:
            return silent
        time.sleep(0.2)


def peer_timeout_message(output_dir: str | Path, world_size: int, rank: int, step: int, timeout: int,
                         error: BaseException) -> str:
    silent = silent_ranks(output_dir, world_size, rank, min(10.0, timeout))
    who = (f"rank(s) {', '.join(map(str, silent))} never arrived and recorded no error: hung (a stuck data loader, "
           "a wedged node) or killed" if silent else "every other rank timed out too (see their crash records)")
    return (f"rank {rank} waited --ddp_timeout {timeout} s in a collective after step {step} and gave up "
            f"({str(error).splitlines()[0][-160:]}): {who}. The processes stop here instead of waiting forever; "
            f"the crash records are in {output_dir}. If a step can legitimately take longer on one rank (a long "
            "evaluation or checkpoint write), raise --ddp_timeout; resume with --resume_from_checkpoint auto.")


def supersede_newer(output_dir: str | Path, step: int) -> list[Path]:
    """Move the checkpoints newer than `step` (complete or not) into checkpoints/superseded/: a run that resumed
    from step `step` starts a new timeline, and `latest` must never resume the abandoned one. Nothing is deleted.
    Main process only; returns the new locations."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    moved = []
    for path in sorted(root.iterdir()):
        newer = checkpoint_step(path.name)
        if not path.is_dir() or newer is None or newer <= step:
            continue
        target = superseded_place(output_dir, path.name)
        os.replace(path, target)
        moved.append(target)
    if moved:
        fsync_dir(root)
    return moved


def superseded_place(output_dir: str | Path, name: str) -> Path:
    """Where an entry of an abandoned timeline named `name` goes: checkpoints/superseded/<name>, made ready; a new
    name where one is there already (superseded twice at the same step: both kept)."""
    folder = checkpoints_dir(output_dir) / SUPERSEDED_DIR
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / name
    suffix = 1
    while target.exists():  # step-00000012-1, config.until-step-00000012-1.yaml
        target = folder / f"{Path(name).stem}-{suffix}{Path(name).suffix}"
        suffix += 1
    return target
