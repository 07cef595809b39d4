"""The run directory's layout: one name for each thing a run writes.

    output_dir/
      config.yaml          the resolved config (recipe arguments included)
      metrics.jsonl        one record per log / evaluation (and per warning: {"step", "warning"})
      predictions.jsonl    a recipe's generated outputs, one row per item (text generation)
      predict_results.jsonl  the test split's predictions with label names (text classification, as run_glue.py)
      all_results.json     the final metrics, written once at the end
      runs/                tracker logs (TensorBoard)
      mlflow.db            MLflow's SQLite tracking store (--report_to mlflow, unless MLFLOW_TRACKING_URI is set)
      checkpoints/step-00000120/   Accelerate state + train_state.json + manifest.json (written last);
                                   a stream's loader position per process (stream_position_rank<R>.pt)
      checkpoints/superseded/      checkpoints of an abandoned timeline (newer than the one a run resumed from), and
                                   the config.until-step-<N>.yaml files that described it
      report.md, report/   the run report and its plots
      diagnostics/         gradient flow, activation statistics, memory snapshots
      profiler/            torch.profiler traces
      model.safetensors, config.json, tokenizer ...   the exported final model
      model_factory.json   how to rebuild a plain nn.Module's architecture (a transformers model has config.json)
      crash_rank<R>.json   why a run stopped with an error (type, message, traceback, step), per rank
      run_files.json       which entries here the runs wrote and which they found (rundir/run_files.py): what
                           --overwrite_output_dir may delete
"""

from __future__ import annotations

import re
from pathlib import Path

CONFIG = "config.yaml"
HISTORY = "metrics.jsonl"
RESULTS = "all_results.json"
PREDICTIONS = "predictions.jsonl"
TEST_PREDICTIONS = "predict_results.jsonl"
TRACKER_DIR = "runs"
MLFLOW_DB = "mlflow.db"  # --report_to mlflow without MLFLOW_TRACKING_URI: the run's own SQLite tracking store
WANDB_DIR = "wandb"  # --report_to wandb without WANDB_DIR: the run's W&B files (offline runs: what `wandb sync` sends)
CHECKPOINTS_DIR = "checkpoints"
REPORT = "report.md"
# A section another command put into a run's report.md (verify's certificate) lies between these two markers; the
# report, written again (`accel-train report`, a resumed run's end), keeps it at its end.
KEPT_BEGIN = "<!-- accel-train: a section kept when the report is written again:"
KEPT_END = "<!-- accel-train: end of the kept section -->"
REPORT_DIR = "report"
DIAGNOSTICS_DIR = "diagnostics"
PROFILER_DIR = "profiler"
MODEL_FACTORY = "model_factory.json"
WEIGHTS = "model.safetensors"  # the final weights (a checkpoint holds its own); sharded: WEIGHTS_INDEX names the shards
WEIGHTS_INDEX = "model.safetensors.index.json"
CONFUSION_MATRIX_PLOT = "confusion_matrix.png"  # image_classification.py's test confusion matrix; the report shows it
CRASH_GLOB = "crash_rank*.json"  # crash_rank0.json, ...: the error that stopped a run, one file per rank that raised
# What marks a directory as holding a run (a new run there is refused unless resumed or overwritten).
EARLIER_CONFIG = "config.until-step-*.yaml"  # the config that trained the steps up to * (a resume there changed it)
EARLIER_CONFIG_NAME = re.compile(r"^config\.until-step-(\d{8,})\.yaml$")
RUN_FILES = (CONFIG, EARLIER_CONFIG, HISTORY, RESULTS, CHECKPOINTS_DIR, TRACKER_DIR, MLFLOW_DB, WANDB_DIR)
# What a fresh run clears of an older run's observability output.
OBSERVABILITY_FILES = (REPORT, REPORT_DIR, DIAGNOSTICS_DIR, PROFILER_DIR)
EXPORT_DIR = "export"  # accel-train export / --export_formats: export/FORMAT/...
NONFINITE_GLOB = "nonfinite_step*_rank*.json"  # where a non-finite loss or gradient first appeared, per rank
RUN_MANIFEST = "run_files.json"  # which top-level entries the runs wrote, and which were there before (foreign)


def aside(name: str) -> str:
    """Where a file that is replaced at once is written first, then renamed into place (.metrics.jsonl.tmp)."""
    return f".{name}.tmp"


# The asides of the run's files at the top of output_dir (config/ writes config.yaml's the same way): a kill between
# the write and the rename leaves one, the file itself intact. Never taken for a file of the user's; the next attempt
# removes them (run_files.begin_attempt).
ASIDE_FILES = tuple(aside(name) for name in (CONFIG, HISTORY, RUN_MANIFEST))

# The names (globs) of this package's layout at the top of output_dir: an entry by one of these names that appears
# after a run first started there is a run's, even when no run recorded it (`accel-train export` writes export/
# after the run; a killed run records nothing).
PACKAGE_NAMES = (*RUN_FILES, *OBSERVABILITY_FILES, EXPORT_DIR, PREDICTIONS, TEST_PREDICTIONS, MODEL_FACTORY,
                 CRASH_GLOB, NONFINITE_GLOB, CONFUSION_MATRIX_PLOT, "adapter")
# What a final model's save_pretrained may write (weights, configs, tokenizers, a LoRA's model card): generic names,
# which a base model in the same directory has too. Taken for a run's only when an attempt was killed before it
# recorded what it wrote; otherwise recorded (run_files.json) or the user's.
MODEL_FILES = ("*.safetensors", WEIGHTS_INDEX, "config.json", "generation_config.json", "preprocessor_config.json",
               "processor_config.json", "tokenizer*", "vocab.*", "merges.txt", "special_tokens_map.json",
               "added_tokens.json", "spiece.model", "chat_template.jinja", "adapter_config.json", "README.md")
WEIGHT_SHARDS = "model-*-of-*.safetensors"  # a sharded final model: WEIGHTS_INDEX names them
FINAL_WEIGHTS = (WEIGHTS, WEIGHTS_INDEX, WEIGHT_SHARDS)  # what the final save of any model may write

CHECKPOINT_PREFIX = "step-"
CHECKPOINT_NAME = re.compile(r"^step-(\d{8,})$")  # step-00000120; step-00000120.bak and the like are not ones
# Checkpoints of an abandoned timeline (newer than the one a run resumed from) are moved here, never deleted.
SUPERSEDED_DIR = "superseded"


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / CHECKPOINTS_DIR


def checkpoint_name(step: int) -> str:
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def checkpoint_step(name: str) -> int | None:
    """The step of a checkpoint directory name, or None for any other name."""
    match = CHECKPOINT_NAME.match(name)
    return int(match.group(1)) if match else None


def earlier_config(step: int) -> str:
    """The name config.yaml is kept under when a resume at `step` changes the settings (EARLIER_CONFIG)."""
    return EARLIER_CONFIG.replace("*", f"{step:08d}")


def earlier_config_step(name: str) -> int | None:
    """The step of a config.until-step-<step>.yaml name, or None for any other name."""
    match = EARLIER_CONFIG_NAME.match(name)
    return int(match.group(1)) if match else None


def stream_position_file(rank: int | str) -> str:
    """Inside a checkpoint: a stream's loader position on process `rank` (`"*"`: the glob of all of them)."""
    return f"stream_position_rank{rank}.pt"


def weight_average_file(rank: int | str) -> str:
    """Inside a checkpoint: the weight average (--ema_decay) of process `rank`, or of all processes as rank 0's
    when it is replicated (`"*"`: the glob of all of them)."""
    return f"weight_average_rank{rank}.safetensors"


def crash_file(output_dir: str | Path, rank: int) -> Path:
    return Path(output_dir) / f"crash_rank{rank}.json"
