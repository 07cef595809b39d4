"""Rebuild a trained model from what a run saved: its run directory or one of its checkpoints.

* ``RUN_DIR`` (a run's --output_dir): the final weights, ``model.safetensors`` (sharded: with its index), and
  beside them either config.json (a transformers model, `save_pretrained`) or model_factory.json (a plain module,
  see `factory.py`).
* ``RUN_DIR/checkpoints/step-N``: Accelerate state; the model's weights are its ``model.safetensors`` and the
  checkpoint is verified against its manifest first. How to build the architecture comes from the run directory
  two levels up (config.json exists once the run finished; model_factory.json from its start).

The tokenizer and image processor saved in the run directory come along: they make the example inputs.

A run directory may come from anyone, so rebuilding runs none of its code: a model_factory.json is built only when
it names one of the package's builders (or with `trust_factory`, `factory.py`), config.json only as a class
transformers itself provides, never its `auto_map` code (nor the tokenizer's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError, ExportError, ModelError
from ..rundir.checkpoint import verify_checkpoint
from ..rundir.layout import EXPORT_DIR, WEIGHTS
from ..rundir.weights import load_weights, weights_file
from .factory import FACTORY_FILE, ModelFactory

ADAPTER_CONFIG = "adapter_config.json"  # what peft's save_pretrained writes beside a LoRA adapter


@dataclass
class TrainedModel:
    """A rebuilt model (fp32, CPU, eval mode) and what came with it."""

    model: nn.Module
    run_dir: Path
    checkpoint: Path | None
    built_by: str  # "BertForSequenceClassification (config.json)" or the factory target
    tokenizer: Any = None
    image_processor: Any = None  # the saved preprocessor_config.json's values (size, mean, std, rescale_factor)

    @property
    def image_size(self) -> int | None:
        """The side of the square images the model takes: the saved processor's, else the model config's."""
        size = getattr(self.image_processor, "size", None) or {}
        if size.get("height") or size.get("shortest_edge"):
            return int(size.get("height") or size.get("shortest_edge"))
        value = getattr(getattr(self.model, "config", None), "image_size", None)
        return value if isinstance(value, int) else None


def load_trained_model(path: str | Path, factory: ModelFactory | None = None,
                       trust_factory: bool = False) -> TrainedModel:
    """Rebuild the model saved at `path` (a run directory or a checkpoint directory) with its weights loaded
    strictly. `factory` overrides how the architecture is built; `trust_factory` builds a model_factory.json that
    names a builder other than the package's own (it runs that code). Raises ExportError saying what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise ExportError(f"{path}: no such directory (give a run's --output_dir or one of its checkpoints).")
    checkpoint = path if (path / "manifest.json").is_file() or path.parent.name == "checkpoints" else None
    run_dir = path.parent.parent if checkpoint else path
    if checkpoint:
        try:
            verify_checkpoint(checkpoint)
        except CheckpointError as err:
            raise ExportError(f"{checkpoint}: {err}") from None
    if factory is None:
        _refuse_adapter(run_dir, checkpoint)
        factory = ModelFactory.load(run_dir, trust=trust_factory)
    if factory is not None:
        model, built_by = factory.build(), factory.target
    else:
        model, built_by = _transformers_model(run_dir, checkpoint)
    _load_weights(model, checkpoint or run_dir)
    model = model.to("cpu", torch.float32).eval()
    return TrainedModel(model, run_dir, checkpoint, built_by, _tokenizer(run_dir), _image_processor(run_dir))


def _transformers_model(run_dir: Path, checkpoint: Path | None) -> tuple[nn.Module, str]:
    config_file = run_dir / "config.json"
    if not config_file.is_file():
        when = " (a transformers run writes config.json when it finishes)" if checkpoint else ""
        raise ExportError(
            f"{run_dir}: cannot tell how to build the model: no config.json{when} and no {FACTORY_FILE}. Pass "
            "--factory package.module:callable [--factory_kwargs JSON] that builds the untrained model.")
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(run_dir, trust_remote_code=False)
    except (OSError, ValueError) as err:
        code = _auto_map(config_file)
        why = f"names code of its own (auto_map {code})" if code else f"does not load as a transformers config ({err})"
        raise ExportError(
            f"{config_file} {why}. accel-train export builds only the model classes transformers provides and runs no "
            "code a run directory ships; for another model pass --factory package.module:callable [--factory_kwargs "
            "JSON] that builds the untrained model.") from None
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    # a name from the file reaches only transformers' own model classes: no other callable there gets the config
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ExportError(f"{config_file}: architectures {names} names no transformers model class; pass --factory.")
    return cls(config), f"{names[0]} (config.json)"


def _auto_map(config_file: Path) -> Any:
    try:
        return json.loads(config_file.read_text()).get("auto_map")
    except (ValueError, AttributeError):
        return None


def _refuse_adapter(run_dir: Path, checkpoint: Path | None) -> None:
    """A LoRA run without --merge_lora saved an adapter (adapter_config.json), not a model the exporter can take:
    raise an ExportError with the two remedies, the second a command that merges it now."""
    source = next((d for d in (checkpoint, run_dir) if d is not None and (d / ADAPTER_CONFIG).is_file()), None)
    if source is None:
        return
    merged = run_dir / EXPORT_DIR / (checkpoint.name if checkpoint else "") / "merged"
    code = (f"from peft import AutoPeftModelForCausalLM; AutoPeftModelForCausalLM.from_pretrained('{source}')"
            f".merge_and_unload().save_pretrained('{merged}')")
    tokenizer = next((d for d in (source, run_dir) if (d / "tokenizer_config.json").is_file()), None)
    if tokenizer is not None:  # the export's example inputs come from the tokenizer beside the model
        code += (f"; from transformers import AutoTokenizer; AutoTokenizer.from_pretrained('{tokenizer}')"
                 f".save_pretrained('{merged}')")
    raise ExportError(
        f"{source} holds a LoRA adapter ({ADAPTER_CONFIG}), not a whole model: the exporter takes a plain model. "
        "Train with --merge_lora (the run then ends with the adapter merged into its base model in output_dir, "
        "which exports), or merge this adapter into its base model now (peft loads the base that "
        f"{ADAPTER_CONFIG} names): python -c \"{code}\" and then run `accel-train export {merged} --format FORMAT`.")


def _load_weights(model: nn.Module, directory: Path) -> None:
    if weights_file(directory) is None:
        raise ExportError(f"{directory}: no {WEIGHTS} (the run saves it at the end; a checkpoint holds it too).")
    try:
        load_weights(model, directory, described_as=f"the rebuilt {type(model).__name__}")
    except ModelError as err:
        raise ExportError(f"{err} Was the model built with other arguments? Check {FACTORY_FILE} / --factory.") \
            from None


def _tokenizer(run_dir: Path) -> Any:
    if not (run_dir / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(run_dir, trust_remote_code=False)
    except (OSError, ValueError) as err:
        raise ExportError(f"{run_dir}: the saved tokenizer does not load ({err}).") from None


def _image_processor(run_dir: Path) -> Any:
    """The saved preprocessor_config.json as attributes; read directly, since the processor class the
    transformers Auto API picks may need torchvision."""
    path = run_dir / "preprocessor_config.json"
    if not path.is_file():
        return None
    values = json.loads(path.read_text())
    size = values.get("crop_size") if values.get("do_center_crop") else values.get("size")
    if isinstance(size, int):
        size = {"height": size, "width": size}
    return SimpleNamespace(size=size, image_mean=values.get("image_mean"), image_std=values.get("image_std"),
                           rescale_factor=values.get("rescale_factor", 1 / 255))
