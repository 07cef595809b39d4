"""TrainConfig: every setting the loop reads, with its defaults, help text and validation. Field names are
`transformers.TrainingArguments`' wherever the concept is the same, so habits carry over. A config is frozen."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from ..errors import ConfigError
from .validation import EXPORT_FORMATS, OPTIMIZERS, TORCH_SCHEDULERS, parse_tokens, validate, validate_observability

# Metrics where lower is better, matched as whole words of the name (eval_mse, eval_i2t_median_rank, ...).
LOWER_IS_BETTER = ("loss", "mse", "mae", "rmse", "perplexity", "ppl", "error", "wer", "cer", "median_rank")


def greater_is_better_for(metric: str) -> bool:
    """The direction of a metric, read from its name: lower is better for losses and errors (loss, mse, mae,
    rmse, perplexity, error, wer, cer, median_rank), higher for everything else (accuracy, f1, recall, ...)."""
    name = f"_{metric.lower()}_"
    return not any(f"_{word}_" in name for word in LOWER_IS_BETTER)


@dataclass(frozen=True)
class TrainConfig:
    """Everything the loop needs. Field names are `TrainingArguments`' where the concept is the same.

    `origin` says how the user sets a field ("code": `TrainConfig(name=value)`; "flags": `--name value`, for a
    config from `parse_config`), so that messages name the right one; `given`, for a config from `parse_config`, the
    fields its flags or YAML file set (not a recipe's defaults). `replace(**changes)` keeps both."""

    origin: ClassVar[str] = "code"
    given: ClassVar[frozenset[str]] = frozenset()  # parse_config: the fields its flags or YAML file set

    # --- where the run lives
    output_dir: str = field(default="outputs/run",
                            metadata={"help": "Run directory: config, checkpoints, logs, model."})
    overwrite_output_dir: bool = field(
        default=False, metadata={"help": "Delete what earlier runs wrote in output_dir (output_dir/run_files.json "
                                         "records it) instead of refusing to start; files no run wrote are kept."}
    )
    resume_from_checkpoint: str | None = field(
        default=None, metadata={"help": "'latest' (newest complete checkpoint in output_dir), a checkpoint path, or "
                                        "'auto': the newest complete checkpoint if there is one, else a fresh start, "
                                        "or nothing (exit 0) when the run there finished (the flag for restarted and "
                                        "requeued jobs)."}
    )
    run_name: str | None = field(default=None, metadata={"help": "Name shown by trackers."})

    # --- how long
    num_train_epochs: float = field(default=3.0, metadata={"help": "Epochs (may be fractional)."})
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps; overrides num_train_epochs when > 0."})

    # --- batches
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Micro-batch size on each process."})
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Evaluation batch size on each process."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    max_tokens_per_batch: int | str = field(default=0, metadata={
        "help": "Training micro-batches of as many examples as fit in N padded tokens (rows x longest row) instead "
                "of --per_device_train_batch_size examples (0: off). auto: the mean padded tokens of the "
                "length-grouped batches of --per_device_train_batch_size (at least the longest example), about as "
                "many steps an epoch with less padding. Needs the examples' lengths (make_loader's lengths=); not with "
                "a stream or --packing (docs/token_batches.md)."})
    dataloader_num_workers: int | None = field(default=None, metadata={
        "help": "DataLoader worker processes (default: 4 beside a GPU, kept between epochs; 0 on a CPU, where "
                "workers only take cores from the training step)."})
    dataloader_pin_memory: bool = field(default=True, metadata={"help": "Pin host memory when on an accelerator."})
    dataloader_persistent_workers: bool | None = field(default=None, metadata={
        "help": "Keep workers between epochs (default: with the default workers beside a GPU)."})
    dataloader_drop_last: bool = field(default=False, metadata={"help": "Drop the last incomplete training batch."})

    # --- optimisation
    optim: str = field(default="adamw", metadata={"help": f"One of {OPTIMIZERS}."})
    learning_rate: float = field(default=5e-5, metadata={"help": "Peak learning rate."})
    weight_decay: float = field(default=0.0, metadata={"help": "Weight decay, not on biases/norms: decoupled for "
                                                                   "adamw and muon, L2 for adam and sgd."})
    adam_beta1: float = field(default=0.9, metadata={"help": "Adam's first-moment decay."})
    adam_beta2: float = field(default=0.999, metadata={"help": "Adam's second-moment decay."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "Adam's epsilon (added to the denominator)."})
    sgd_momentum: float = field(default=0.9, metadata={"help": "Momentum for optim=sgd."})
    muon_lr_ratio: float = field(default=1.0, metadata={
        "help": "optim=muon: each Muon group's peak rate as a multiple of its AdamW rate (--learning_rate, or a "
                "group's own). 1 (default): Muon scales its update to AdamW's RMS (torch's adjust_lr_fn="
                "'match_rms_adamw'), so the same rate serves both (docs/optimizers.md)."})
    scale_lr: Literal["none", "linear", "sqrt"] = field(
        default="none",
        metadata={"help": "Scale --learning_rate with the global batch size against --scale_lr_reference_batch: "
                          "linear (Goyal et al. 2017) or sqrt; none (default) uses it as given."},
    )
    scale_lr_reference_batch: int = field(
        default=256, metadata={"help": "The global batch size at which --learning_rate is meant (--scale_lr)."}
    )
    max_grad_norm: float = field(default=1.0, metadata={"help": "Clip the global grad norm; <= 0 turns it off."})
    label_smoothing_factor: float = field(default=0.0, metadata={"help": "Label smoothing for cross-entropy."})
    ema_decay: float = field(default=0.0, metadata={
        "help": "Keep an exponential moving average of the weights with this decay (e.g. 0.999; 0: off), evaluated "
                "beside the live weights (eval_ema_*) and checkpointed with the run."})
    ema_warmup: bool = field(default=True, metadata={
        "help": "Warm the average's decay up as min(decay, (1 + t) / (10 + t)) after t steps (TF's rule)."})
    save_ema_as_final: bool = field(default=False, metadata={
        "help": "Write the averaged weights as the final model (and run the finish seam on them)."})

    # --- learning-rate schedule (counted in optimizer steps)
    lr_scheduler_type: str = field(
        default="linear",
        metadata={"help": "A transformers.get_scheduler name, or torch's: " + ", ".join(TORCH_SCHEDULERS)},
    )
    lr_scheduler_kwargs: str | None = field(
        default=None, metadata={"help": 'JSON of scheduler arguments, e.g. \'{"step_size": 100, "gamma": 0.5}\' '
                                        "(a dict in Python)."}
    )
    scheduler_interval: str = field(default="step", metadata={
        "help": "When a scheduler object of your own (train(scheduler=...)) is stepped: step (after every optimizer "
                "step) or epoch (once, at each epoch's end, as torch's tutorials step a StepLR). A ReduceLROnPlateau "
                "steps at each evaluation whatever this says; the schedules accel_train builds count optimizer "
                "steps."})
    warmup_steps: float = field(
        default=0, metadata={"help": "Warmup: an int number of steps, or a float in [0, 1) read as a ratio."}
    )
    warmup_ratio: float | None = field(
        default=None, metadata={"help": "transformers 4.x name for a warmup ratio; same as --warmup_steps 0.x."}
    )

    # --- precision and reproducibility
    mixed_precision: Literal["no", "fp16", "bf16", "auto"] | None = field(
        default=None, metadata={"help": "no / fp16 / bf16; auto: bf16 where the hardware computes it natively (a GPU "
                                        "with bf16, a CPU with AVX512-BF16 or AMX), else fp32, unless the launcher "
                                        "asked for a precision; default: what `accelerate launch`/`accelerate config` "
                                        "set."}
    )
    seed: int = field(default=42, metadata={"help": "Seed for model init, dropout and data order."})
    data_seed: int | None = field(default=None, metadata={"help": "Seed for data order only (default: seed)."})
    expected_world_size: int | None = field(
        default=None, metadata={"help": "Fail at start unless exactly this many processes are running."}
    )
    ddp_timeout: int = field(default=1800, metadata={
        "help": "Seconds a process waits in a collective for the others (the process group's timeout): past it, a "
                "hung or dead peer is an error that names the ranks, not a hang. The Trainer's name and default."})

    # --- speed
    torch_compile: bool = field(default=False,
                                metadata={"help": "torch.compile the model (Accelerate's dynamo plugin)."})
    torch_compile_mode: str | None = field(
        default=None, metadata={"help": "torch.compile mode: default, reduce-overhead, max-autotune."}
    )
    torch_compile_backend: str = field(default="inductor", metadata={
        "help": "torch.compile backend (the Trainer's name): inductor; eager or aot_eager trace and count graphs "
                "without generating kernels (debugging, tests)."})
    gradient_checkpointing: bool = field(
        default=False, metadata={"help": "Recompute activations in backward: less memory, about a third more compute."}
    )
    tf32: bool | None = field(
        default=None, metadata={"help": "TF32 matmuls on Ampere+ GPUs (default: on where supported)."}
    )
    cpu_threads: int | None = field(
        default=None,
        metadata={"help": "torch intra-op threads per process. Default: a lone process on a CPU that "
                  "`accelerate launch` pinned to 1 thread gets this machine's cores; otherwise the launcher's."},
    )
    auto_find_batch_size: bool = field(
        default=False,
        metadata={"help": "Before step 0, halve the micro-batch (doubling accumulation) until it fits in memory "
                          "on every process; the global batch and the schedule stay the same."},
    )

    # --- reliability
    on_nonfinite: Literal["stop", "skip"] = field(
        default="stop",
        metadata={"help": "A NaN/inf loss or gradient: stop with a report (default) or skip the step."},
    )
    max_nonfinite_skips: int = field(default=10, metadata={"help": "With on_nonfinite=skip: stop after N skips."})
    spike_window: int = field(default=0, metadata={
        "help": "Loss-spike guard: compare each step's loss (agreed across processes) with the mean of the last N "
                "steps' (0: off)."})
    spike_threshold: float = field(default=3.0, metadata={
        "help": "A step whose loss exceeds this multiple of the window's mean is a spike (> 1)."})
    on_spike: Literal["stop", "skip", "rollback"] = field(default="stop", metadata={
        "help": "stop: end the run with the step, its loss and sample indices (the last checkpoint is kept); skip: "
                "drop that step's update, log it, go on (a spike never enters the window); rollback: return to the "
                "last checkpoint and replay from there without the spiked step's batches (needs checkpoints)."})
    max_spike_skips: int = field(default=10, metadata={
        "help": "With on_spike=skip or rollback: stop after N skips (or N rollbacks)."})

    # --- intervals
    logging_strategy: Literal["no", "steps", "epoch"] = field(
        default="steps", metadata={"help": "When to log the training loss and throughput: every --logging_steps "
                                           "optimizer steps, every epoch, or never."})
    logging_steps: int = field(default=10, metadata={"help": "Log every N optimizer steps."})
    eval_strategy: Literal["no", "steps", "epoch"] = field(
        default="epoch", metadata={"help": "When to evaluate: every --eval_steps steps, every epoch, or never."})
    eval_steps: int | None = field(default=None, metadata={"help": "Evaluate every N steps (default: logging_steps)."})
    save_strategy: Literal["no", "steps", "epoch"] = field(
        default="epoch", metadata={"help": "When to checkpoint: every --save_steps steps, every epoch, or never."})
    save_steps: int = field(default=500, metadata={"help": "Checkpoint every N optimizer steps."})
    save_total_limit: int | None = field(
        default=None, metadata={"help": "Keep the newest N checkpoints (the best one is always kept)."}
    )
    async_save: bool = field(default=False, metadata={
        "help": "Write interval checkpoints in the background: the step copies the state into memory and training "
                "goes on while a thread writes it (one process or DDP; not FSDP / DeepSpeed)."})

    # --- best model and early stopping
    metric_for_best_model: str | None = field(
        default=None, metadata={"help": "e.g. eval_accuracy; default eval_loss when best/early stopping is used."}
    )
    greater_is_better: bool | None = field(
        default=None, metadata={"help": "Direction of metric_for_best_model (default: from its name: lower is better "
                                        "for " + ", ".join(LOWER_IS_BETTER) + "; higher for the rest)."}
    )
    load_best_model_at_end: bool = field(default=False, metadata={"help": "Restore the best checkpoint at the end."})
    early_stopping_patience: int | None = field(
        default=None, metadata={"help": "Stop after N evaluations without improvement."}
    )
    early_stopping_threshold: float = field(default=0.0, metadata={"help": "Minimum improvement that counts."})

    # --- observability
    report_to: list[str] = field(
        default_factory=lambda: ["tensorboard"],
        metadata={"help": "Trackers: tensorboard (default), wandb, mlflow, trackio, aim, ... or none."},
    )
    disable_tqdm: bool = field(default=False, metadata={"help": "No progress bar."})
    export_formats: list[str] | None = field(
        default=None, metadata={"help": f"After the final safetensors export, also export the model as any of "
                                        f"{', '.join(EXPORT_FORMATS)} into output_dir/export/FORMAT, verified "
                                        "against it (docs/deploy.md)."}
    )

    # --- run report, pre-flight check, diagnostics (accel_train/observe/: report/, preflight/, probes, overfit)
    preflight: bool = field(
        default=True, metadata={"help": "Check the run before step 0: errors refuse to start, warnings are printed "
                                        "(--no_preflight skips it)."}
    )
    run_report: bool = field(
        default=True, metadata={"help": "Write report.md and PNG plots into output_dir (schedule plot at the start, "
                                        "the rest at the end)."}
    )
    overfit_batches: int = field(
        default=0, metadata={"help": "Debug mode: train on the first N batches only, repeated, until the loss is near "
                                     "zero (or say it could not); no evaluation, no checkpoints."}
    )
    grad_flow_steps: int = field(
        default=0, metadata={"help": "Every N optimizer steps, record per-layer gradient norms (0: off)."}
    )
    activation_stats_steps: int = field(
        default=0, metadata={"help": "Every N optimizer steps, record per-layer activation statistics (0: off)."}
    )
    profile_steps: str | None = field(
        default=None, metadata={"help": "Trace optimizer steps START-END (e.g. '5-7') with torch.profiler into "
                                        "output_dir/profiler (TensorBoard or Chrome/Perfetto)."}
    )
    memory_snapshot_step: int = field(
        default=0, metadata={"help": "At this optimizer step, write a memory snapshot into output_dir/diagnostics "
                                     "(CUDA: allocator history for pytorch.org/memory_viz) (0: off)."}
    )
    detect_anomaly: bool = field(
        default=False, metadata={"help": "torch.autograd anomaly detection: name the forward op behind a NaN in "
                                         "backward (slow: debugging only)."}
    )

    def __post_init__(self) -> None:
        if isinstance(self.lr_scheduler_kwargs, dict):  # TrainConfig(lr_scheduler_kwargs={...}) in Python: as JSON
            object.__setattr__(self, "lr_scheduler_kwargs", json.dumps(self.lr_scheduler_kwargs))
        if isinstance(self.max_tokens_per_batch, str):  # TrainConfig(max_tokens_per_batch="auto") in Python
            try:
                object.__setattr__(self, "max_tokens_per_batch", parse_tokens(self.max_tokens_per_batch))
            except ValueError as err:
                raise ConfigError(f"max_tokens_per_batch: {err}.") from None
        validate(self)
        validate_observability(self)

    @property
    def profile_range(self) -> tuple[int, int] | None:
        """--profile_steps as (first, last) optimizer step, both included."""
        if not self.profile_steps:
            return None
        first, _, last = self.profile_steps.partition("-")
        return int(first), int(last or first)

    # ----- derived values (the config itself is never mutated)
    @property
    def scheduler_kwargs(self) -> dict[str, Any]:
        return json.loads(self.lr_scheduler_kwargs) if self.lr_scheduler_kwargs else {}

    @property
    def best_metric_name(self) -> str | None:
        if self.metric_for_best_model:
            name = self.metric_for_best_model
            return name if name.startswith("eval_") else f"eval_{name}"
        if self.load_best_model_at_end or self.early_stopping_patience is not None:
            return "eval_ema_loss" if self.save_ema_as_final else "eval_loss"  # the loss of the weights saved
        return None

    @property
    def monitored_metric(self) -> str:
        """The metric that best-model tracking, early stopping and reduce_on_plateau watch."""
        return self.best_metric_name or "eval_loss"

    @property
    def best_is_greater(self) -> bool:
        """--greater_is_better when given, else inferred from the metric's name (`greater_is_better_for`)."""
        if self.greater_is_better is not None:
            return self.greater_is_better
        return greater_is_better_for(self.monitored_metric)

    def setting(self, name: str, value: Any) -> str:
        """How to set field `name` to `value` the way this config was made: `--name value` or
        `TrainConfig(name=value)`."""
        if self.origin == "flags":
            return f"--{name}" if value is True else f"--{name} {value}"
        return f"TrainConfig({name}={value!r})"

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with `changes` (validated again), made the same way (flags or code) as this one."""
        new = dataclasses.replace(self, **changes)
        object.__setattr__(new, "origin", self.origin)
        object.__setattr__(new, "given", self.given)
        return new

    @property
    def trackers(self) -> list[str]:
        return [] if [t.lower() for t in self.report_to] in (["none"], []) else list(self.report_to)

    def warmup_for(self, total_steps: int) -> int:
        """Warmup in optimizer steps: a ratio (< 1) of total_steps, or an absolute count."""
        value = self.warmup_ratio if self.warmup_ratio is not None else self.warmup_steps
        return math.ceil(value * total_steps) if value < 1 else int(value)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
