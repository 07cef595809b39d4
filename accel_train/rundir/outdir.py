"""The output directory: refuse to mix two runs, refuse one that cannot be written, decide where a run resumes
(`--resume_from_checkpoint auto`: the newest complete checkpoint, or a first start), clear a replaced run and
write the resolved config."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
import traceback
from pathlib import Path

import yaml
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list

from ..config import TrainConfig, save_config
from ..errors import CheckpointError, ConfigError
from .checkpoint import resolve_checkpoint
from .layout import CONFIG, CRASH_GLOB, RUN_ARTIFACTS, RUN_FILES, crash_file


def refuse_mixed_runs(config: TrainConfig) -> list[str]:
    """The files of an earlier run in output_dir; `ConfigError` when this run would mix with them (neither resumed
    nor overwriting). Reads only: `build_accelerator` calls it, so a clash is refused before a recipe loads its model
    and data. The message names flags or TrainConfig fields, the way the config was made."""
    out = Path(config.output_dir)
    existing = [name for name in RUN_FILES if (out / name).exists()]
    if existing and not config.resume_from_checkpoint and not config.overwrite_output_dir:
        where = "--output_dir" if config.origin == "flags" else "output_dir"
        raise ConfigError(
            f"{where} {out} already holds a run ({', '.join(existing)}). Continue it with "
            f"{config.setting('resume_from_checkpoint', 'latest')}, replace it with "
            f"{config.setting('overwrite_output_dir', True)}, or choose another {where}."
        )
    return existing


def check_output_dir(config: TrainConfig, rank: int) -> list[str]:
    """Refuse to mix two runs in one directory, or a directory that cannot be written. Writes nothing
    that could be mistaken for a run, so a refused start leaves the directory as it was. Every rank checks."""
    out = Path(config.output_dir)
    existing = refuse_mixed_runs(config)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{rank}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"--output_dir {out} is not writable ({err.strerror}). Choose another directory.") from None
    return existing


# What a restarted job may change without being another run: how it resumes, and the batch split the automatic
# batch-size search found (it may find another on other hardware; the global batch is checked on resume)
RESTART_FIELDS = {"resume_from_checkpoint", "overwrite_output_dir"}
FITTED_FIELDS = {"per_device_train_batch_size", "gradient_accumulation_steps"}


def resume_target(accelerator: Accelerator, config: TrainConfig, extra_configs=()) -> Path | None:
    """The checkpoint this run resumes from, or None for a fresh start. `auto` is the flag for restarted and
    requeued jobs, the same command at the first start and at every restart: the newest complete checkpoint of
    this run, or a fresh start when there is none — decided by the main process and sent to every rank, so the
    ranks cannot disagree (node-local disks, a checkpoint appearing between two ranks' looks). A directory that
    holds a run with another config is refused, naming the fields (`latest` resumes with changes)."""
    spec = config.resume_from_checkpoint
    if not spec:
        return None
    if spec != "auto":
        return resolve_checkpoint(config.output_dir, spec)
    decision: list = [None]
    if accelerator.is_main_process:
        try:
            changed = changed_fields(config, extra_configs)
            path = resolve_checkpoint(config.output_dir, "auto")
            decision = [("ok", None if path is None else str(path))] if not changed else [("changed", changed)]
        except CheckpointError as err:
            decision = [("error", str(err))]
    if accelerator.num_processes > 1:
        broadcast_object_list(decision)
    kind, value = decision[0]
    if kind == "error":
        raise CheckpointError(value)
    if kind == "changed":
        raise ConfigError(
            f"--resume_from_checkpoint auto: {config.output_dir} holds a run with another config ("
            + ", ".join(f"{k}: {old!r} there, {new!r} now" for k, (old, new) in value.items())
            + "). auto restarts the same job; to continue that run with changes use --resume_from_checkpoint "
            "latest, or choose another --output_dir.")
    return None if value is None else Path(value)


def changed_fields(config: TrainConfig, extra_configs=()) -> dict[str, tuple]:
    """Fields whose value differs from the config.yaml the run in output_dir saved ({} when there is none)."""
    saved_file = Path(config.output_dir) / CONFIG
    if not saved_file.is_file():
        return {}
    saved = yaml.safe_load(saved_file.read_text()) or {}
    current: dict = {}
    for cfg in [*extra_configs, config]:
        current.update(dataclasses.asdict(cfg))
    current = yaml.safe_load(yaml.safe_dump(current, sort_keys=False))  # the types a YAML round trip gives
    ignored = RESTART_FIELDS | (FITTED_FIELDS if config.auto_find_batch_size else set())
    return {k: (saved[k], v) for k, v in current.items() if k in saved and k not in ignored and saved[k] != v}


def start_run_dir(accelerator: Accelerator, config: TrainConfig, existing: list[str], extra_configs=(),
                  resumed: bool = False) -> None:
    """Clear a replaced run (--overwrite_output_dir, or `auto` starting afresh over an attempt that saved no
    checkpoint: everything a run writes there, `RUN_ARTIFACTS`, so that no old model, export or prediction is later
    taken for the new run's) and write the resolved config."""
    out = Path(config.output_dir)
    replace = config.overwrite_output_dir or config.resume_from_checkpoint == "auto"
    if accelerator.is_main_process:
        if existing and replace and not resumed:
            for target in {path for pattern in RUN_ARTIFACTS for path in out.glob(pattern)}:
                shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
        save_config([*extra_configs, config], out / CONFIG)
        for stale in out.glob(CRASH_GLOB):  # this attempt's errors, not an earlier one's
            stale.unlink()
    accelerator.wait_for_everyone()


def record_crash(output_dir: str | Path, rank: int, step: int, error: BaseException) -> Path | None:
    """Write why the run stopped (error type, message, traceback, step) to crash_rank<R>.json in the run directory,
    where `accel-train report` shows it. Every rank that raised writes its own; never raises itself."""
    record = {"rank": rank, "step": step, "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "error": type(error).__name__, "message": str(error),
              "traceback": "".join(traceback.format_exception(type(error), error, error.__traceback__))[-8000:]}
    path = crash_file(output_dir, rank)
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
