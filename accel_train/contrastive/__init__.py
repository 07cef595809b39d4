"""Kept for one release: contrastive image-text training now lives in `accel_train.tasks.multimodal` (`model`,
`loss`, `metrics`, and the pairs in `data`). Every name below still imports from here.

    from accel_train.contrastive import (ContrastiveLoss, ContrastiveMetrics, DualEncoder, StepClock,
                                         tower_param_groups)
"""

from ..tasks.multimodal.loss import (
                                      ContrastiveLoss,
                                      StepClock,
                                      accumulation_refusal,
                                      clip_loss,
                                      draw_captions,
                                      gather_with_grad,
)
from ..tasks.multimodal.metrics import ContrastiveMetrics, retrieval_metrics, zero_shot_accuracy
from ..tasks.multimodal.model import (
                                      DualEncoder,
                                      PooledVision,
                                      build_text_tower,
                                      build_vision_tower,
                                      tower_of,
                                      tower_param_groups,
)

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
