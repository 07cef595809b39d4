"""Multimodal tasks beyond the dual encoder: cross-attention fusion with an image-text matching head.

    from accel_train.tasks.multimodal import FusionEncoder, FusionLoss, FusionMetrics

Submodules: `fusion` (FusionEncoder, CrossModalFusion, FusionLayer, vision_tokens), `fusion_loss` (hard
negatives over the global batch, ITM loss, fixed / uncertainty task weighting, FusionLoss), `fusion_metrics`
(ITM accuracy / ROC-AUC, ITM re-ranking of ITC candidates, FusionMetrics). The contrastive half lives in
`accel_train.contrastive`.
"""

from .fusion import CrossModalFusion, FusionEncoder, FusionLayer, fusion_param_groups, is_fusion, vision_tokens
from .fusion_loss import (
                          TASKS,
                          FusionLoss,
                          HardNegativePairs,
                          itm_loss,
                          parse_loss_weights,
                          sample_negatives,
                          task_grad_norms,
                          weigh,
)
from .fusion_metrics import FusionMetrics, PairScorer, balanced_accuracy, rerank_ranks, roc_auc, summary

__all__ = [
    "FusionEncoder",
    "CrossModalFusion",
    "FusionLayer",
    "vision_tokens",
    "fusion_param_groups",
    "is_fusion",
    "TASKS",
    "FusionLoss",
    "HardNegativePairs",
    "itm_loss",
    "parse_loss_weights",
    "sample_negatives",
    "task_grad_norms",
    "weigh",
    "FusionMetrics",
    "PairScorer",
    "balanced_accuracy",
    "rerank_ranks",
    "roc_auc",
    "summary",
]
