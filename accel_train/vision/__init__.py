"""Kept for one release: the image task kit now lives in `accel_train.tasks.vision` (image-text pairs in
`accel_train.tasks.multimodal.data`, the override parser in `accel_train.tasks.model_config`). Every name below
still imports from here.

    from accel_train.vision import ImageDataArguments, ImageDataset, load_image_data, TrainAugmentation
"""

from ..tasks.model_config import parse_overrides
from ..tasks.multimodal.data import (
                       ImageTextArguments,
                       ImageTextCollator,
                       ImageTextDataset,
                       digits_with_captions,
                       load_caption_dataset,
                       load_caption_folder,
                       load_image_text_data,
)
from ..tasks.vision.classification import ClassificationMetrics, per_class_accuracy, save_confusion_matrix
from ..tasks.vision.data import (
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
from ..tasks.vision.models import SmallResNet
from ..tasks.vision.transforms import (
                       EvalTransform,
                       MixupCutmix,
                       TrainAugmentation,
                       channel_mean_std,
                       image_processor,
                       normalize,
                       processor_size,
)

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
