"""What any image recipe reuses: loading image data, on-device transforms, a small ResNet, and
classification metrics with a confusion-matrix plot.

    from accel_train.vision import ImageDataArguments, ImageDataset, load_image_data, TrainAugmentation

Submodules: `data` (image folders, `datasets`, the embedded digits, splits), `captions` (image-text pairs:
folders with metadata.jsonl, `datasets`, the digits with generated captions; dataset and collator),
`transforms` (statistics, augmentation, evaluation transform, mixup / cutmix), `models` (SmallResNet),
`classification` (metrics).
"""

from .captions import (ImageTextArguments, ImageTextCollator, ImageTextDataset, digits_with_captions,
                       load_caption_dataset, load_caption_folder, load_image_text_data)
from .classification import ClassificationMetrics, per_class_accuracy, save_confusion_matrix
from .data import (
    FolderScan,
    ImageData,
    ImageDataArguments,
    ImageDataset,
    ImageSplit,
    find_images,
    fit_square,
    load_digits,
    load_hub_dataset,
    load_image_data,
    load_image_folder,
    stratified_split,
    to_rgb,
)
from .models import SmallResNet, parse_overrides
from .transforms import (EvalTransform, MixupCutmix, TrainAugmentation, channel_mean_std, image_processor, normalize,
                         processor_size)

__all__ = [
    "ImageDataArguments",
    "ImageData",
    "ImageSplit",
    "ImageDataset",
    "FolderScan",
    "find_images",
    "load_image_data",
    "load_image_folder",
    "load_hub_dataset",
    "load_digits",
    "stratified_split",
    "to_rgb",
    "fit_square",
    "channel_mean_std",
    "normalize",
    "image_processor",
    "processor_size",
    "EvalTransform",
    "TrainAugmentation",
    "MixupCutmix",
    "SmallResNet",
    "parse_overrides",
    "ImageTextArguments",
    "ImageTextDataset",
    "ImageTextCollator",
    "load_image_text_data",
    "load_caption_folder",
    "load_caption_dataset",
    "digits_with_captions",
    "ClassificationMetrics",
    "per_class_accuracy",
    "save_confusion_matrix",
]
