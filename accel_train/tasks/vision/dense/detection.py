"""Object detection: an anchor-free detector on the SmallResNet backbone, its losses, decoding with NMS, and
COCO box mAP on predictions gathered once per image across processes.

The detector follows CenterNet (Zhou et al. 2019, "Objects as Points") with the box head of TTFNet (Liu et
al. 2020): a class heatmap at stride 4 whose peaks are object centres, and at every location the distances
to the four sides of the box (left, top, right, bottom). Training targets:

* heatmap: a Gaussian per object (sigma = 0.54 * side / 6 per axis), 1 at the cell holding the box centre;
  penalty-reduced focal loss (CenterNet's), normalised by the number of objects in the image;
* boxes: at the cells inside a box (and its centre cell), weighted by that Gaussian: GIoU loss plus L1 on
  the corners in units of the stride.

Decoding keeps heatmap peaks (3x3 max-pool), takes the top `max_detections` over all classes, builds their
boxes, and runs class-wise NMS (greedy, written here in torch because torchvision does not load beside the
CPU torch this project targets). The result is padded to `max_detections` per image with class -1, so
evaluation gathers fixed-shape per-image tensors with `gather_for_metrics` (each image exactly once, the
duplicates that even out the last batch dropped) and `DetectionMetrics` builds the COCO structures from them.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ....errors import ConfigError
from .backbone import ResNetStages, conv_bn_relu

GAUSSIAN_ALPHA = 0.54  # TTFNet's ratio of the Gaussian's extent to the box's side


class CenterNet(nn.Module):
    """`forward(pixel_values) -> {"heatmap": class logits [B, C, h, w], "box": side distances in pixels
    [B, 4, h, w]}` at `output_stride`. Deeper backbone stages are upsampled and added into that level
    (a top-down path as in FPN), so the head sees both fine positions and the wide context of the deep stages.
    `factory_kwargs`: its constructor arguments, for model_factory.json."""

    def __init__(self, num_classes: int, widths: Sequence[int] = (16, 32, 64), blocks_per_stage: int = 2,
                 stem_stride: int = 1, output_stride: int = 4, head_width: int = 64):
        super().__init__()
        self.factory_kwargs = {"num_classes": num_classes, "widths": list(widths), "blocks_per_stage": blocks_per_stage,
                               "stem_stride": stem_stride, "output_stride": output_stride, "head_width": head_width}
        self.backbone = ResNetStages(widths, blocks_per_stage, stem_stride)
        if output_stride not in self.backbone.strides:
            raise ConfigError(f"output_stride {output_stride}: the backbone's stages have strides "
                              f"{self.backbone.strides}; pick one of them (or change stem_stride / widths).")
        self.level = self.backbone.strides.index(output_stride)
        self.output_stride = output_stride
        self.lateral = nn.ModuleList(nn.Conv2d(w, head_width, 1) for w in widths[self.level:])
        self.smooth = conv_bn_relu(head_width, head_width)
        self.heatmap = nn.Sequential(conv_bn_relu(head_width, head_width), nn.Conv2d(head_width, num_classes, 1))
        self.box = nn.Sequential(conv_bn_relu(head_width, head_width), nn.Conv2d(head_width, 4, 1))
        # CenterNet's prior: every location starts at p = 0.1, so the focal loss does not begin swamped by
        # the easy background.
        nn.init.constant_(self.heatmap[-1].bias, -math.log((1 - 0.1) / 0.1))

    def forward(self, pixel_values: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.backbone(pixel_values)[self.level:]
        y = self.lateral[-1](features[-1])
        for feature, lateral in zip(reversed(features[:-1]), reversed(list(self.lateral)[:-1]), strict=True):
            y = F.interpolate(y, size=feature.shape[-2:], mode="nearest") + lateral(feature)
        y = self.smooth(y)
        return {"heatmap": self.heatmap(y), "box": F.softplus(self.box(y)) * self.output_stride}


# ------------------------------------------------------------------------------------------ targets, losses


def box_area(boxes: torch.Tensor) -> torch.Tensor:
    """Area of boxes [..., 4] (x0, y0, x1, y1); 0 for an empty or inverted box."""
    return (boxes[..., 2] - boxes[..., 0]).clamp_min(0) * (boxes[..., 3] - boxes[..., 1]).clamp_min(0)


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IoU of boxes a [..., 4] and b [..., 4] (broadcast), x0 y0 x1 y1."""
    lt = torch.maximum(a[..., :2], b[..., :2])
    rb = torch.minimum(a[..., 2:], b[..., 2:])
    inter = (rb - lt).clamp_min(0).prod(-1)
    return inter / (box_area(a) + box_area(b) - inter).clamp_min(1e-9)


def generalized_box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """GIoU (Rezatofighi et al. 2019): IoU minus the share of the enclosing box that neither box covers."""
    lt = torch.maximum(a[..., :2], b[..., :2])
    rb = torch.minimum(a[..., 2:], b[..., 2:])
    inter = (rb - lt).clamp_min(0).prod(-1)
    union = (box_area(a) + box_area(b) - inter).clamp_min(1e-9)
    enclosing = (torch.maximum(a[..., 2:], b[..., 2:]) - torch.minimum(a[..., :2], b[..., :2])).prod(-1)
    return inter / union - (enclosing - union) / enclosing.clamp_min(1e-9)


def grid_centres(h: int, w: int, stride: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel coordinates of the centres of the output cells: xs [w], ys [h]."""
    return ((torch.arange(w, device=device) + 0.5) * stride, (torch.arange(h, device=device) + 0.5) * stride)


def center_targets(boxes: torch.Tensor, classes: torch.Tensor, num_classes: int, shape: tuple[int, int],
                   stride: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(heatmap [B, C, h, w], box target [B, h, w, 4], box weight [B, h, w]) for boxes [B, M, 4] and classes
    [B, M] (-1 = padding). Where objects' regions meet, a cell regresses the object whose Gaussian is higher."""
    h, w = shape
    xs, ys = grid_centres(h, w, stride, boxes.device)
    valid = classes >= 0
    cx, cy = (boxes[..., 0] + boxes[..., 2]) / 2, (boxes[..., 1] + boxes[..., 3]) / 2
    sx = (GAUSSIAN_ALPHA * (boxes[..., 2] - boxes[..., 0]) / 6).clamp_min(1e-3)
    sy = (GAUSSIAN_ALPHA * (boxes[..., 3] - boxes[..., 1]) / 6).clamp_min(1e-3)
    gx = torch.exp(-((xs - cx[..., None]) ** 2) / (2 * sx[..., None] ** 2))  # [B, M, w]
    gy = torch.exp(-((ys - cy[..., None]) ** 2) / (2 * sy[..., None] ** 2))  # [B, M, h]
    gauss = gy[..., :, None] * gx[..., None, :]  # [B, M, h, w]
    centre = torch.zeros_like(gauss, dtype=torch.bool)
    ci = (cy / stride).long().clamp(0, h - 1)
    cj = (cx / stride).long().clamp(0, w - 1)
    centre.view(*gauss.shape[:2], -1).scatter_(2, (ci * w + cj)[..., None], True)
    gauss = torch.where(centre, torch.ones_like(gauss), gauss) * valid[..., None, None]
    onehot = F.one_hot(classes.clamp_min(0), num_classes).float() * valid[..., None]  # [B, M, C]
    heatmap = (onehot[..., None, None] * gauss[:, :, None]).amax(1)  # [B, C, h, w]
    inside = ((xs >= boxes[..., 0, None]) & (xs < boxes[..., 2, None]))[..., None, :] & \
             ((ys >= boxes[..., 1, None]) & (ys < boxes[..., 3, None]))[..., :, None]
    region = torch.where(inside | centre, gauss, torch.zeros_like(gauss))
    weight, owner = region.max(1)  # [B, h, w]
    target = torch.gather(boxes, 1, owner.flatten(1)[..., None].expand(-1, -1, 4)).view(*owner.shape, 4)
    return heatmap, target, weight


def focal_loss(logits: torch.Tensor, heatmap: torch.Tensor) -> torch.Tensor:
    """CenterNet's penalty-reduced focal loss per image, divided by its number of objects (at least 1)."""
    positive = heatmap.eq(1).float()
    log_p, log_not_p = F.logsigmoid(logits), F.logsigmoid(-logits)
    p = torch.sigmoid(logits)
    pos = positive * (1 - p) ** 2 * log_p
    neg = (1 - positive) * (1 - heatmap) ** 4 * p**2 * log_not_p
    return -(pos + neg).flatten(1).sum(1) / positive.flatten(1).sum(1).clamp_min(1)


def boxes_from_distances(distances: torch.Tensor, stride: int) -> torch.Tensor:
    """Side distances [B, 4, h, w] -> boxes [B, h, w, 4] around each cell's centre."""
    _, _, h, w = distances.shape
    xs, ys = grid_centres(h, w, stride, distances.device)
    left, top, right, bottom = distances.unbind(1)
    return torch.stack([xs - left, ys[:, None] - top, xs + right, ys[:, None] + bottom], dim=-1)


def detection_losses(outputs: dict[str, torch.Tensor], boxes: torch.Tensor, classes: torch.Tensor,
                     stride: int) -> dict[str, torch.Tensor]:
    """Per-image {"heatmap": focal, "giou": 1 - GIoU, "l1": L1 / stride}, box terms weighted by the targets."""
    logits = outputs["heatmap"].float()
    heatmap, target, weight = center_targets(boxes, classes, logits.shape[1], logits.shape[-2:], stride)
    predicted = boxes_from_distances(outputs["box"].float(), stride)
    total = weight.flatten(1).sum(1).clamp_min(1e-6)
    giou = ((1 - generalized_box_iou(predicted, target)) * weight).flatten(1).sum(1) / total
    l1 = ((predicted - target).abs().sum(-1) / stride * weight).flatten(1).sum(1) / total
    return {"heatmap": focal_loss(logits, heatmap), "giou": giou, "l1": l1}


# --------------------------------------------------------------------------------------------- decoding


def batched_nms(boxes: torch.Tensor, scores: torch.Tensor, classes: torch.Tensor, iou_threshold: float):
    """Greedy class-wise NMS for a batch: boxes [B, K, 4], scores [B, K] sorted high to low, classes [B, K].
    Returns keep [B, K]: a box is dropped when a kept, higher-scored box of its class overlaps it by more
    than `iou_threshold`. All images at once, one pass over the K ranks."""
    k = boxes.shape[1]
    same_class = classes[:, :, None] == classes[:, None]
    overlap = (box_iou(boxes[:, :, None], boxes[:, None, :]) > iou_threshold) & same_class
    later = torch.arange(k, device=boxes.device)
    keep = torch.ones(scores.shape, dtype=torch.bool, device=boxes.device)
    for i in range(k):
        keep &= ~(overlap[:, i] & keep[:, i:i + 1] & (later > i))
    return keep


@torch.no_grad()
def decode_detections(outputs: dict[str, torch.Tensor], image_size: tuple[int, int], max_detections: int = 100,
                      nms_iou: float = 0.5, score_threshold: float = 0.01) -> dict[str, torch.Tensor]:
    """{"det_boxes" [B, K, 4], "det_scores" [B, K], "det_classes" [B, K]} with K = `max_detections`, best first;
    slots without a detection have class -1 (the validity mask), score 0 and a zero box."""
    heat = torch.sigmoid(outputs["heatmap"].float())
    b, c, h, w = heat.shape
    stride = image_size[0] // w
    peaks = heat * (F.max_pool2d(heat, 3, stride=1, padding=1) == heat)
    k = min(max_detections, c * h * w)
    scores, index = peaks.flatten(1).topk(k)
    classes, cell = index // (h * w), index % (h * w)
    boxes = boxes_from_distances(outputs["box"].float(), stride).flatten(1, 2)
    boxes = torch.gather(boxes, 1, cell[..., None].expand(-1, -1, 4))
    limits = torch.tensor([image_size[0], image_size[1]] * 2, dtype=boxes.dtype, device=boxes.device)
    boxes = torch.minimum(boxes.clamp_min(0), limits)
    keep = batched_nms(boxes, scores, classes, nms_iou) & (scores > score_threshold)
    pad = max_detections - k
    det = {"det_boxes": torch.where(keep[..., None], boxes, 0.0), "det_scores": torch.where(keep, scores, 0.0),
           "det_classes": torch.where(keep, classes, -1)}
    if pad:
        det = {key: F.pad(v, (0, 0, 0, pad) if v.ndim == 3 else (0, pad), value=-1 if key == "det_classes" else 0)
               for key, v in det.items()}
    return det


# -------------------------------------------------------------------------------------------- evaluation


def coco_metrics(gt_boxes: np.ndarray, gt_classes: np.ndarray, det_boxes: np.ndarray, det_scores: np.ndarray,
                 det_classes: np.ndarray, class_names: Sequence[str], image_size: tuple[int, int],
                 gt_crowd: np.ndarray | None = None) -> dict[str, float]:
    """COCO box metrics (pycocotools) over all images: {"map" (IoU .50:.95), "map_50", "map_75", "mar_100",
    "ap_<class>"...}. Inputs are padded per image: class -1 marks an empty slot. Image i has id i + 1.
    `gt_crowd` (nonzero = iscrowd) marks true boxes that are crowd regions: pycocotools neither requires them to
    be found nor counts a detection inside them as a false positive."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    images = [{"id": i + 1, "width": image_size[0], "height": image_size[1]} for i in range(len(gt_boxes))]
    annotations = []
    for i, k in zip(*np.nonzero(gt_classes >= 0), strict=True):
        x0, y0, x1, y1 = (float(v) for v in gt_boxes[i, k])
        annotations.append({"id": len(annotations) + 1, "image_id": int(i) + 1,
                            "category_id": int(gt_classes[i, k]) + 1, "bbox": [x0, y0, x1 - x0, y1 - y0],
                            "area": (x1 - x0) * (y1 - y0),
                            "iscrowd": int(gt_crowd is not None and gt_crowd[i, k])})
    keys = ["map", "map_50", "map_75", "mar_100"] + [f"ap_{name}" for name in class_names]
    if not annotations:
        return dict.fromkeys(keys, math.nan)
    rows = [[i + 1, *_xywh(det_boxes[i, k]), det_scores[i, k], det_classes[i, k] + 1]
            for i, k in zip(*np.nonzero(det_classes >= 0), strict=True)]
    if not rows:  # no detection at all: nothing found, so every precision and recall is 0
        return {key: 0.0 for key in keys}
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress and summary table
        truth = COCO()
        truth.dataset = {"images": images, "annotations": annotations,
                         "categories": [{"id": i + 1, "name": n} for i, n in enumerate(class_names)]}
        truth.createIndex()
        evaluation = COCOeval(truth, truth.loadRes(np.asarray(rows, dtype=np.float64)), "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    stats = evaluation.stats
    metrics = {"map": stats[0], "map_50": stats[1], "map_75": stats[2], "mar_100": stats[8]}
    precision = evaluation.eval["precision"][:, :, :, 0, -1]  # [IoU, recall, class] for all areas, 100 detections
    for c, name in enumerate(class_names):
        values = precision[:, :, c]
        metrics[f"ap_{name}"] = float(values[values > -1].mean()) if (values > -1).any() else math.nan
    return {k: (math.nan if v == -1 else float(v)) for k, v in metrics.items()}


def _xywh(box) -> list[float]:
    return [float(box[0]), float(box[1]), float(box[2] - box[0]), float(box[3] - box[1])]


class DetectionMetrics:
    """A `metrics_fn` for the loop: COCO box metrics from the gathered "gt_boxes", "gt_classes", "det_boxes",
    "det_scores" and "det_classes" (one row per image, dataset order), and "gt_crowd" where the data has crowd
    regions. Keeps its last result in `last`."""

    def __init__(self, class_names: Sequence[str], image_size: int):
        self.class_names, self.image_size = list(class_names), image_size
        self.last: dict[str, float] | None = None

    @property
    def metric_names(self) -> list[str]:
        """What a call returns (coco_metrics' keys): a --metric_for_best_model it never reports is refused before
        training."""
        return ["map", "map_50", "map_75", "mar_100", *(f"ap_{name}" for name in self.class_names)]

    def __call__(self, outputs: dict[str, torch.Tensor]) -> dict[str, float]:
        arrays = {k: outputs[k].cpu().numpy() for k in ("gt_boxes", "gt_classes", "det_boxes", "det_scores",
                                                         "det_classes", "gt_crowd") if k in outputs}
        self.last = coco_metrics(**arrays, class_names=self.class_names,
                                 image_size=(self.image_size, self.image_size))
        return self.last


class DetectionLoss:
    """A `loss_fn` for the loop. Training: augment images and boxes together, then the per-image loss
    heatmap focal + `giou_weight` * GIoU + `l1_weight` * L1. Evaluation: standardise only, and add what the
    metrics need as per-image tensors: the decoded detections and the true boxes.

    The batch is a `DenseCollator` batch: "pixel_values" uint8, "boxes" [B, M, 4], "classes" [B, M] (-1 pads),
    and "crowd" [B, M] where the data has crowd regions: they are no training target (their class is taken as
    padding) and reach the metrics as "gt_crowd"."""

    def __init__(self, augment: nn.Module, eval_transform: nn.Module, max_detections: int = 100,
                 nms_iou: float = 0.5, score_threshold: float = 0.01, giou_weight: float = 2.0, l1_weight: float = 0.5):
        self.augment, self.eval_transform = augment, eval_transform
        self.max_detections, self.nms_iou, self.score_threshold = max_detections, nms_iou, score_threshold
        self.giou_weight, self.l1_weight = giou_weight, l1_weight

    def refuse_label_smoothing(self, factor: float) -> str:
        """Declared for core/loss.py's check_label_smoothing."""
        return (f"--label_smoothing_factor {factor}: this recipe's loss (a focal loss on the centre heatmaps, GIoU and "
                "L1 on the boxes) has no label smoothing, so the flag would change nothing while config.yaml records "
                "it; drop it (or set it to 0).")

    def __call__(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict:
        images, boxes, classes = batch["pixel_values"], batch["boxes"], batch["classes"]
        crowd = batch.get("crowd")
        targets = classes if crowd is None else classes.masked_fill(crowd, -1)  # a crowd region is no target
        if model.training:
            images, boxes, targets, _ = self.augment(images, boxes, targets)
        else:
            images = self.eval_transform(images)
        outputs = model(pixel_values=images)
        stride = images.shape[-1] // outputs["heatmap"].shape[-1]
        parts = detection_losses(outputs, boxes, targets, stride)
        per_image = parts["heatmap"] + self.giou_weight * parts["giou"] + self.l1_weight * parts["l1"]
        out = {"loss": per_image.mean(), "log": {f"{k}_loss": v.detach().mean() for k, v in parts.items()}}
        if not model.training:
            size = (images.shape[-1], images.shape[-2])
            out.update(per_sample_loss=per_image, gt_boxes=boxes, gt_classes=classes,
                       **({} if crowd is None else {"gt_crowd": crowd.long()}),  # gathered as numbers
                       **decode_detections(outputs, size, self.max_detections, self.nms_iou, self.score_threshold))
        return out

    def predict(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The decoded detections of an evaluation batch (call in eval mode, under no_grad)."""
        images = self.eval_transform(batch["pixel_values"])
        return decode_detections(model(pixel_values=images), (images.shape[-1], images.shape[-2]),
                                 self.max_detections, self.nms_iou, self.score_threshold)
