"""TrainConfig's checks: each value, and the flags that must go together, refused with a message that names the flag
and what to give instead. TrainConfig.__post_init__ runs them, so no config that fails them exists."""

from __future__ import annotations

import json
from typing import Any

from ..errors import ConfigError

TORCH_SCHEDULERS = ("step", "multistep", "exponential", "cosine_annealing", "reduce_on_plateau")
SCHEDULER_INTERVALS = ("step", "epoch")  # when a scheduler object of the user's is stepped
OPTIMIZERS = ("adamw", "adamw_torch", "adamw_torch_fused", "adam", "sgd", "muon")
EXPORT_FORMATS = ("torchscript", "exported_program", "onnx")  # accel_train.deploy writes them
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager", "cudagraphs")  # torch.compile backends in torch itself


def transformers_schedulers() -> tuple[str, ...]:
    from transformers import SchedulerType

    return tuple(s.value for s in SchedulerType)


def bad(name: str, value: Any, what: str) -> ConfigError:
    return ConfigError(f"--{name}={value!r}: {what}")


def validate(cfg) -> None:
    """Every check of a TrainConfig's values (its __post_init__ calls it): a ConfigError naming the flag."""
    _validate_sizes(cfg)
    _validate_token_budget(cfg)
    _validate_schedule(cfg)
    _validate_guards(cfg)
    _validate_runtime(cfg)


def _validate_sizes(cfg) -> None:
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        if getattr(cfg, name) < 1:
            raise bad(name, getattr(cfg, name), "must be an integer >= 1.")
    for name in ("logging_steps", "save_steps", "scale_lr_reference_batch"):
        if getattr(cfg, name) < 1:
            raise bad(name, getattr(cfg, name), "must be >= 1.")
    if cfg.cpu_threads is not None and cfg.cpu_threads < 1:
        raise bad("cpu_threads", cfg.cpu_threads, "must be an integer >= 1 (leave it unset for the default).")
    if cfg.eval_steps is not None and cfg.eval_steps < 1:
        raise bad("eval_steps", cfg.eval_steps, "must be >= 1.")
    if cfg.max_steps <= 0 and cfg.num_train_epochs <= 0:
        raise bad("num_train_epochs", cfg.num_train_epochs, "must be > 0 (or set --max_steps).")


# --max_tokens_per_batch auto (TrainConfig(max_tokens_per_batch="auto")): replaced by its number of tokens once the
# training examples' lengths are known (core/token_batches.py: resolve_token_budget)
AUTO_TOKENS = "auto"
# why a resume can find another number under auto (said where a resume is refused over the budget)
AUTO_TOKENS_VARY = ("--max_tokens_per_batch auto chooses its number from the widths the collator pads examples to: "
                    "a multiple of 8 under fp16 / bf16 on a GPU, the lengths themselves elsewhere, so a resume on "
                    "another kind of device or in another precision (--mixed_precision auto follows the hardware) "
                    "finds another number and another plan")


def parse_tokens(text: str) -> int | str:
    """--max_tokens_per_batch's value: a whole number of tokens (0: off), or auto (AUTO_TOKENS)."""
    if text.strip().lower() == AUTO_TOKENS:
        return AUTO_TOKENS
    try:
        tokens = int(text)
    except ValueError:
        tokens = -1
    if tokens < 0:
        raise ValueError(f"{text!r} is neither a number of tokens (>= 1; 0: off) nor auto")
    return tokens


def _validate_token_budget(cfg) -> None:
    """--max_tokens_per_batch replaces the number of examples per micro-batch: what needs that number is refused."""
    budget = cfg.max_tokens_per_batch
    if budget != AUTO_TOKENS and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
        raise bad("max_tokens_per_batch", budget, "must be a number of tokens >= 1, or auto (0: off).")
    if not budget:
        return
    why = {"auto_find_batch_size": "searches for a number of examples per micro-batch that fits in memory; the token "
                                   "budget is that bound already",
           "dataloader_drop_last": "drops an incomplete batch of --per_device_train_batch_size examples; the token "
                                   "budget's plan trains every example once per epoch",
           "scale_lr": "scales the learning rate with a fixed global batch of examples; a token budget's batches hold "
                       "varying numbers of examples",
           "overfit_batches": "repeats the first few batches of --per_device_train_batch_size examples; a token "
                              "budget plans batches of every example of the epoch"}
    for name, reason in why.items():
        if getattr(cfg, name) not in (False, "none", 0):
            raise ConfigError(f"--{name} and --max_tokens_per_batch {budget}: --{name} {reason}. Drop one of them.")


def _validate_schedule(cfg) -> None:
    if cfg.scheduler_interval not in SCHEDULER_INTERVALS:
        raise bad("scheduler_interval", cfg.scheduler_interval, f"choose one of {', '.join(SCHEDULER_INTERVALS)}.")
    if cfg.learning_rate < 0:
        raise bad("learning_rate", cfg.learning_rate, "must be >= 0.")
    if cfg.optim not in OPTIMIZERS:
        raise bad("optim", cfg.optim, f"unknown optimizer; choose one of {', '.join(OPTIMIZERS)}.")
    if cfg.muon_lr_ratio <= 0:
        raise bad("muon_lr_ratio", cfg.muon_lr_ratio, "must be > 0 (1: Muon's groups at their AdamW rate).")
    if cfg.muon_lr_ratio != 1.0 and cfg.optim != "muon":
        raise ConfigError(f"--muon_lr_ratio {cfg.muon_lr_ratio} sets the Muon groups' rate, and --optim is "
                          f"{cfg.optim!r}: add --optim muon, or drop the flag.")
    schedulers = transformers_schedulers() + TORCH_SCHEDULERS
    if cfg.lr_scheduler_type not in schedulers:
        raise bad("lr_scheduler_type", cfg.lr_scheduler_type,
                  f"unknown scheduler; choose one of {', '.join(schedulers)}.")
    if cfg.lr_scheduler_kwargs:
        try:
            kwargs = json.loads(cfg.lr_scheduler_kwargs)
        except json.JSONDecodeError as err:
            raise bad("lr_scheduler_kwargs", cfg.lr_scheduler_kwargs, f"is not valid JSON ({err}).") from None
        if not isinstance(kwargs, dict):
            raise bad("lr_scheduler_kwargs", cfg.lr_scheduler_kwargs, "must be a JSON object.")
    if cfg.warmup_ratio is not None:
        if cfg.warmup_steps:
            raise ConfigError("Give either --warmup_steps or --warmup_ratio, not both.")
        if not 0 <= cfg.warmup_ratio < 1:
            raise bad("warmup_ratio", cfg.warmup_ratio, "must be in [0, 1).")
    if cfg.warmup_steps < 0 or (cfg.warmup_steps >= 1 and cfg.warmup_steps != int(cfg.warmup_steps)):
        raise bad("warmup_steps", cfg.warmup_steps, "must be an integer >= 0 or a ratio in [0, 1).")


def _validate_guards(cfg) -> None:
    if cfg.spike_window < 0 or cfg.spike_threshold <= 1:
        raise bad("spike_window" if cfg.spike_window < 0 else "spike_threshold",
                  cfg.spike_window if cfg.spike_window < 0 else cfg.spike_threshold,
                  "the window is >= 0 steps (0: off) and the threshold a multiple > 1 of the window's mean loss.")
    unguarded = [f"--{name} {getattr(cfg, name)}" for name, default in (("on_spike", "stop"), ("spike_threshold", 3.0),
                                                                        ("max_spike_skips", 10))
                 if getattr(cfg, name) != default]
    if unguarded and not cfg.spike_window:
        raise ConfigError(f"{', '.join(unguarded)}: the loss-spike guard is off (--spike_window 0), so this would do "
                          "nothing. Turn it on with --spike_window N (the steps whose mean loss a step is compared "
                          "with, e.g. 100), or drop the flag.")
    if cfg.on_spike == "rollback" and cfg.spike_window and cfg.save_strategy == "no":
        raise ConfigError("--on_spike rollback returns to the last checkpoint, and --save_strategy no saves none: "
                          "set --save_strategy steps with --save_steps N (a rollback replays up to N steps), or use "
                          "--on_spike skip.")
    if not 0 <= cfg.ema_decay < 1:
        raise bad("ema_decay", cfg.ema_decay, "must be in [0, 1): e.g. 0.999 (0 turns averaging off).")
    if cfg.save_ema_as_final and not cfg.ema_decay:
        raise ConfigError("--save_ema_as_final needs an average to save: set --ema_decay (e.g. 0.999).")
    best = cfg.best_metric_name if cfg.ema_decay and cfg.load_best_model_at_end else None
    if best and best.startswith("eval_ema_") != cfg.save_ema_as_final:  # the best step of one, the final of the other
        if cfg.save_ema_as_final:
            raise ConfigError(f"--save_ema_as_final saves the average, and --load_best_model_at_end loads the step "
                              f"best by {best}, a metric of the live weights: the final model would be the average of "
                              f"a step chosen for its live weights. Choose the best by the average's "
                              f"(--metric_for_best_model {best.replace('eval_', 'eval_ema_', 1)}), or drop "
                              "--save_ema_as_final.")
        raise ConfigError(f"--metric_for_best_model {cfg.metric_for_best_model} chooses the best step by the average, "
                          "and --load_best_model_at_end then saves that step's live weights, which were not what "
                          "was measured. Add --save_ema_as_final (the final model: the average of the best step), or "
                          f"choose the best by the live weights' metric ({best.replace('eval_ema_', 'eval_', 1)}).")
    if not 0 <= cfg.label_smoothing_factor < 1:
        raise bad("label_smoothing_factor", cfg.label_smoothing_factor, "must be in [0, 1).")
    if cfg.save_total_limit is not None and cfg.save_total_limit < 1:
        raise bad("save_total_limit", cfg.save_total_limit, "must be >= 1 (or unset to keep all).")
    if cfg.early_stopping_patience is not None:
        if cfg.early_stopping_patience < 1:
            raise bad("early_stopping_patience", cfg.early_stopping_patience, "must be >= 1.")
        if cfg.eval_strategy == "no":
            raise ConfigError("--early_stopping_patience needs evaluations: set --eval_strategy steps or epoch.")
    if cfg.load_best_model_at_end and (cfg.eval_strategy == "no" or cfg.save_strategy == "no"):
        raise ConfigError("--load_best_model_at_end needs --eval_strategy and --save_strategy other than 'no'.")


def _validate_runtime(cfg) -> None:
    if cfg.expected_world_size is not None and cfg.expected_world_size < 1:
        raise bad("expected_world_size", cfg.expected_world_size, "must be >= 1.")
    if cfg.ddp_timeout < 1:
        raise bad("ddp_timeout", cfg.ddp_timeout, "must be >= 1 second.")
    if cfg.torch_compile_mode not in (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
        raise bad("torch_compile_mode", cfg.torch_compile_mode,
                  "choose default, reduce-overhead, max-autotune or max-autotune-no-cudagraphs.")
    if cfg.torch_compile_backend not in COMPILE_BACKENDS:
        raise bad("torch_compile_backend", cfg.torch_compile_backend, f"choose one of {', '.join(COMPILE_BACKENDS)}.")
    if cfg.dataloader_num_workers is not None and cfg.dataloader_num_workers < 0:
        raise bad("dataloader_num_workers", cfg.dataloader_num_workers, "must be >= 0 (or unset for the default).")
    if cfg.dataloader_persistent_workers and cfg.dataloader_num_workers == 0:
        raise ConfigError("--dataloader_persistent_workers needs --dataloader_num_workers > 0.")
    for fmt in cfg.export_formats or ():
        if fmt not in EXPORT_FORMATS:
            raise bad("export_formats", fmt, f"unknown format; choose from {', '.join(EXPORT_FORMATS)}.")


def validate_observability(cfg) -> None:
    """The diagnostics flags' checks."""
    for name in ("overfit_batches", "grad_flow_steps", "activation_stats_steps", "memory_snapshot_step"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name}={getattr(cfg, name)!r}: must be >= 0 (0 turns it off).")
    if cfg.profile_steps:
        first, sep, last = cfg.profile_steps.partition("-")
        if not (first.isdigit() and (not sep or last.isdigit())) or int(first) < 1 or int(last or first) < int(first):
            raise ConfigError(f"--profile_steps={cfg.profile_steps!r}: expected START-END optimizer steps with "
                              "1 <= START <= END, e.g. '5-7' (or one step, '5').")
    if cfg.overfit_batches and cfg.resume_from_checkpoint:
        raise ConfigError("--overfit_batches starts a fresh debug run: drop --resume_from_checkpoint.")
