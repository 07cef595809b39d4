"""Batched image transforms that run on the training device: dataset statistics, standardisation, the
deterministic evaluation transform, training augmentation (kornia) and mixup / cutmix; and the two helpers
that tie them to transformers image processors (the size a pretrained one expects, one to save).

They take whole uint8 batches [B, 3, H, W] as `ImageDataset` yields them and return float batches, so a
recipe calls them in its loss function on the batch Accelerate already moved to the device; whether the
model is training says which one applies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ...errors import ConfigError
from .data import ImageDataset


def channel_mean_std(dataset: ImageDataset, max_images: int = 5000) -> tuple[list[float], list[float]]:
    """Per-channel mean and std (in [0, 1]) over up to `max_images` evenly spaced training images."""
    step = max(1, math.ceil(len(dataset) / max_images))
    total = torch.zeros(3, dtype=torch.float64)
    squares = torch.zeros(3, dtype=torch.float64)
    count = 0
    for i in range(0, len(dataset), step):
        x = dataset[i]["pixel_values"].double().div_(255).flatten(1)
        total += x.sum(1)
        squares += (x * x).sum(1)
        count += x.shape[1]
    mean = total / count
    std = (squares / count - mean * mean).clamp_min(1e-12).sqrt()
    return mean.tolist(), std.tolist()


def normalize(images: torch.Tensor, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 (or float in [0, 1]) [B, C, H, W] -> float, standardised per channel, on the images' device."""
    x = images.float().div(255) if images.dtype == torch.uint8 else images.float()
    m = torch.as_tensor(mean, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
    s = torch.as_tensor(std, device=x.device, dtype=x.dtype).view(1, -1, 1, 1)
    return (x - m) / s


class EvalTransform(torch.nn.Module):
    """The deterministic evaluation transform: the dataset already resized and centre-cropped; standardise."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        super().__init__()
        self.mean, self.std = list(mean), list(std)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return normalize(images, self.mean, self.std)


class TrainAugmentation(torch.nn.Module):
    """Random resized crop, horizontal flip and colour jitter on a whole uint8 batch (kornia, on the batch's
    device), then standardisation. Draws from torch's global generator, so a seed reproduces it."""

    def __init__(self, image_size: int, mean: Sequence[float], std: Sequence[float],
                 crop_scale: tuple[float, float] = (0.8, 1.0), horizontal_flip: bool = True,
                 color_jitter: float = 0.0):
        super().__init__()
        import kornia.augmentation as K

        steps = [K.RandomResizedCrop((image_size, image_size), scale=crop_scale)]
        if horizontal_flip:
            steps.append(K.RandomHorizontalFlip())
        if color_jitter > 0:  # hue stays off: slow on CPU and it changes class-defining colours
            steps.append(K.ColorJitter(color_jitter, color_jitter, color_jitter, 0.0, p=0.8))
        self.augment = K.AugmentationSequential(*steps)
        self.mean, self.std = list(mean), list(std)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float().div(255) if images.dtype == torch.uint8 else images.float()
        return normalize(self.augment(x), self.mean, self.std)


class MixupCutmix:
    """Mix each batch with itself reversed: mixup (lambda ~ Beta(a, a)) or cutmix (a box of area 1 - lambda),
    chosen at random per batch when both alphas are set. Returns (images, soft targets [B, C]), or the
    batch unchanged when both alphas are 0.

    Written here rather than taken from kornia because kornia's mixup draws lambda uniformly, not from the
    Beta(a, a) of the paper and of timm, and returns labels in its own (B, 3) layout."""

    def __init__(self, num_classes: int, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0):
        self.num_classes, self.mixup_alpha, self.cutmix_alpha = num_classes, mixup_alpha, cutmix_alpha

    @property
    def enabled(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.enabled:
            return images, labels
        targets = torch.nn.functional.one_hot(labels, self.num_classes).float()
        use_cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha <= 0 or torch.rand(()).item() < 0.5)
        alpha = self.cutmix_alpha if use_cutmix else self.mixup_alpha
        lam = torch.distributions.Beta(alpha, alpha).sample().item()
        partner = images.flip(0)
        if use_cutmix:
            images, lam = _paste_box(images, partner, lam)
        else:
            images = images * lam + partner * (1 - lam)
        return images, targets * lam + targets.flip(0) * (1 - lam)


def _paste_box(images: torch.Tensor, partner: torch.Tensor, lam: float) -> tuple[torch.Tensor, float]:
    """Paste a box of about (1 - lam) of the area from `partner`; return the area ratio really kept."""
    h, w = images.shape[-2:]
    cut = math.sqrt(1 - lam)
    ch, cw = int(h * cut), int(w * cut)
    cy, cx = torch.randint(h, ()).item(), torch.randint(w, ()).item()
    y0, y1 = max(cy - ch // 2, 0), min(cy + ch // 2, h)
    x0, x1 = max(cx - cw // 2, 0), min(cx + cw // 2, w)
    mixed = images.clone()
    mixed[..., y0:y1, x0:x1] = partner[..., y0:y1, x0:x1]
    return mixed, 1 - (y1 - y0) * (x1 - x0) / (h * w)


# ----------------------------------------------------------------------- transformers image processors


def processor_size(processor) -> int | None:
    """The square side a pretrained model's image processor produces (its crop size, else its size)."""
    for attr in ("crop_size", "size"):
        size = getattr(processor, attr, None)
        if isinstance(size, int):
            return size
        if size is not None:
            side = _size_field(size, "height") or _size_field(size, "shortest_edge")
            if side:
                return int(side)
    return None


def _size_field(size, key: str):
    """A field of an image processor's size: a dict, or transformers' SizeDict object."""
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


def image_processor(size: int, mean: Sequence[float], std: Sequence[float]):
    """A transformers image processor that resizes to `size` and standardises with `mean` / `std`: saved with
    an exported model, it lets `pipeline("image-classification", out_dir)` preprocess as training did."""
    from transformers import ViTImageProcessorPil  # the PIL one: the default needs torchvision

    return ViTImageProcessorPil(size={"height": size, "width": size}, image_mean=list(mean), image_std=list(std))


@dataclass(frozen=True)
class ImageAugmentationArguments:
    """The image-classification recipe's training augmentation, applied on the device to whole batches."""

    crop_scale_min: float = field(default=0.8, metadata={
        "help": "Random resized crop keeps this much area or more (mild for short runs; long runs: lower)."})
    horizontal_flip: bool | None = field(default=None, metadata={
        "help": "Random horizontal flips (default: on, off for the embedded digits, which are not mirror images)."})
    color_jitter: float = field(default=0.1, metadata={"help": "Brightness/contrast/saturation jitter; 0 = off."})
    mixup_alpha: float = field(default=0.0, metadata={"help": "Mixup Beta(a, a); 0 = off."})
    cutmix_alpha: float = field(default=0.0, metadata={"help": "CutMix Beta(a, a); 0 = off (both set: 50/50)."})

    def __post_init__(self):
        if not 0 < self.crop_scale_min <= 1:
            raise ConfigError(f"--crop_scale_min {self.crop_scale_min}: must be in (0, 1].")
        for name in ("color_jitter", "mixup_alpha", "cutmix_alpha"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} {getattr(self, name)}: must be >= 0 (0 turns it off).")
