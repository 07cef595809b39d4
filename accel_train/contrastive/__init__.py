"""Contrastive image-text training (CLIP-style): a dual encoder, the symmetric InfoNCE loss over the global
batch with gradients through the gather, GradCache for large batches, per-tower optimisation and retrieval /
zero-shot metrics.

    from accel_train.contrastive import (ContrastiveLoss, ContrastiveMetrics, DualEncoder, StepClock,
                                         tower_param_groups)

Submodules: `model` (DualEncoder, tower builders, param groups), `loss` (clip_loss, gather_with_grad,
ContrastiveLoss, StepClock), `metrics` (retrieval_metrics, zero_shot_accuracy, ContrastiveMetrics). The
image-text data lives in `accel_train.vision.captions`.
"""

from .loss import ContrastiveLoss, StepClock, accumulation_refusal, clip_loss, draw_captions, gather_with_grad
from .metrics import ContrastiveMetrics, retrieval_metrics, zero_shot_accuracy
from .model import (DualEncoder, PooledVision, build_text_tower, build_vision_tower, tower_of, tower_param_groups)

__all__ = [
    "DualEncoder",
    "PooledVision",
    "build_text_tower",
    "build_vision_tower",
    "tower_of",
    "tower_param_groups",
    "clip_loss",
    "gather_with_grad",
    "draw_captions",
    "ContrastiveLoss",
    "StepClock",
    "accumulation_refusal",
    "retrieval_metrics",
    "zero_shot_accuracy",
    "ContrastiveMetrics",
]
