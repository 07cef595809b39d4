"""Model-config overrides from a flag, one parser for every recipe (the Hugging Face scripts' --config_overrides).

    --config_overrides "hidden_dropout_prob=0.2,classifier_dropout=0.3"     key=value pairs
    --config_overrides '{"widths": [16, 32], "blocks_per_stage": 1}'        a JSON object (lists, nesting)

Values of key=value pairs are read as JSON where they parse (0.2, true, [1, 2]) and as text otherwise. Applied
to a transformers config, each value must fit the type the field already has; applied to a plain module's
constructor, each key must be one of its keyword arguments. Every mistake is a ConfigError naming the flag, the
field and what to write instead.
"""

from __future__ import annotations

import difflib
import inspect
import json
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError


def parse_overrides(text: str | None, flag: str = "--config_overrides") -> dict[str, Any]:
    """{field: value} from a JSON object or comma-separated key=value pairs; {} for no text."""
    if not text or not text.strip():
        return {}
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{flag} {text!r}: not valid JSON ({err}).") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{flag} {text!r}: must be a mapping of config fields to values.")
        return value
    pairs = [item.partition("=") for item in text.split(",") if item.strip()]
    bad = [key for key, eq, value in pairs if not eq or not key.strip() or not value.strip()]
    if bad:
        raise ConfigError(f"{flag} {text!r}: write key=value pairs separated by commas (e.g. hidden_dropout_prob=0.2) "
                          f"or a JSON object; cannot read {bad}.")
    return {key.strip(): _json_or_text(value.strip()) for key, _, value in pairs}


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _unknown(flag: str, owner: str, unknown: list[str], known: list[str]) -> ConfigError:
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, known, n=1)
        hints.append(f"no field '{key}'" + (f", did you mean '{close[0]}'?" if close else ""))
    return ConfigError(f"{flag}: {owner} has no field {unknown}: {'; '.join(hints)}. Known fields include "
                       f"{known[:40]}.")


def apply_to_config(config, overrides: dict[str, Any], flag: str = "--config_overrides") -> None:
    """Set each override on a transformers config, typed as the field is; unknown fields and values of the wrong
    type are refused by name."""
    from huggingface_hub.errors import StrictDataclassError

    owner = type(config).__name__
    unknown = [key for key in overrides if not hasattr(config, key)]
    if unknown:
        raise _unknown(flag, owner, unknown, sorted(k for k in config.to_dict() if not k.startswith("_")))
    for key, value in overrides.items():
        typed = typed_value(flag, key, value, getattr(config, key))
        try:  # transformers 5 configs validate field types on assignment
            setattr(config, key, typed)
        except (TypeError, ValueError, StrictDataclassError) as err:
            reason = str(err.__cause__ or err).splitlines()[0]
            raise ConfigError(f"{flag}: {owner} refuses {key}={value!r} ({reason}).") from None


def check_constructor(factory: Callable, overrides: dict[str, Any], flag: str = "--config_overrides") -> None:
    """Refuse overrides that are not keyword arguments of `factory` (a plain module's constructor)."""
    parameters = [n for n, p in inspect.signature(factory).parameters.items()
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n != "self"]
    unknown = [key for key in overrides if key not in parameters]
    if unknown:
        raise _unknown(flag, getattr(factory, "__name__", str(factory)), unknown, parameters)


def typed_value(flag: str, key: str, value: Any, old: Any) -> Any:
    """`value` as the type of the field's current value `old` (a field that is None takes what was written)."""
    if isinstance(old, bool):
        text = str(value).lower()
        if text not in ("true", "false", "1", "0", "yes", "no"):
            raise ConfigError(f"{flag}: {key} is true or false, not {value!r}.")
        return text in ("true", "1", "yes")
    if isinstance(old, (int, float)):
        try:
            converted = type(old)(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{flag}: {key} takes {type(old).__name__} values, not {value!r}.") from None
        if isinstance(old, int) and converted != value and str(converted) != str(value):
            raise ConfigError(f"{flag}: {key} takes int values, not {value!r}.")
        return converted
    if old is None or isinstance(old, type(value)):
        return value
    if isinstance(old, str):
        return str(value)
    raise ConfigError(f"{flag}: {key} holds {type(old).__name__}; write a JSON value of that type, not {value!r}.")


def build_config(model_type: str, overrides: dict[str, Any], flag: str = "--config_overrides", **fixed):
    """`AutoConfig.for_model(model_type, **fixed, **overrides)`, each override checked against the type's default
    config first (unknown fields and wrong types refused by name). The overrides go to the constructor rather than
    being set afterwards, so fields derived from others (ViT's pooler size) follow them. Raises ValueError for a
    model type transformers does not know."""
    from transformers import AutoConfig

    defaults = AutoConfig.for_model(model_type)
    apply_to_config(defaults, overrides, flag)
    return AutoConfig.for_model(model_type, **{**fixed, **{key: getattr(defaults, key) for key in overrides}})
