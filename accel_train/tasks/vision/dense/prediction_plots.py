"""Pictures of a dense model's predictions: a few evaluation images with their true and predicted boxes or
masks, drawn with matplotlib's object API on the Agg canvas (no display, no pyplot state), and the hook that
writes one at the end of training into ``output_dir/report/``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch


def _figure(columns: int, rows: int, side: float = 2.2):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(side * columns, side * rows + 0.4))
    FigureCanvasAgg(fig)
    return fig, fig.subplots(rows, columns, squeeze=False)


def _image(ax, pixels: np.ndarray) -> None:
    """Pixel i spans [i, i + 1] (the boxes' convention), not imshow's default [i - 0.5, i + 0.5]."""
    height, width = pixels.shape[-2:]
    ax.imshow(pixels.transpose(1, 2, 0), interpolation="nearest", extent=(0, width, height, 0))
    ax.set_xticks([])
    ax.set_yticks([])


def _save(fig, path: str | Path, title: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def draw_detections(path: str | Path, images: np.ndarray, gt_boxes: np.ndarray, gt_classes: np.ndarray,
                    det_boxes: np.ndarray, det_scores: np.ndarray, det_classes: np.ndarray,
                    class_names: Sequence[str], min_score: float = 0.3) -> Path:
    """One panel per image: true boxes dashed green, detections scoring >= `min_score` red with class and score."""
    from matplotlib.patches import Rectangle

    fig, axes = _figure(len(images), 1)
    for ax, i in zip(axes[0], range(len(images)), strict=True):
        _image(ax, images[i])
        for box, cls in zip(gt_boxes[i], gt_classes[i], strict=True):
            if cls >= 0:
                ax.add_patch(Rectangle(box[:2], box[2] - box[0], box[3] - box[1], fill=False, edgecolor="lime",
                                       linestyle="--", linewidth=1.2))
        for box, score, cls in zip(det_boxes[i], det_scores[i], det_classes[i], strict=True):
            if cls >= 0 and score >= min_score:
                ax.add_patch(Rectangle(box[:2], box[2] - box[0], box[3] - box[1], fill=False, edgecolor="red",
                                       linewidth=1.0))
                ax.text(box[0], box[1], f"{class_names[cls]} {score:.2f}", color="red", fontsize=6, va="bottom")
    return _save(fig, path, f"test images: true boxes (green, dashed), detections with score >= {min_score} (red)")


def draw_segmentation(path: str | Path, images: np.ndarray, masks: np.ndarray, predicted: np.ndarray,
                      class_names: Sequence[str]) -> Path:
    """Three rows: the images, the true masks, the predicted masks (one colour per class, class 0 black)."""
    import matplotlib
    from matplotlib.colors import ListedColormap

    colours = matplotlib.colormaps["tab20"](np.linspace(0, 1, 20))[: max(len(class_names) - 1, 1)]
    cmap = ListedColormap(np.vstack([[0, 0, 0, 1], colours]))
    fig, axes = _figure(len(images), 3)
    for i in range(len(images)):
        _image(axes[0, i], images[i])
        for row, values in ((1, masks[i]), (2, predicted[i])):
            shown = np.where(values < len(class_names), values, 0)  # ignored pixels (255) as background
            axes[row, i].imshow(shown, cmap=cmap, vmin=0, vmax=len(class_names) - 1, interpolation="nearest")
            axes[row, i].set_xticks([])
            axes[row, i].set_yticks([])
    axes[1, 0].set_ylabel("true", fontsize=8)
    axes[2, 0].set_ylabel("predicted", fontsize=8)
    return _save(fig, path, "test images, true masks, predicted masks (colour = class)")


def draw_detection_batch(path, batch: dict, predictions: dict, class_names: Sequence[str]) -> Path:
    """`draw_detections` for a `DenseCollator` batch and `DetectionLoss.predict` output (numpy arrays)."""
    return draw_detections(path, batch["pixel_values"], batch["boxes"], batch["classes"], predictions["det_boxes"],
                           predictions["det_scores"], predictions["det_classes"], class_names)


def draw_segmentation_batch(path, batch: dict, predictions: dict, class_names: Sequence[str]) -> Path:
    """`draw_segmentation` for a `DenseCollator` batch and `SegmentationLoss.predict` output (numpy arrays)."""
    return draw_segmentation(path, batch["pixel_values"], batch["mask"], predictions["pred_mask"], class_names)


class PredictionPlot:
    """A hook: at the end of training, run `model` (the bare module given to `train`, so it holds the trained
    weights) on the first `count` items of `dataset` and hand the batch and `predict(model, batch)` to
    `draw(path, batch, predictions)` on the main process. A whole model runs on the main process alone, without
    collectives. A sharded one (FSDP2's fully_shard turns the module given to `train` into the sharded module; ZeRO-3
    partitions its parameters in place) runs on every rank, on the same items: its forward gathers the parameters, a
    collective that a main process alone would wait in forever while the other ranks went on."""

    def __init__(self, model: torch.nn.Module, dataset, collate: Callable, predict: Callable, draw: Callable,
                 path: str | Path, is_main_process: bool, count: int = 6):
        self.model, self.dataset, self.collate, self.predict, self.draw = model, dataset, collate, predict, draw
        self.path, self.is_main_process, self.count = Path(path), is_main_process, count

    def on_train_end(self, state, metrics) -> None:
        if len(self.dataset) == 0 or not (self.is_main_process or sharded(self.model)):
            return
        device = next(self.model.parameters()).device
        batch = self.collate([self.dataset[i] for i in range(min(self.count, len(self.dataset)))])
        batch = {k: v.to(device) for k, v in batch.items()}
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            predictions = self.predict(self.model, batch)
        self.model.train(was_training)
        if not self.is_main_process:
            return
        self.draw(self.path, {k: v.cpu().numpy() for k, v in batch.items()},
                  {k: v.cpu().numpy() for k, v in predictions.items()})


def sharded(model: torch.nn.Module) -> bool:
    """Whether `model`'s forward gathers sharded parameters from every rank: an FSDP2 module (fully_shard), or
    parameters DeepSpeed ZeRO-3 partitioned (they carry its `ds_id`). FSDP1 is refused by the library."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule) or any(hasattr(p, "ds_id") for p in model.parameters())
