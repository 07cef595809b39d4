"""Builders that model_factory.json names by string (``accel_train.deploy.factories:dual_encoder``).

Only `ModelFactory.build` reaches this module (through importlib), so the export code itself never imports the
recipe-level model code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from ..errors import ExportError
from ..tasks.multimodal.dual_encoder import DualEncoder, PooledVision
from ..tasks.multimodal.fusion_model import FusionEncoder
from ..tasks.vision.models import SmallResNet


def dual_encoder(text_config: Mapping[str, Any], vision: Mapping[str, Any], embed_dim: int,
                 max_logit_scale: float = 100.0, text_pooler: bool = False) -> DualEncoder:
    """An untrained DualEncoder of the recorded architecture: the text tower from its transformers config, the
    vision tower as ``{"small_resnet": kwargs}`` or ``{"transformers": config}`` (wrapped in PooledVision)."""
    return DualEncoder(*_towers(text_config, vision, text_pooler), embed_dim, max_logit_scale=max_logit_scale)


def fusion_encoder(text_config: Mapping[str, Any], vision: Mapping[str, Any], embed_dim: int,
                   max_logit_scale: float = 100.0, text_pooler: bool = False, **fusion: Any) -> FusionEncoder:
    """An untrained FusionEncoder of the recorded architecture: the towers as `dual_encoder`, and its fusion
    layers and ITM head from `fusion` (fusion_layers, fusion_dim, fusion_heads, ...)."""
    return FusionEncoder(*_towers(text_config, vision, text_pooler), embed_dim, max_logit_scale=max_logit_scale,
                         **fusion)


def _towers(text_config: Mapping[str, Any], vision: Mapping[str, Any], text_pooler: bool) -> tuple[nn.Module, ...]:
    text = _from_config(text_config)
    if not text_pooler and getattr(text, "pooler", None) is not None:
        text.pooler = None  # the recipe drops it too: the dual encoder mean-pools
    if "small_resnet" in vision:
        tower: nn.Module = SmallResNet(**{"num_labels": 0, **vision["small_resnet"]})
    elif "transformers" in vision:
        tower = PooledVision(_from_config(vision["transformers"]))
    else:
        raise ExportError(f"dual_encoder: vision {sorted(vision)}: expected 'small_resnet' or 'transformers'.")
    return text, tower


def _from_config(config: Mapping[str, Any]) -> nn.Module:
    from transformers import AutoConfig, AutoModel

    values = dict(config)
    model_type = values.pop("model_type", None)
    if not model_type:
        raise ExportError("dual_encoder: a recorded transformers config has no model_type.")
    # transformers' own class for model_type, never code an `auto_map` in the recorded values names
    return AutoModel.from_config(AutoConfig.for_model(model_type, **values), trust_remote_code=False)
