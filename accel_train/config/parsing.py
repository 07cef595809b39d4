"""Config parsing: dataclass defaults < recipe defaults < a YAML file < CLI flags.

Parsing goes through `transformers.HfArgumentParser`; a YAML file is turned into flags in front of the command
line, so YAML values get exactly the same type checks as flags, and an unknown key or a wrong type is an error that
names the key and the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser

from ..errors import ConfigError
from ..hf_flags import ALIASES, did_you_mean, translate
from .fields import TrainConfig
from .validation import parse_tokens

# YAML keys naming files or folders: a relative path there that the current directory does not have is found from
# the YAML file's folder (output_dir is not: runs go where the command is run).
PATH_KEY_SUFFIXES = ("_file", "_dir", "_path", "_name_or_path")
NOT_PATH_KEYS = ("output_dir",)
# TrainConfig's fields in --help, by group: the field that opens each group (they follow in declaration order).
HELP_GROUPS = {"output_dir": "where the run lives", "num_train_epochs": "how long", "per_device_train_batch_size":
               "batches and loaders", "optim": "optimisation", "lr_scheduler_type": "learning-rate schedule (in "
               "optimizer steps)", "mixed_precision": "precision and reproducibility", "torch_compile": "speed",
               "on_nonfinite": "reliability", "logging_strategy": "intervals", "metric_for_best_model":
               "best model and early stopping", "report_to": "trackers and export", "preflight":
               "run report, pre-flight check, diagnostics"}


class _Parser(HfArgumentParser):
    """HfArgumentParser that raises ConfigError instead of printing usage and calling sys.exit, and shows
    TrainConfig's flags in --help in their groups (HELP_GROUPS) rather than as one list of ninety."""

    source = "command line"

    def _add_dataclass_arguments(self, dtype):
        if dtype is not TrainConfig:
            return super()._add_dataclass_arguments(dtype)
        hints = typing.get_type_hints(dtype)
        group = self
        for f in dataclasses.fields(dtype):
            if not f.init:
                continue
            if f.name in HELP_GROUPS:
                group = self.add_argument_group(f"TrainConfig: {HELP_GROUPS[f.name]}")
            f.type = str if f.name == "max_tokens_per_batch" else hints[f.name]  # a number or auto: _tokens
            self._parse_dataclass_field(group, f)
        self._option_string_actions["--max_tokens_per_batch"].type = _tokens

    def error(self, message: str):  # noqa: D401 - argparse API
        raise ConfigError(f"{self.source}: {message}. Run with --help to list the flags.")


def _tokens(text: str) -> int | str:
    try:
        return parse_tokens(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


RECORD_KEY = "what_ran"  # config.yaml: the optimizer, schedule and clipping a run really used


def _yaml_to_argv(path: Path, parser: _Parser) -> tuple[list[str], list[str]]:
    """Turn a YAML mapping into flags; return (argv, keys set to null)."""
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file.")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of flag names to values at the top level.")
    known = {a.dest for a in parser._actions}
    argv: list[str] = []
    nulls: list[str] = []
    for key, value in data.items():
        if key == RECORD_KEY:  # a run's record of what ran (config.yaml): not a setting
            continue
        if f"--{key}" in ALIASES and key not in known:  # a Hugging Face spelling: translated with the flags
            argv += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
            continue
        if key not in known or key in ("help", "config"):
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"{path}: unknown key '{key}'.{hint}")
        if isinstance(value, str) and key.endswith(PATH_KEY_SUFFIXES) and key not in NOT_PATH_KEYS:
            value = _relative_to(path, value)
        if value is None:
            nulls.append(key)
        elif isinstance(value, (list, tuple)):
            argv += [f"--{key}", *map(str, value)]
        elif isinstance(value, dict):
            argv += [f"--{key}", json.dumps(value)]
        else:
            argv += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return argv, nulls


def _relative_to(config_file: Path, value: str) -> str:
    """A relative path in a YAML file that does not exist from the current directory is looked up from the YAML
    file's folder, then the folders above it (nearest first), so a config works from any directory: a shipped
    config names ../shared/data/... from the repository root. A value found nowhere (a hub model name) is kept."""
    if Path(value).is_absolute() or Path(value).exists():
        return value
    folder = config_file.resolve().parent
    for base in (folder, *folder.parents):
        if (base / value).exists():
            return str(base / value)
    return value


def parse_config(
    dataclass_types: Sequence[type] = (TrainConfig,),
    argv: Sequence[str] | None = None,
    defaults: dict[str, Any] | None = None,
) -> tuple:
    """Parse `argv` (default: sys.argv[1:]) into one instance of each dataclass type.

    Precedence, lowest first: dataclass defaults, `defaults` (a recipe's own), `--config FILE.yaml`, flags.
    Unknown keys, unknown flags and wrong types raise `ConfigError` naming the key or flag (with the closest
    known one). The spellings of the Hugging Face scripts and Trainer (--fp16, --max_train_steps, ...:
    hf_flags.py) are read as accel_train's. A relative path in a YAML file (keys ending in _file, _dir, _path,
    _name_or_path; not output_dir) missing from the current directory is found from the file's folder upwards.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _Parser(list(dataclass_types))
    parser.add_argument("--config", default=None, help="YAML file of flag values (flags given here override it).")
    if defaults:
        unknown = set(defaults) - {a.dest for a in parser._actions}
        if unknown:
            raise ConfigError(f"recipe defaults name unknown fields: {sorted(unknown)}")
        parser.set_defaults(**defaults)

    config_path, rest = _pop_config_flag(argv)
    flags = {s for a in parser._actions for s in a.option_strings}
    rest, notes = translate(rest, flags)
    yaml_argv: list[str] = []
    nulls: list[str] = []
    if config_path:
        yaml_argv, nulls = _yaml_to_argv(Path(config_path), parser)
        yaml_argv, yaml_notes = translate(yaml_argv, flags)
        notes = yaml_notes + notes
        parser.source = str(config_path)  # errors from the YAML part name the file
        parser.parse_args(yaml_argv)
        parser.source = "command line"
    namespace, unknown = parser.parse_known_args(yaml_argv + rest)
    if unknown:
        raise ConfigError(f"command line: unrecognized arguments: {' '.join(unknown)}.{did_you_mean(unknown, flags)} "
                          "Run with --help to list the flags.")
    if notes and os.environ.get("RANK", "0") == "0":
        print("accel_train: " + "; ".join(notes), file=sys.stderr, flush=True)
    given_on_cli = {a.lstrip("-").split("=")[0].replace("-", "_") for a in rest if a.startswith("--")}
    for key in nulls:
        if key not in given_on_cli:
            setattr(namespace, key, None)
    values = vars(namespace)
    values.pop("config", None)
    outputs = []
    for dtype in dataclass_types:
        names = {f.name for f in dataclasses.fields(dtype) if f.init}
        outputs.append(dtype(**{k: v for k, v in values.items() if k in names}))
        if isinstance(outputs[-1], TrainConfig):
            object.__setattr__(outputs[-1], "origin", "flags")
            object.__setattr__(outputs[-1], "given", _given(parser, yaml_argv + rest))
    return tuple(outputs)


def _given(parser: _Parser, argv: list[str]) -> frozenset[str]:
    """The fields a flag or the YAML file set (their dests), whatever the recipe's defaults: a recipe's default that
    gives way to what the run asks for (core/token_batches.py: default_budget) needs to know which were chosen.
    Parsed again into a namespace that already holds every dest, where argparse sets no default: what it sets was
    given (abbreviated flags and --no_* included)."""
    unset = object()
    namespace = argparse.Namespace(**{action.dest: unset for action in parser._actions})
    parser.parse_known_args(argv, namespace=namespace)
    return frozenset(dest for dest, value in vars(namespace).items() if value is not unset)


def parse_with_defaults(dataclass_types: Sequence[type], argv: Sequence[str] | None, defaults: dict[str, Any],
                        more: Any) -> tuple:
    """`parse_config` with defaults that depend on what the flags name: `more(configs) -> dict` is called on a first
    parse, and what it returns goes on top of `defaults` for the final one (a recipe's demo settings when no data is
    named, a model's own settings when the default model is used). Flags and the YAML file still win over both.

        parse_with_defaults(TYPES, argv, DEFAULTS, lambda c: {} if c[1].data_dir else DEMO_DEFAULTS)
    """
    configs = parse_config(dataclass_types, argv, defaults=defaults)
    extra = more(configs)
    return parse_config(dataclass_types, argv, defaults={**defaults, **extra}) if extra else configs


def _pop_config_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    rest, path = [], None
    it = iter(range(len(argv)))
    for i in it:
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a YAML file path.")
            path = argv[i + 1]
            next(it)
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return path, rest


def save_config(configs: Sequence[Any], path: Path, record: dict[str, Any] | None = None) -> None:
    """Write the resolved config(s) as one flat YAML mapping that `--config` reads back; `record` (what the run's
    optimizer, schedule and clipping are: core/objects.py) goes under RECORD_KEY, which `--config` skips."""
    merged: dict[str, Any] = {}
    for cfg in configs:
        merged.update(dataclasses.asdict(cfg))
    if record is not None:
        merged[RECORD_KEY] = record
    path.parent.mkdir(parents=True, exist_ok=True)
    written = path.with_name(f".{path.name}.tmp")  # replaced at once: a kill mid-write leaves the old one, which
    written.write_text(yaml.safe_dump(merged, sort_keys=False))  # `auto` compares the next attempt's flags with
    os.replace(written, path)

