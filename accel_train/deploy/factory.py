"""How to rebuild a plain `nn.Module` from a run directory: a `module:callable` and its JSON keyword arguments.

A transformers model rebuilds from the config.json that `save_pretrained` writes beside its weights. A plain
module (the image recipe's SmallResNet, the contrastive recipe's DualEncoder, your own) has no such file, so a
run records one, ``model_factory.json``::

    {"factory": "accel_train.tasks.vision.models:SmallResNet",
     "kwargs": {"num_labels": 10, "widths": [16, 32, 64], ...}}

`accel-train export` calls ``factory(**kwargs)`` and loads the saved weights into the result (strictly: every
parameter must match). `train()` records it for every model that describes itself — a `factory_kwargs`
attribute (its JSON-able constructor arguments) and optionally `factory_target` (a builder, when the constructor
takes modules): SmallResNet, CenterNet, UNet, DualEncoder and FusionEncoder do. For your own module set those two
attributes in its constructor, pass ``RecordModelFactory(model, output_dir, factory=ModelFactory(...))`` as a hook,
or give ``--factory my_pkg.models:build --factory_kwargs '{...}'`` to `accel-train export`.

A model_factory.json read from a run directory is built only when it names one of `PACKAGE_FACTORIES` (the
builders of the package's own models): the file may come from anyone, and a ``module:callable`` runs whatever it
names (``os:system`` with ``{"command": ...}``). Your own builder in that file needs ``--trust_factory``
(``trust=True``); one you pass yourself (``--factory``) is built as given.

Rebuilding goes through the string alone: a model describes itself, and no model class is imported here (the one
import from the task kits is SmallResNet's factory string, quoted as the example in an error message).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import ExportError
from ..rundir.layout import MODEL_FACTORY as FACTORY_FILE
from ..tasks.vision.models import SMALL_RESNET_FACTORY

# The builders the package's own models record (`describe_model`: their `factory_target`, else module:class). Kept as
# strings: checking a target must not import its module, since an import runs the module's code.
# tests/deploy/test_crafted_run_dir.py pins this set to what the models describe.
PACKAGE_FACTORIES = frozenset({
    SMALL_RESNET_FACTORY,
    "accel_train.tasks.vision.dense.detection:CenterNet",
    "accel_train.tasks.vision.dense.segmentation:UNet",
    "accel_train.deploy.factories:dual_encoder",
    "accel_train.deploy.factories:fusion_encoder",
})
# Builders that moved, by the name a run written before the move recorded: such a run still rebuilds, as the builder
# it names now (issue 39 made tasks/vision/dense/ a package).
MOVED_FACTORIES = {
    "accel_train.tasks.vision.detection:CenterNet": "accel_train.tasks.vision.dense.detection:CenterNet",
    "accel_train.tasks.vision.segmentation:UNet": "accel_train.tasks.vision.dense.segmentation:UNet",
}


@dataclass(frozen=True)
class ModelFactory:
    """`target` ("package.module:callable", dots allowed after the colon) called with JSON-able `kwargs`. A target
    named in `MOVED_FACTORIES` is read as the name its builder has now."""

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", MOVED_FACTORIES.get(self.target, self.target))
        module, _, name = self.target.partition(":")
        if not module or not name:
            raise ExportError(f"factory {self.target!r}: expected 'package.module:callable', e.g. "
                              f"{SMALL_RESNET_FACTORY!r}.")
        try:
            json.dumps(self.kwargs)
        except TypeError as err:
            raise ExportError(f"factory {self.target}: its kwargs must be JSON ({err}).") from None

    @classmethod
    def parse(cls, target: str, kwargs_json: str | None = None) -> ModelFactory:
        """From the command line: `--factory module:callable --factory_kwargs '{"num_labels": 3}'`."""
        try:
            kwargs = json.loads(kwargs_json) if kwargs_json else {}
        except json.JSONDecodeError as err:
            raise ExportError(f"--factory_kwargs {kwargs_json!r}: not JSON ({err}).") from None
        if not isinstance(kwargs, dict):
            raise ExportError(f"--factory_kwargs {kwargs_json!r}: must be a JSON object of keyword arguments.")
        return cls(target, kwargs)

    def build(self) -> nn.Module:
        module_name, _, attr = self.target.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as err:
            raise ExportError(f"factory {self.target}: cannot import it ({err}). Is its package installed and on "
                              "PYTHONPATH?") from None
        try:
            model = obj(**self.kwargs)
        except TypeError as err:
            raise ExportError(f"factory {self.target} with the kwargs {sorted(self.kwargs)}: {err}. Fix "
                              f"{FACTORY_FILE} or --factory_kwargs.") from None
        if not isinstance(model, nn.Module):
            raise ExportError(f"factory {self.target} returned {type(model).__name__}, not a torch.nn.Module.")
        return model

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / FACTORY_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"factory": self.target, "kwargs": self.kwargs}, indent=2))
        return path

    @classmethod
    def load(cls, directory: str | Path, trust: bool = False) -> ModelFactory | None:
        """The factory `directory`'s model_factory.json records, None without one. Unless `trust`, only one of
        `PACKAGE_FACTORIES`: any other target is refused (ExportError) before its module is imported."""
        path = Path(directory) / FACTORY_FILE
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            factory = cls(data["factory"], data.get("kwargs", {}))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise ExportError(f"{path}: unreadable ({err}); expected {{\"factory\": \"module:callable\", "
                              "\"kwargs\": {...}}.") from None
        if not trust and factory.target not in PACKAGE_FACTORIES:
            raise ExportError(
                f"{path} names {factory.target}, which is not one of accel_train's model builders "
                f"({', '.join(sorted(PACKAGE_FACTORIES))}): building it would run that code, and a run directory "
                f"may come from anyone. If the run directory is yours and you trust {factory.target}, pass "
                "--trust_factory (Python: trust_factory=True), or name the builder yourself: "
                f"--factory {factory.target} --factory_kwargs JSON.")
        return factory


def describe_model(model: nn.Module) -> ModelFactory | None:
    """How `model` says to rebuild it: its `factory_kwargs` (JSON-able constructor arguments, set by the model
    itself) and `factory_target` (default: its own class). None for a model that does not describe itself (a
    transformers model has config.json instead)."""
    kwargs = getattr(model, "factory_kwargs", None)
    if kwargs is None:
        return None
    cls = type(model)
    return ModelFactory(getattr(model, "factory_target", None) or f"{cls.__module__}:{cls.__qualname__}", dict(kwargs))


class RecordModelFactory:
    """Hook: write ``output_dir/model_factory.json`` when training starts (main process), so that
    `accel-train export` rebuilds the model from the run directory or any of its checkpoints.

    Transformers models need nothing (their config.json is saved with the weights): then the hook does nothing.

        hooks=[RecordModelFactory(model, config.output_dir, accelerator.is_main_process)]

    `train()` adds it by itself for a model that describes itself (`factory_kwargs`).
    """

    def __init__(self, model: nn.Module, output_dir: str | Path, main_process: bool = True,
                 factory: ModelFactory | None = None):
        self.output_dir, self.main_process = Path(output_dir), main_process
        self.factory = factory or describe_model(model)
        if self.factory is None and not hasattr(model, "config"):
            raise ExportError(f"RecordModelFactory: cannot describe {type(model).__name__} by itself; pass "
                              "factory=ModelFactory('package.module:callable', {...}) that rebuilds it.")

    def on_train_start(self, state) -> None:
        if self.factory is not None and self.main_process:
            self.factory.save(self.output_dir)
