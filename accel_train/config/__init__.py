"""TrainConfig and config parsing: dataclass defaults < recipe defaults < a YAML file < CLI flags.

    fields.py      TrainConfig (its fields in 12 groups, help text) and the metric-direction rule
    validation.py  its checks, run by TrainConfig.__post_init__
    parsing.py   parse_config / parse_with_defaults (HfArgumentParser + YAML), save_config, --help by group
"""

from .fields import (
    EXPORT_FORMATS,
    LOWER_IS_BETTER,
    OPTIMIZERS,
    TORCH_SCHEDULERS,
    TrainConfig,
    greater_is_better_for,
)
from .parsing import HELP_GROUPS, parse_config, parse_with_defaults, save_config

__all__ = ["EXPORT_FORMATS", "HELP_GROUPS", "LOWER_IS_BETTER", "OPTIMIZERS", "TORCH_SCHEDULERS", "TrainConfig",
           "greater_is_better_for", "parse_config", "parse_with_defaults", "save_config"]
