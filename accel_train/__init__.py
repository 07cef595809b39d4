"""accel_train: one readable training loop on Hugging Face Accelerate.

    from accel_train import TrainConfig, build_accelerator, train

    config = TrainConfig(output_dir="runs/demo", num_train_epochs=2, learning_rate=1e-3)
    accelerator = build_accelerator(config)
    result = train(model, train_loader, config=config, eval_loader=eval_loader,
                   loss_fn=my_loss, metrics_fn=my_metrics, accelerator=accelerator)
    print(result.metrics)

`__all__` is the public API. The package is layered (README, "Architecture"): `train.py` on top; `observe/`
(observability) and `tasks/` (task kits) on the `core/` loop; `rundir/` (the run directory) below it; `config/`
and `errors.py` at the bottom. Nothing inside the package imports this module.
"""

from .config import TrainConfig, parse_config, parse_with_defaults, save_config
from .core.accelerator import build_accelerator, precision_in_effect
from .core.control import RunControl
from .core.data import (
    LengthGroupedSampler,
    SeededItems,
    SplitLoaders,
    make_loader,
    pad_multiple,
    seed_worker,
    split_loaders,
)
from .core.evaluation import evaluate_model, gather_outputs
from .core.hooks import EarlyStopping, Hook
from .core.loss import check_label_smoothing, default_loss, evaluation_loss
from .core.optim import (
                         StepPlan,
                         build_optimizer,
                         build_scheduler,
                         layerwise_lr_decay_groups,
                         make_plan,
                         no_decay_param_groups,
)
from .core.state import TrainResult, TrainState
from .core.token_batches import TokenBudgetBatchSampler, default_budget, resolve_token_budget
from .errors import (
                         CheckpointError,
                         ConfigError,
                         DataError,
                         ExportError,
                         FinishError,
                         LaunchError,
                         MetricsError,
                         ModelError,
                         PeerTimeout,
                         Preempted,
                         RunFinished,
                         TrainingDiverged,
                         UserError,
                         run_cli,
)
from .observe.report import compare_runs, write_report
from .rundir.checkpoint import list_checkpoints, resolve_checkpoint
from .rundir.final_model import save_final_model
from .rundir.metrics_log import end_training_safely
from .tasks.metrics import load_metric, shipped_metrics
from .train import train

__version__ = "0.1.0"

__all__ = [
    "end_training_safely",
    "TrainConfig",
    "parse_config",
    "parse_with_defaults",
    "save_config",
    "build_accelerator",
    "precision_in_effect",
    "train",
    "TrainResult",
    "TrainState",
    "TokenBudgetBatchSampler",
    "default_loss",
    "check_label_smoothing",
    "evaluation_loss",
    "evaluate_model",
    "gather_outputs",
    "load_metric",
    "shipped_metrics",
    "build_optimizer",
    "build_scheduler",
    "no_decay_param_groups",
    "layerwise_lr_decay_groups",
    "make_plan",
    "StepPlan",
    "make_loader",
    "default_budget",
    "resolve_token_budget",
    "split_loaders",
    "SplitLoaders",
    "pad_multiple",
    "LengthGroupedSampler",
    "SeededItems",
    "seed_worker",
    "Hook",
    "RunControl",
    "EarlyStopping",
    "save_final_model",
    "list_checkpoints",
    "resolve_checkpoint",
    "UserError",
    "ConfigError",
    "DataError",
    "ExportError",
    "FinishError",
    "CheckpointError",
    "LaunchError",
    "MetricsError",
    "ModelError",
    "TrainingDiverged",
    "PeerTimeout",
    "Preempted",
    "RunFinished",
    "run_cli",
    "write_report",
    "compare_runs",
]
