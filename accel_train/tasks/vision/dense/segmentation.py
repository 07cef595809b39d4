"""Semantic segmentation: a small U-Net on the SmallResNet backbone, pixel cross-entropy plus Dice, and
mIoU / per-class IoU accumulated over every pixel of the evaluation set across processes.

The metric is exact under any number of processes: the loss function returns each image's confusion matrix
(true class x predicted class pixel counts, [C * C] int32 per image), evaluation gathers those per-image
rows with `gather_for_metrics` (each image once), and `SegmentationMetrics` sums them before dividing. An
mIoU averaged per batch would weigh a small last batch like a full one and change with the batch size.
Gathering costs C * C * 4 bytes per image (484 for the 11 classes of the digit canvases).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .annotated import IGNORE_MASK_VALUE
from .backbone import ResNetStages, conv_bn_relu


class UNet(nn.Module):
    """`forward(pixel_values) -> class logits [B, C, H, W]` at the input's resolution.

    From the deepest backbone stage up: upsample to the next shallower stage, concatenate it, conv-BN-ReLU;
    a 1x1 convolution gives logits at the first stage's resolution. When that is coarser than the input
    (stem_stride > 1), the logits are upsampled and refined at full resolution by a small convolution that
    also sees the input image, so thin strokes keep sharp edges without full-resolution features.
    `factory_kwargs`: its constructor arguments, for model_factory.json."""

    def __init__(self, num_classes: int, widths: Sequence[int] = (16, 32, 64), blocks_per_stage: int = 2,
                 stem_stride: int = 1, refine_width: int = 16):
        super().__init__()
        self.factory_kwargs = {"num_classes": num_classes, "widths": list(widths), "blocks_per_stage": blocks_per_stage,
                               "stem_stride": stem_stride, "refine_width": refine_width}
        self.backbone = ResNetStages(widths, blocks_per_stage, stem_stride)
        decoder, cin = [], widths[-1]
        for width in reversed(widths[:-1]):
            decoder.append(conv_bn_relu(cin + width, width))
            cin = width
        self.decoder = nn.ModuleList(decoder)
        self.classifier = nn.Conv2d(cin, num_classes, 1)
        self.refine = None
        if stem_stride > 1:
            self.refine = nn.Sequential(nn.Conv2d(num_classes + 3, refine_width, 3, padding=1), nn.ReLU(),
                                        nn.Conv2d(refine_width, num_classes, 1))
            nn.init.zeros_(self.refine[-1].weight)  # starts as plain upsampling; learns the edges from the pixels
            nn.init.zeros_(self.refine[-1].bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        features = self.backbone(pixel_values)
        y = features[-1]
        for skip, block in zip(reversed(features[:-1]), self.decoder, strict=True):
            y = block(torch.cat([_upsample(y, skip), skip], dim=1))
        logits = self.classifier(y)
        if self.refine is not None:
            logits = _upsample(logits, pixel_values)
            logits = logits + self.refine(torch.cat([logits, pixel_values], dim=1))
        return logits


def _upsample(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return F.interpolate(x, size=like.shape[-2:], mode="bilinear", align_corners=False)


def segmentation_losses(logits: torch.Tensor, mask: torch.Tensor, ignore_index: int = IGNORE_MASK_VALUE,
                        label_smoothing: float = 0.0) -> dict[str, torch.Tensor]:
    """Per-image {"ce": pixel cross-entropy (with `label_smoothing`), "dice": 1 - soft Dice}; pixels marked
    `ignore_index` count in neither. The Dice term averages over the classes present in the image's mask
    (background included), so a digit of a few dozen pixels weighs as much as the background around it."""
    logits = logits.float()
    valid = mask != ignore_index
    target = torch.where(valid, mask, torch.zeros_like(mask))
    pixels = valid.flatten(1).sum(1).clamp_min(1)
    ce = F.cross_entropy(logits, target, reduction="none", label_smoothing=label_smoothing) * valid
    probs = logits.softmax(1) * valid[:, None]
    onehot = F.one_hot(target, logits.shape[1]).permute(0, 3, 1, 2).float() * valid[:, None]
    inter = (probs * onehot).sum((2, 3))
    sizes = onehot.sum((2, 3))
    dice = (2 * inter + 1) / (probs.sum((2, 3)) + sizes + 1)
    present = (sizes > 0).float()
    return {"ce": ce.flatten(1).sum(1) / pixels,
            "dice": 1 - (dice * present).sum(1) / present.sum(1).clamp_min(1)}


def confusion_per_image(predicted: torch.Tensor, mask: torch.Tensor, num_classes: int,
                        ignore_index: int = IGNORE_MASK_VALUE) -> torch.Tensor:
    """[B, C * C] int32: pixel counts of (true class, predicted class) per image, row-major; ignored pixels
    and mask values outside 0..C-1 are not counted."""
    b = mask.shape[0]
    valid = (mask != ignore_index) & (mask >= 0) & (mask < num_classes)
    cell = mask.long() * num_classes + predicted.long()
    offsets = torch.arange(b, device=mask.device).view(b, *([1] * (mask.ndim - 1))) * num_classes**2
    counts = torch.bincount((cell + offsets)[valid], minlength=b * num_classes**2)
    return counts.view(b, num_classes**2).to(torch.int32)


def iou_from_confusion(confusion: np.ndarray) -> np.ndarray:
    """Per-class IoU = TP / (TP + FP + FN) from a [C, C] (true x predicted) matrix; NaN for a class that is
    neither present nor predicted."""
    tp = np.diag(confusion).astype(np.float64)
    union = confusion.sum(0) + confusion.sum(1) - tp
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(union > 0, tp / union, np.nan)


class SegmentationMetrics:
    """A `metrics_fn` for the loop: {"miou", "pixel_accuracy", "iou_<class>"...} from the gathered per-image
    "confusion" rows, summed over every image first. mIoU is the mean over classes present or predicted.
    Keeps the summed matrix of its last call in `last_confusion`."""

    def __init__(self, class_names: Sequence[str]):
        self.class_names = list(class_names)
        self.last_confusion: np.ndarray | None = None

    @property
    def metric_names(self) -> list[str]:
        """What a call returns: a --metric_for_best_model it never reports is refused before training."""
        return ["miou", "pixel_accuracy", *(f"iou_{name}" for name in self.class_names)]

    def __call__(self, outputs: dict[str, torch.Tensor]) -> dict[str, float]:
        c = len(self.class_names)
        confusion = outputs["confusion"].long().sum(0).view(c, c).cpu().numpy()
        self.last_confusion = confusion
        iou = iou_from_confusion(confusion)
        metrics = {"miou": float(np.nanmean(iou)) if np.isfinite(iou).any() else math.nan,
                   "pixel_accuracy": float(np.trace(confusion) / max(confusion.sum(), 1))}
        metrics.update({f"iou_{name}": float(value) for name, value in zip(self.class_names, iou, strict=True)})
        return metrics


class SegmentationLoss:
    """A `loss_fn` for the loop. Training: augment images and masks together, then per image
    cross-entropy (smoothed by `label_smoothing`) + `dice_weight` * Dice. Evaluation: standardise only, the plain
    cross-entropy, and add each image's confusion matrix for `SegmentationMetrics`. The batch is a `DenseCollator`
    batch with "pixel_values" and "mask". With label smoothing, `evaluation_loss` is the loss without it (what the
    --overfit_batches check judges; core/loss.py)."""

    def __init__(self, augment: nn.Module, eval_transform: nn.Module, num_classes: int, dice_weight: float = 1.0,
                 label_smoothing: float = 0.0):
        self.augment, self.eval_transform = augment, eval_transform
        self.num_classes, self.dice_weight, self.label_smoothing = num_classes, dice_weight, label_smoothing
        if label_smoothing:
            self.evaluation_loss = SegmentationLoss(augment, eval_transform, num_classes, dice_weight)

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict:
        images, mask = batch["pixel_values"], batch["mask"]
        if model.training:
            images, _, _, mask = self.augment(images, mask=mask)
        else:
            images = self.eval_transform(images)
        logits = model(pixel_values=images)
        parts = segmentation_losses(logits, mask, label_smoothing=self.label_smoothing if model.training else 0.0)
        per_image = parts["ce"] + self.dice_weight * parts["dice"]
        out = {"loss": per_image.mean(), "log": {f"{k}_loss": v.detach().mean() for k, v in parts.items()}}
        if not model.training:
            out.update(per_sample_loss=per_image,
                       confusion=confusion_per_image(logits.argmax(1), mask, self.num_classes))
        return out

    def predict(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{"pred_mask": [B, H, W]} for an evaluation batch (call in eval mode, under no_grad)."""
        return {"pred_mask": model(pixel_values=self.eval_transform(batch["pixel_values"])).argmax(1)}
