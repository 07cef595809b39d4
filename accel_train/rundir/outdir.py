"""The output directory: refuse to mix two runs, refuse one that cannot be written, clear a replaced run and
write the resolved config."""

from __future__ import annotations

import json
import shutil
import time
import traceback
from pathlib import Path

from accelerate import Accelerator

from ..config import TrainConfig, save_config
from ..errors import ConfigError
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


def start_run_dir(accelerator: Accelerator, config: TrainConfig, existing: list[str], extra_configs=()) -> None:
    """Clear a replaced run (--overwrite_output_dir: everything a run writes there, `RUN_ARTIFACTS`, so that no old
    model, export or prediction is later taken for the new run's) and write the resolved config."""
    out = Path(config.output_dir)
    if accelerator.is_main_process:
        if existing and config.overwrite_output_dir and not config.resume_from_checkpoint:
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
