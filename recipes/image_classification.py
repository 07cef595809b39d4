"""Image classification: from scratch or from pretrained weights, on any image folder or `datasets` name.

    accelerate launch recipes/image_classification.py                      # embedded MNIST digits, ~2-3 min on CPU
    accelerate launch recipes/image_classification.py --config recipes/configs/image_classification_cifar10.yaml
    accelerate launch recipes/image_classification.py --data_dir my_images --model_type vit --num_train_epochs 30

Training augmentation (random resized crop, flip, colour jitter, optional mixup / cutmix) runs batched on
the training device inside the loss function; evaluation standardises only. The end of the run writes
top-1 / top-5 / per-class accuracy to all_results.json (test_* too when a test split exists) and a
confusion matrix PNG.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from accelerate.utils import set_seed

from accel_train import (
    ModelError,
    TrainConfig,
    build_accelerator,
    parse_config,
    run_cli,
    split_loaders,
    train,
)
from accel_train.tasks.model_config import build_config, check_constructor, parse_overrides
from accel_train.tasks.vision.classification import ClassificationFinish, ClassificationMetrics
from accel_train.tasks.vision.data import ImageDataArguments, ImageDataset, load_image_data
from accel_train.tasks.vision.models import SmallResNet
from accel_train.tasks.vision.transforms import (
    EvalTransform,
    ImageAugmentationArguments,
    MixupCutmix,
    TrainAugmentation,
    channel_mean_std,
    image_processor,
    processor_size,
)

# Small from-scratch shapes for CPU-sized runs; --config_overrides changes any of them.
MODEL_PRESETS = {
    "small_resnet": {"widths": [16, 32, 64], "blocks_per_stage": 3},
    "vit": {"patch_size": 4, "hidden_size": 192, "num_hidden_layers": 6, "num_attention_heads": 3,
            "intermediate_size": 384},
    "convnext": {"patch_size": 2, "hidden_sizes": [48, 96, 192, 384], "depths": [2, 2, 2, 2]},
}
# Loader workers (the library's default: 4 beside a GPU, none on a CPU, where they competed with the training threads
# for the same cores: 3x slower on 2 cores, benchmarks/image_classification.md).
DEFAULTS = {
    "output_dir": "outputs/image_classification", "num_train_epochs": 8, "per_device_train_batch_size": 64,
    "per_device_eval_batch_size": 256, "optim": "adamw", "learning_rate": 3e-3, "weight_decay": 0.05,
    "lr_scheduler_type": "cosine", "warmup_steps": 0.1, "label_smoothing_factor": 0.1, "logging_steps": 20,
}


@dataclass(frozen=True)
class ModelArguments:
    """Which network: a from-scratch architecture, or pretrained transformers weights."""

    model_type: str = field(default="small_resnet", metadata={
        "help": "small_resnet (ResNet-20 for small images) or a transformers model type, e.g. vit, convnext."})
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "Pretrained transformers weights (hub name or local path); the classifier head is re-initialised."})
    config_overrides: str | None = field(default=None, metadata={
        "help": 'Model config changes, JSON (\'{"hidden_size": 64}\') or key=value,key=value.'})
    channels_last: bool = field(default=False, metadata={"help": "channels_last memory format (faster convs)."})


def load_data(args: ImageDataArguments, seed: int):
    """Image folders, a `datasets` name, or the embedded MNIST digits; validation held out where needed."""
    return load_image_data(args, seed=seed)


def build_model(args: ModelArguments, class_names: list[str], image_size: int):
    """(model, image processor or None); the processor's mean/std/size win for pretrained weights."""
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    labels = {"num_labels": len(class_names), "id2label": dict(enumerate(class_names)),
              "label2id": {c: i for i, c in enumerate(class_names)}}
    if args.model_name_or_path:
        try:
            model = AutoModelForImageClassification.from_pretrained(
                args.model_name_or_path, ignore_mismatched_sizes=True, **labels)
        except (OSError, ValueError) as err:
            raise ModelError(f"--model_name_or_path {args.model_name_or_path}: cannot load it ({err}). Offline, "
                             "give a local directory holding config.json and the weights.") from None
        try:
            return model, AutoImageProcessor.from_pretrained(args.model_name_or_path)
        except (OSError, ValueError):
            return model, None
    overrides = {**MODEL_PRESETS.get(args.model_type, {}), **parse_overrides(args.config_overrides)}
    if args.model_type == "small_resnet":
        check_constructor(SmallResNet, overrides)
        return SmallResNet(len(class_names), **overrides), None
    try:
        config = build_config(args.model_type, overrides, image_size=image_size, **labels)
    except ValueError:
        raise ModelError(f"--model_type {args.model_type}: unknown; use small_resnet or a transformers image "
                         "model type such as vit or convnext.") from None
    return AutoModelForImageClassification.from_config(config), None


def build_loss(augment, eval_transform, mixing: MixupCutmix, label_smoothing: float, channels_last: bool):
    """Augment + mix while training, standardise only in evaluation; per-sample cross-entropy, label-smoothed in
    training only (`evaluation_loss` is the plain one)."""

    def loss_fn(model, batch):
        images, targets = batch["pixel_values"], batch["labels"]
        if model.training:
            images, targets = mixing(augment(images), targets)
        else:
            images = eval_transform(images)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        out = model(pixel_values=images)
        logits = getattr(out, "logits", out)
        losses = torch.nn.functional.cross_entropy(logits.float(), targets, label_smoothing=label_smoothing,
                                                   reduction="none")
        return {"loss": losses.mean(), "per_sample_loss": losses, "logits": logits}

    if label_smoothing or mixing.enabled:  # evaluation (and the overfit check) measure plain cross-entropy
        loss_fn.evaluation_loss = build_loss(augment, eval_transform, MixupCutmix(mixing.num_classes), 0.0,
                                             channels_last)
    return loss_fn


CONFIG_TYPES = (TrainConfig, ImageDataArguments, ImageAugmentationArguments, ModelArguments)


def build_metrics(class_names: list[str]) -> ClassificationMetrics:
    """Top-1, top-5 and per-class accuracy; keeps each evaluation's confusion matrix."""
    return ClassificationMetrics(class_names)


def main(argv=None) -> dict[str, float]:
    config, data_args, aug_args, model_args = parse_config(CONFIG_TYPES, argv, defaults=DEFAULTS)
    accelerator = build_accelerator(config)
    with accelerator.main_process_first():
        data = load_data(data_args, config.seed)
    model, processor = build_model(model_args, data.class_names, data.image_size)
    size = processor_size(processor) or data.image_size
    image_sets = {name: ImageDataset(split, size) for name, split in data.splits.items()}
    mean, std = (processor.image_mean, processor.image_std) if processor else channel_mean_std(image_sets["train"])
    if processor is None:
        processor = image_processor(size, mean, std)  # saved with the model: how to preprocess
    for note in data.notes:
        accelerator.print(f"data: {note}")
    accelerator.print(f"data: {', '.join(f'{k} {len(v)}' for k, v in image_sets.items())} images of {size}x{size}, "
                      f"{len(data.class_names)} classes; mean {_fmt(mean)}, std {_fmt(std)}")
    if model_args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    embedded_digits = not (data_args.data_dir or data_args.dataset_name)  # digits are not mirror images
    flip = not embedded_digits if aug_args.horizontal_flip is None else aug_args.horizontal_flip
    augment = TrainAugmentation(size, mean, std, (aug_args.crop_scale_min, 1.0), flip, aug_args.color_jitter)
    mixing = MixupCutmix(len(data.class_names), aug_args.mixup_alpha, aug_args.cutmix_alpha)
    loss_fn = build_loss(augment, EvalTransform(mean, std), mixing, config.label_smoothing_factor,
                         model_args.channels_last)
    metrics_fn = build_metrics(data.class_names)
    set_seed(config.seed, device_specific=True)  # the model is built: now every process draws its own crops
    # validation, else test; a test split besides validation is evaluated at the end
    loaders = split_loaders(image_sets, config, accelerator, data.eval_split)
    finish = ClassificationFinish(data.eval_split, "test" in image_sets, metrics_fn, data.class_names,
                                  config.output_dir)
    result = train(model, loaders.train, config=config, loss_fn=loss_fn, metrics_fn=metrics_fn, hooks=[finish],
                   eval_loader=loaders.eval, final_eval_loaders=loaders.final, accelerator=accelerator,
                   processing_class=processor, extra_configs=[data_args, aug_args, model_args])
    return result.metrics


def _fmt(values) -> str:
    return "(" + ", ".join(f"{v:.3f}" for v in values) + ")"


if __name__ == "__main__":
    run_cli(main)
