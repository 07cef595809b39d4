"""Training augmentation that moves boxes and masks with the image, batched on the training device (kornia).

A random affine map (scale about the centre, translation, optionally rotation) is drawn per image and applied
to the pixels (bilinear), the semantic mask (nearest: class ids stay class ids; a pixel the map brings in from
outside the image is ignored, IGNORE_MASK_VALUE, not class 0: it shows nothing) and the box corners; a box is
then clipped to the image, and one that lost more than `min_visible` of its area is dropped (class -1), since
its object is mostly gone. Rotation makes a rotated box's enclosing box looser than the object's, so it is
off by default for detection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ....errors import ConfigError
from ..transforms import normalize
from .annotated import IGNORE_MASK_VALUE


@dataclass(frozen=True)
class DenseAugmentationArguments:
    """Training augmentation of the dense recipes, applied on the device to images, boxes and masks alike."""

    aug_scale_min: float = field(default=0.8, metadata={"help": "Random zoom: smallest scale (1 = none)."})
    aug_scale_max: float = field(default=1.2, metadata={"help": "Random zoom: largest scale."})
    aug_translate: float = field(default=0.1, metadata={"help": "Random shift, as a fraction of the side."})
    aug_degrees: float = field(default=0.0, metadata={
        "help": "Random rotation up to this many degrees (loosens boxes: off for detection by default)."})

    def __post_init__(self):
        if not 0 < self.aug_scale_min <= self.aug_scale_max:
            raise ConfigError(f"--aug_scale_min {self.aug_scale_min} / --aug_scale_max {self.aug_scale_max}: "
                              "need 0 < min <= max.")
        if not 0 <= self.aug_translate < 1 or self.aug_degrees < 0:
            raise ConfigError(f"--aug_translate {self.aug_translate} must be in [0, 1) and --aug_degrees "
                              f"{self.aug_degrees} >= 0.")

    def build(self, mean: Sequence[float], std: Sequence[float]) -> BoxMaskAugmentation:
        return BoxMaskAugmentation(mean, std, (self.aug_scale_min, self.aug_scale_max), self.aug_translate,
                                   self.aug_degrees)


class BoxMaskAugmentation(torch.nn.Module):
    """`forward(images, boxes=None, classes=None, mask=None) -> (images, boxes, classes, mask)`.

    images: uint8 [B, 3, H, W] -> float, standardised with mean / std; boxes float [B, M, 4] (x0, y0, x1, y1,
    pixels); classes int64 [B, M] with -1 for padding; mask int64 [B, H, W]. Entries not given come back None.
    Draws from torch's global generator, so a seed reproduces it."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], scale: tuple[float, float] = (0.8, 1.2),
                 translate: float = 0.1, degrees: float = 0.0, min_visible: float = 0.6):
        super().__init__()
        import kornia.augmentation as K

        self.affine = K.AugmentationSequential(
            K.RandomAffine(degrees=degrees, translate=(translate, translate), scale=scale, p=1.0),
            data_keys=["input"])
        self.mean, self.std, self.min_visible = list(mean), list(std), min_visible

    def forward(self, images: torch.Tensor, boxes: torch.Tensor | None = None,
                classes: torch.Tensor | None = None, mask: torch.Tensor | None = None):
        x = images.float().div(255) if images.dtype == torch.uint8 else images.float()
        inputs, keys = [x], ["input"]
        if boxes is not None:
            # kornia maps corner coordinates with pixel centres at integers; our boxes put pixel i's centre at
            # i + 0.5 (edges at integers), so shift by half a pixel around the map.
            inputs.append(boxes - 0.5)
            keys.append("bbox_xyxy")
        if mask is not None:
            inputs.append(mask[:, None].float() + 1)  # the warp fills what comes from outside the image with 0
            keys.append("mask")
        out = self.affine(*inputs, data_keys=keys)
        out = out if isinstance(out, (list, tuple)) else [out]
        images = normalize(out[0], self.mean, self.std)
        if boxes is not None:
            boxes, classes = self.clip(out[1] + 0.5, boxes, classes, images.shape[-1], images.shape[-2])
        if mask is not None:
            moved = out[-1][:, 0].round().long() - 1
            mask = torch.where(moved < 0, torch.full_like(moved, IGNORE_MASK_VALUE), moved)
        return images, boxes, classes, mask

    def clip(self, moved: torch.Tensor, original: torch.Tensor, classes: torch.Tensor, width: int, height: int):
        """Clip moved boxes to the image; drop (class -1, zero box) those mostly outside it, and the padding."""
        full = (moved[..., 2] - moved[..., 0]).clamp_min(0) * (moved[..., 3] - moved[..., 1]).clamp_min(0)
        limits = torch.tensor([width, height, width, height], dtype=moved.dtype, device=moved.device)
        clipped = torch.minimum(moved.clamp_min(0), limits)
        area = (clipped[..., 2] - clipped[..., 0]).clamp_min(0) * (clipped[..., 3] - clipped[..., 1]).clamp_min(0)
        keep = (classes >= 0) & (area > 0) & (area >= self.min_visible * full)
        return torch.where(keep[..., None], clipped, torch.zeros_like(clipped)), torch.where(keep, classes, -1)
