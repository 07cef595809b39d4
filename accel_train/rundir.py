"""The run directory: refuse to mix two runs, write the resolved config, and resume from a checkpoint with the
data position re-derived from the samples consumed (so a checkpoint can move between world sizes)."""

from __future__ import annotations

import shutil
from pathlib import Path

from accelerate import Accelerator

from . import checkpoint as ckpt
from .config import TrainConfig, save_config
from .errors import CheckpointError, ConfigError
from .hooks import hook_key
from .optim import StepPlan
from .state import TrainState

RUN_FILES = ("config.yaml", "metrics.jsonl", "all_results.json", "checkpoints", "runs")


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
        save_config([*extra_configs, config], out / "config.yaml")
    accelerator.wait_for_everyone()


def resume(accelerator: Accelerator, config: TrainConfig, plan: StepPlan, shapes: dict, hooks: list) -> TrainState:
    """Load a checkpoint and re-derive the data position from the samples consumed in the current epoch."""
    path = ckpt.resolve_checkpoint(config.output_dir, config.resume_from_checkpoint)
    manifest = ckpt.verify_checkpoint(path)
    ckpt.check_compatible(path, manifest, shapes)
    saved = ckpt.load_train_state(path)
    state = TrainState(**saved)
    if state.global_batch_size != plan.global_batch_size:
        raise CheckpointError(
            f"{path} was trained with a global batch of {state.global_batch_size} samples per step, this run has "
            f"{plan.global_batch_size} (per-device batch x processes x accumulation). The schedule and data "
            "position would not line up: keep the same global batch when resuming."
        )
    per_batch = config.per_device_train_batch_size * accelerator.num_processes
    if state.samples_in_epoch % per_batch:
        raise CheckpointError(
            f"{path}: {state.samples_in_epoch} samples of the epoch were consumed, which is not a whole number "
            f"of batches of {per_batch} for this world size; resume with the original world size."
        )
    accelerator.load_state(str(path))
    state.batch_in_epoch = state.samples_in_epoch // per_batch
    state.world_size = accelerator.num_processes
    for i, hook in enumerate(hooks):
        if hasattr(hook, "load_state_dict") and hook_key(hook, i) in state.hooks:
            hook.load_state_dict(state.hooks[hook_key(hook, i)])
    if manifest.get("world_size") != accelerator.num_processes:
        accelerator.print(
            f"note: {path} was written by {manifest.get('world_size')} process(es), resuming on "
            f"{accelerator.num_processes}; the data position is re-derived from the samples consumed. Random "
            "streams (dropout, augmentation) of processes the checkpoint did not have start afresh."
        )
    accelerator.print(f"resumed from {path} at step {state.step} (epoch {state.epoch}, batch {state.batch_in_epoch})")
    return state
