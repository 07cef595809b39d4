"""The output directory: refuse to mix two runs, refuse one that cannot be written, clear a replaced run and
write the resolved config."""

from __future__ import annotations

import shutil
from pathlib import Path

from accelerate import Accelerator

from ..config import TrainConfig, save_config
from ..errors import ConfigError
from .layout import CONFIG, RUN_FILES


def check_output_dir(config: TrainConfig, rank: int) -> list[str]:
    """Refuse to mix two runs in one directory, or a directory that cannot be written. Writes nothing
    that could be mistaken for a run, so a refused start leaves the directory as it was. Every rank checks."""
    out = Path(config.output_dir)
    existing = [name for name in RUN_FILES if (out / name).exists()]
    if existing and not config.resume_from_checkpoint and not config.overwrite_output_dir:
        raise ConfigError(
            f"--output_dir {out} already holds a run ({', '.join(existing)}). Continue it with "
            "--resume_from_checkpoint latest, replace it with --overwrite_output_dir, or choose another --output_dir."
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{rank}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ConfigError(f"--output_dir {out} is not writable ({err.strerror}). Choose another directory.") from None
    return existing


def start_run_dir(accelerator: Accelerator, config: TrainConfig, existing: list[str], extra_configs=()) -> None:
    """Clear a replaced run (--overwrite_output_dir) and write the resolved config."""
    out = Path(config.output_dir)
    if accelerator.is_main_process:
        if existing and config.overwrite_output_dir and not config.resume_from_checkpoint:
            for name in existing:
                target = out / name
                shutil.rmtree(target) if target.is_dir() else target.unlink()
        save_config([*extra_configs, config], out / CONFIG)
    accelerator.wait_for_everyone()
