"""Boxes and masks with exact ground truth: MNIST digits pasted on blank canvases, and the batches both
dense tasks (detection, segmentation) train on.

`generate_canvases` pastes 1 to `max_digits` digits at random positions and scales on a square canvas and
records, for each digit, its class, its tight box (around its stroke pixels) and its stroke pixels in a
semantic mask. Train canvases use only the digits' train split, test canvases only its test split, so no
test digit is ever seen in training. A canvas item is

    {"pixel_values": uint8 [3, S, S], "boxes": float32 [n, 4] (x0, y0, x1, y1 in pixels, x1/y1 exclusive),
     "classes": int64 [n] (the digit), "mask": uint8 [S, S] (0 background, 1 + digit on its strokes)}

in a `datasets.Dataset` (numpy format). Boxes never overlap, so every stroke pixel belongs to one digit.
A user's own boxes and masks (`--data_dir`) load with `annotated` into the same `DenseData`.
`DenseCollator` pads the boxes of a batch to a fixed count per image (class -1 marks padding), so every
per-image tensor has the same shape on every process and evaluation can gather it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ....errors import ConfigError, DataError
from ..data import load_digits

DIGIT_NAMES = [str(d) for d in range(10)]
STROKE_THRESHOLD = 128  # a pixel of a resized digit at or above this is stroke (mask, box); below: background
SIDE_TRIES = 5  # a digit that finds no free place at 5 sizes x 10 positions is left out
POSITION_TRIES = 10


@dataclass(frozen=True)
class DenseDataArguments:
    """Where the images, boxes and masks come from."""

    data_dir: str | None = field(default=None, metadata={
        "help": "Your own data: COCO-style <split>.json + <split>/ images (detection), or <split>/images/*.png + "
                "<split>/masks/*.png (segmentation). Default: canvases generated from the embedded MNIST digits."})
    num_train_canvases: int = field(default=8000, metadata={"help": "Generated canvases from the train digits."})
    num_test_canvases: int = field(default=1000, metadata={"help": "Generated canvases from the test digits."})
    canvas_size: int = field(default=64, metadata={
        "help": "Side of the square canvases (64-96 in the benchmarks); --data_dir images are resized to it."})
    max_digits: int = field(default=4, metadata={"help": "Each canvas holds 1 to this many digits."})
    digit_scale_min: float = field(default=0.6, metadata={"help": "Smallest digit, as a factor of its 28 px."})
    digit_scale_max: float = field(default=1.4, metadata={"help": "Largest digit, as a factor of its 28 px."})
    canvas_seed: int = field(default=0, metadata={
        "help": "Seed of the generated canvases (fixed, so every run is measured on the same test canvases)."})
    validation_split_percentage: int = field(default=10, metadata={
        "help": "--data_dir without validation/ or test/: percent of train held out (seeded by --seed)."})

    def __post_init__(self):
        if self.canvas_size < 32:
            raise ConfigError(f"--canvas_size {self.canvas_size}: must be at least 32 pixels.")
        if self.data_dir:
            return  # the rest shapes generated canvases only
        if not 0 < self.digit_scale_min <= self.digit_scale_max:
            raise ConfigError(f"--digit_scale_min {self.digit_scale_min} / --digit_scale_max {self.digit_scale_max}: "
                              "need 0 < min <= max.")
        if 28 * self.digit_scale_max > self.canvas_size:
            raise ConfigError(f"--digit_scale_max {self.digit_scale_max}: a {28 * self.digit_scale_max:.0f} px digit "
                              f"does not fit a {self.canvas_size} px canvas; lower it or raise --canvas_size.")
        for name in ("num_train_canvases", "num_test_canvases", "max_digits"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} {getattr(self, name)}: must be at least 1.")


@dataclass(frozen=True)
class DenseData:
    """Splits ("train", and "validation" / "test"), the names of the box classes and of the mask values, the
    square image side, and the most boxes any image has (the padding size of a batch: the same on every
    process). Data without boxes has no box classes; data without masks no mask classes."""

    splits: dict[str, Any]  # datasets.Dataset per split
    class_names: list[str]  # box class i
    mask_class_names: list[str]  # mask value i
    image_size: int
    max_objects: int
    notes: tuple[str, ...] = ()

    @property
    def eval_split(self) -> str:
        """The split evaluated during training: validation if there is one, else test."""
        return "validation" if "validation" in self.splits else "test"


def generate_canvases(images: Sequence[np.ndarray], labels: Sequence[int], num_canvases: int, canvas_size: int,
                      seed: int, max_digits: int = 4, scale: tuple[float, float] = (0.6, 1.4)):
    """`num_canvases` canvases (a `datasets.Dataset`, numpy format) built from the 28x28 uint8 `images`.

    Each canvas draws its digit count uniformly from 1..max_digits; each digit draws an image, a side of
    28 * U(scale) pixels and a position until its tight box keeps a 1 px gap to the boxes already placed
    (a digit that finds no place in 50 tries is left out: rare unless digits are large for the canvas).
    Deterministic in `seed`."""
    rng = np.random.default_rng(seed)
    size = canvas_size
    pixels = np.zeros((num_canvases, 3, size, size), dtype=np.uint8)
    masks = np.zeros((num_canvases, size, size), dtype=np.uint8)
    all_boxes, all_classes = [], []
    for k in range(num_canvases):
        boxes, classes = [], []
        for _ in range(int(rng.integers(1, max_digits + 1))):
            index = int(rng.integers(len(images)))
            placed = _place_digit(np.asarray(images[index]), boxes, size, scale, rng)
            if placed is None:
                continue
            tile, (x, y), box = placed
            side = tile.shape[0]
            region = pixels[k, 0, y:y + side, x:x + side]
            np.maximum(region, tile, out=region)
            masks[k, y:y + side, x:x + side][tile >= STROKE_THRESHOLD] = int(labels[index]) + 1
            boxes.append(box)
            classes.append(int(labels[index]))
        all_boxes.append(boxes)
        all_classes.append(classes)
    pixels[:, 1] = pixels[:, 0]  # grey digits as RGB, like any user image
    pixels[:, 2] = pixels[:, 0]
    return _to_dataset(pixels, masks, all_boxes, all_classes)


def _place_digit(digit: np.ndarray, boxes: list, size: int, scale: tuple[float, float], rng):
    """(resized tile, (x, y) of its corner, tight stroke box on the canvas) or None when no free place is found:
    up to `SIDE_TRIES` sides, each tried at up to `POSITION_TRIES` positions (resizing is the costly part)."""
    from PIL import Image

    for _ in range(SIDE_TRIES):
        side = max(8, round(28 * rng.uniform(*scale)))
        tile = np.asarray(Image.fromarray(digit).resize((side, side), Image.Resampling.BILINEAR))
        ys, xs = np.nonzero(tile >= STROKE_THRESHOLD)
        if len(xs) == 0:
            continue
        for _ in range(POSITION_TRIES):
            x, y = int(rng.integers(0, size - side + 1)), int(rng.integers(0, size - side + 1))
            box = [float(x + xs.min()), float(y + ys.min()), float(x + xs.max() + 1), float(y + ys.max() + 1)]
            if all(box[0] > b[2] or box[2] < b[0] or box[1] > b[3] or box[3] < b[1] for b in boxes):
                return tile, (x, y), box
    return None


def _to_dataset(pixels: np.ndarray, masks: np.ndarray, boxes: list, classes: list):
    import datasets

    size = pixels.shape[-1]
    features = datasets.Features({
        "pixel_values": datasets.Array3D((3, size, size), "uint8"),
        "mask": datasets.Array2D((size, size), "uint8"),
        "boxes": datasets.Sequence(datasets.Sequence(datasets.Value("float32"), length=4)),
        "classes": datasets.Sequence(datasets.Value("int64")),
    })
    columns = {"pixel_values": pixels, "mask": masks, "boxes": boxes, "classes": classes}
    return datasets.Dataset.from_dict(columns, features=features).with_format("numpy")


def load_canvases(args: DenseDataArguments) -> DenseData:
    """Train canvases from the digits' train split, test canvases from its test split (never mixed)."""
    digits = load_digits()
    scale = (args.digit_scale_min, args.digit_scale_max)
    splits = {}
    for offset, (name, count) in enumerate((("train", args.num_train_canvases), ("test", args.num_test_canvases))):
        split = digits.splits[name]
        splits[name] = generate_canvases(split.images, split.labels, count, args.canvas_size,
                                         seed=args.canvas_seed * 2 + offset, max_digits=args.max_digits, scale=scale)
    most = max(max(len(c) for c in ds["classes"]) for ds in splits.values())
    return DenseData(splits, list(DIGIT_NAMES), ["background", *DIGIT_NAMES], args.canvas_size, max(most, 1))


def pixel_mean_std(dataset, max_images: int = 2000) -> tuple[list[float], list[float]]:
    """Per-channel mean and std (in [0, 1]) over up to `max_images` evenly spaced items of a dense dataset."""
    step = max(1, -(-len(dataset) // max_images))
    pixels = np.stack([np.asarray(dataset[i]["pixel_values"], dtype=np.float64)
                       for i in range(0, len(dataset), step)]) / 255
    return pixels.mean(axis=(0, 2, 3)).tolist(), pixels.std(axis=(0, 2, 3)).clip(1e-6).tolist()


class DenseCollator:
    """Items -> one batch: "pixel_values" uint8 [B, 3, S, S]; "boxes" float32 [B, M, 4] and "classes" int64
    [B, M] padded to `max_objects` with class -1 (the validity mask: `classes >= 0`); "crowd" bool [B, M] when
    the items flag crowd regions; "mask" int64 [B, S, S] when the items have masks. M is fixed by the data, not
    the batch, so gathered tensors line up."""

    def __init__(self, max_objects: int):
        self.max_objects = max_objects

    def __call__(self, items: list[dict]) -> dict[str, torch.Tensor]:
        # `datasets`' numpy format widens uint8 columns to int64: narrow them back (a quarter of the bytes to move)
        batch = {"pixel_values": torch.from_numpy(np.stack([it["pixel_values"] for it in items]).astype(np.uint8))}
        if "classes" in items[0]:
            boxes = torch.zeros(len(items), self.max_objects, 4)
            classes = torch.full((len(items), self.max_objects), -1, dtype=torch.int64)
            for i, item in enumerate(items):
                n = len(item["classes"])
                if n > self.max_objects:
                    raise DataError(f"an image has {n} boxes, more than the {self.max_objects} the collator pads to.")
                if n:
                    boxes[i, :n] = torch.tensor(np.asarray(item["boxes"], dtype=np.float32).reshape(n, 4))
                    classes[i, :n] = torch.tensor(np.asarray(item["classes"], dtype=np.int64))
            batch["boxes"], batch["classes"] = boxes, classes
            if "crowd" in items[0]:  # a user's COCO crowd regions (annotated.py); padding is no crowd
                batch["crowd"] = torch.zeros(len(items), self.max_objects, dtype=torch.bool)
                for i, item in enumerate(items):
                    batch["crowd"][i, :len(item["crowd"])] = torch.tensor(np.asarray(item["crowd"], dtype=bool))
        if "mask" in items[0]:
            batch["mask"] = torch.from_numpy(np.stack([np.asarray(it["mask"]) for it in items]).astype(np.int64))
        return batch
