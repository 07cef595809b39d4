"""User-facing errors: what was wrong, where, and what to do.

Every error a user can fix by changing a flag, a file or a path is a `UserError`. Entry points wrap
`main()` with `run_cli`, which prints the message (no stack trace) and exits with status 2, so a bad
flag never looks like a crash in a library.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


class UserError(Exception):
    """An error the user can fix; the message says what was wrong, where, and what to do."""

    kind = "error"


class ConfigError(UserError):
    kind = "config error"


class DataError(UserError):
    kind = "data error"


class CheckpointError(UserError):
    kind = "checkpoint error"


class LaunchError(UserError):
    kind = "launch error"


class ModelError(UserError):
    kind = "model error"


class ExportError(ModelError):
    """A model that cannot be exported, or an exported artifact that does not compute what the model computes."""

    kind = "export error"


class FinishError(UserError):
    """Training finished and its model was written, but the finish seam (a hook's on_finish: generation, test
    predictions, scoring) failed; the message says what is saved and where."""

    kind = "finish step failed"


class MetricsError(UserError):
    """An evaluation's metrics function raised or returned what is not a number, on some process (every process raises
    it, together); during training the message says where the training state was saved before it."""

    kind = "metrics failed"


class TrainingDiverged(UserError):
    """A non-finite loss or gradient under --on_nonfinite stop (or too many skipped steps)."""

    kind = "training stopped"


class PeerTimeout(UserError):
    """A collective waited --ddp_timeout seconds for processes that never arrived (hung, or killed outside it)."""

    kind = "distributed error"


class Preempted(Exception):
    """SIGTERM received: a checkpoint was saved at the step boundary and the run stopped on purpose."""


class RunFinished(Exception):
    """`--resume_from_checkpoint auto` found the run in output_dir finished, with nothing to continue: nothing was
    trained or deleted. The message says where its results are; `run_cli` prints it and exits 0."""


EXIT_USER_ERROR = 2


def run_cli(main: Callable[[Sequence[str] | None], object], argv: Sequence[str] | None = None) -> None:
    """Run a recipe's `main(argv)`; turn a `UserError` (or running out of memory) into a one-paragraph
    message and exit code 2. A SIGTERM checkpoint (`Preempted`) and a run that had finished already (`RunFinished`)
    exit 0.

    Set `ACCEL_TRAIN_TRACEBACK=1` to see the full stack trace as well. With `ACCEL_TRAIN_STATUS_FILE=PATH`, the
    main process writes how it ended there as JSON ({"exit": 0 | 2, "kind": ..., "message": ...}): a launcher
    (`accelerate launch` reports every failure as exit code 1) does not pass the code on, a supervisor can read it.
    """
    import torch

    try:
        main(argv)
    except Preempted as stop:
        _say(f"accel_train: {stop}")
        _status(0, "preempted", str(stop))
        sys.exit(0)
    except RunFinished as done:
        _say(f"accel_train: {done}", sys.stdout)
        _status(0, "already finished", str(done))
        sys.exit(0)
    except Exception as err:  # noqa: BLE001 - anything else keeps its traceback (re-raised below)
        if isinstance(err, UserError):
            message = f"accel_train {err.kind}: {err}"
        elif isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err):
            message = (f"accel_train out of memory: {err}. Lower --per_device_train_batch_size and raise "
                       "--gradient_accumulation_steps (same global batch), or use --auto_find_batch_size, "
                       "--gradient_checkpointing or --mixed_precision bf16; under a token budget (the NLP recipes' "
                       "default) --max_tokens_per_batch bounds a micro-batch: give a lower number (another plan: "
                       "resume from this run's checkpoints only with its own). Saved checkpoints are intact.")
        else:
            raise
        _status(EXIT_USER_ERROR, getattr(err, "kind", "out of memory"), message)
        if os.environ.get("ACCEL_TRAIN_TRACEBACK"):
            raise
        _say(message)
        sys.exit(EXIT_USER_ERROR)
    _status(0, "finished", "")


def _status(code: int, kind: str, message: str) -> None:
    path = os.environ.get("ACCEL_TRAIN_STATUS_FILE")
    if path and os.environ.get("RANK", "0") == "0":
        import json

        Path(path).write_text(json.dumps({"exit": code, "kind": kind, "message": message}))


def _say(message: str, stream=None) -> None:
    """Every rank usually hits the same error: say it once (on stderr unless `stream`)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"\n{message}", file=stream or sys.stderr, flush=True)
