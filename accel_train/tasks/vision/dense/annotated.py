"""A user's own annotated images for the dense tasks, checked while loading so bad annotations fail before
training with a message that names the file and the entry.

Detection, COCO style: ``<data_dir>/train.json`` with the images in ``<data_dir>/train/`` (``file_name``
relative to it), plus optional ``validation.json`` / ``val.json`` and ``test.json`` beside their folders.
Each JSON has ``images`` (id, file_name, width, height), ``annotations`` (image_id, category_id, bbox as
[x, y, width, height] in pixels, optional ``iscrowd``) and ``categories`` (id, name). An ``iscrowd`` box marks a
region of many objects that were not boxed one by one: it is kept, flagged in the ``crowd`` column, so that the
evaluation passes it to pycocotools as a crowd region (a detection inside it is neither a hit nor a false
positive), and it is no training target (as in detectron2 and torchvision's reference scripts).

Segmentation, image + mask pairs: ``<data_dir>/train/images/<name>.<ext>`` and
``<data_dir>/train/masks/<name>.png`` (plus optional ``validation/`` or ``val/`` and ``test/``). A mask is a
single-channel PNG of the image's size whose pixel values are class ids; 255 marks pixels to ignore.
Class names come from ``<data_dir>/classes.txt`` (one per line, id = line number) when it exists.

Images are resized (stretched) to the square side the model takes; boxes scale with them (IoU is unchanged
by a scaling per axis), masks are resized with nearest-neighbour sampling. Decoding happens when the loader
asks for an item.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from ....errors import DataError
from ..data import SPLIT_FOLDERS, find_images, open_image, to_rgb
from .canvases import DenseData

# Mask pixels with this value count in no loss and no metric. A separate name from core.loss.IGNORE_INDEX (-100, a
# per-token label): a mask is a uint8 PNG, which cannot hold -100.
IGNORE_MASK_VALUE = 255


# ------------------------------------------------------------------------------------- detection (COCO)


def load_coco_detection(data_dir: str | Path, image_size: int, validation_percent: int, seed: int) -> DenseData:
    """Load ``<split>.json`` + ``<split>/`` for train (required), validation and test (optional)."""
    root = _existing_dir(data_dir)
    files = {split: next((root / f"{n}.json" for n in names if (root / f"{n}.json").is_file()), None)
             for split, names in SPLIT_FOLDERS.items()}
    if files["train"] is None:
        raise DataError(f"--data_dir {root}: no train.json. Detection data is COCO-style: train.json with the "
                        "images in train/ (plus optional validation.json + validation/, test.json + test/).")
    docs = {split: _read_json(path) for split, path in files.items() if path is not None}
    categories = _categories(docs["train"], files["train"])
    class_names = [name for _, name in categories]
    index = {cid: i for i, (cid, _) in enumerate(categories)}
    splits, notes, most = {}, [], 1
    for split, doc in docs.items():
        if _categories(doc, files[split]) != categories:
            raise DataError(f"{files[split]}: its categories differ from {files['train']}'s; every split needs the "
                            "same categories (ids and names).")
        columns = _coco_split(doc, files[split], root / files[split].stem, index, image_size)
        crowds = sum(map(sum, columns["crowd"]))
        if crowds:
            notes.append(f"{files[split].name}: {crowds} iscrowd annotation(s) kept as crowd regions (evaluation "
                         "ignores detections inside them, as pycocotools does; training does not learn them)")
        most = max([most, *map(len, columns["classes"])])
        splits[split] = _lazy(columns, image_size)
    splits = _carve_validation(splits, validation_percent, seed)
    return DenseData(splits, class_names, [], image_size, most, tuple(notes))


def _read_json(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: not readable JSON ({err}).") from None
    for key in ("images", "annotations", "categories"):
        if not isinstance(doc.get(key), list):
            raise DataError(f"{path}: no '{key}' list; a COCO detection file has images, annotations and categories.")
    if not doc["annotations"]:
        raise DataError(f"{path}: the annotation list is empty. Add the boxes (image_id, category_id, bbox) "
                        "of its images; a detector cannot learn from images without any.")
    return doc


def _categories(doc: dict, path: Path) -> list[tuple[int, str]]:
    try:
        found = sorted((int(c["id"]), str(c.get("name", c["id"]))) for c in doc["categories"])
    except (KeyError, TypeError, ValueError):
        raise DataError(f"{path}: every category needs an integer 'id' (and a 'name').") from None
    if not found:
        raise DataError(f"{path}: the categories list is empty.")
    return found


def _coco_split(doc: dict, path: Path, folder: Path, index: dict[int, int], size: int) -> dict:
    """Columns {"image", "boxes", "classes", "crowd"} with boxes scaled to `size`; crowd flags each box."""
    images = {}
    for entry in doc["images"]:
        try:
            image_id, name = entry["id"], entry["file_name"]
        except (KeyError, TypeError):
            raise DataError(f"{path}: an image entry has no 'id' or 'file_name': {entry!r:.200}") from None
        file = folder / name
        if not file.is_file():
            raise DataError(f"{path}: image {image_id} ({name}) is not in {folder}.")
        width, height = _image_size(file)
        if (entry.get("width", width), entry.get("height", height)) != (width, height):
            raise DataError(f"{path}: image {image_id} ({name}) is {width}x{height} but the JSON says "
                            f"{entry.get('width')}x{entry.get('height')}.")
        images[image_id] = {"image": str(file), "size": (width, height), "boxes": [], "classes": [], "crowd": []}
    for n, ann in enumerate(doc["annotations"]):
        where = f"{path}: annotation {ann.get('id', n) if isinstance(ann, dict) else n}"
        if not isinstance(ann, dict) or not {"image_id", "category_id", "bbox"} <= set(ann):
            raise DataError(f"{where} needs image_id, category_id and bbox: {ann!r:.200}")
        image = images.get(ann["image_id"])
        if image is None:
            raise DataError(f"{where}: image_id {ann['image_id']} is not in the images list.")
        if ann["category_id"] not in index:
            raise DataError(f"{where}: category_id {ann['category_id']} is not in the categories list.")
        image["boxes"].append(_checked_box(ann["bbox"], image["size"], size, where))
        image["classes"].append(index[ann["category_id"]])
        image["crowd"].append(bool(ann.get("iscrowd")))
    return {key: [i[key] for i in images.values()] for key in ("image", "boxes", "classes", "crowd")}


def _checked_box(bbox, image_size: tuple[int, int], size: int, where: str) -> list[float]:
    """COCO [x, y, w, h] -> [x0, y0, x1, y1] scaled to a size x size image; a DataError when it leaves the image."""
    width, height = image_size
    try:
        x, y, w, h = (float(v) for v in bbox)
    except (TypeError, ValueError):
        raise DataError(f"{where}: bbox {bbox!r} is not [x, y, width, height].") from None
    if not (w > 0 and h > 0):
        raise DataError(f"{where}: bbox {bbox} has no area (width and height must be > 0).")
    slack = 0.01  # rounding in tools that write COCO files
    if x < -slack or y < -slack or x + w > width + slack or y + h > height + slack:
        raise DataError(f"{where}: bbox {bbox} (x, y, width, height) lies outside its {width}x{height} image. "
                        "Fix the box, or clip it to the image if the object is partly outside.")
    sx, sy = size / width, size / height
    return [max(x, 0.0) * sx, max(y, 0.0) * sy, min(x + w, width) * sx, min(y + h, height) * sy]


# ------------------------------------------------------------------------ segmentation (image + mask pairs)


def load_mask_pairs(data_dir: str | Path, image_size: int, validation_percent: int, seed: int) -> DenseData:
    """Load ``<split>/images/*`` + ``<split>/masks/*.png`` for train (required), validation and test."""
    root = _existing_dir(data_dir)
    folders = {split: next((root / n for n in names if (root / n / "images").is_dir()), None)
               for split, names in SPLIT_FOLDERS.items()}
    if folders["train"] is None:
        raise DataError(f"--data_dir {root}: no train/images/. Segmentation data is train/images/<name>.<ext> "
                        "with train/masks/<name>.png (plus optional validation/ and test/ alike).")
    pairs = {split: _pairs(folder) for split, folder in folders.items() if folder is not None}
    names_file = root / "classes.txt"
    names = [line.strip() for line in names_file.read_text().splitlines() if line.strip()] \
        if names_file.is_file() else None
    highest = max(v for split in pairs.values() for _, _, values in split for v in values if v != IGNORE_MASK_VALUE)
    if highest >= IGNORE_MASK_VALUE:
        raise DataError(f"a mask holds class id {highest}: ids must be below {IGNORE_MASK_VALUE} "
                        f"({IGNORE_MASK_VALUE} = ignore).")
    if names is not None and highest >= len(names):
        raise DataError(f"a mask holds class id {highest} but {names_file} names {len(names)} classes (ids 0.."
                        f"{len(names) - 1}); fix the mask or add the class name.")
    class_names = names or [str(i) for i in range(highest + 1)]
    splits = {split: _lazy({"image": [str(i) for i, _, _ in found], "mask_path": [str(m) for _, m, _ in found]},
                           image_size) for split, found in pairs.items()}
    splits = _carve_validation(splits, validation_percent, seed)
    return DenseData(splits, [], class_names, image_size, max_objects=1)


def _pairs(folder: Path) -> list[tuple[Path, Path, set[int]]]:
    """(image, mask, class ids in the mask) for every image under folder/images, checked against its mask."""
    scan = find_images(folder / "images")
    if not scan.paths:
        raise DataError(f"{folder / 'images'} has no readable images.")
    out = []
    for image in scan.paths:
        mask = folder / "masks" / (image.stem + ".png")
        if not mask.is_file():
            raise DataError(f"{image} has no mask: expected {mask} (a single-channel PNG of class ids).")
        values = np.asarray(_read_mask(mask))
        size = _image_size(image)
        if values.shape != (size[1], size[0]):
            raise DataError(f"mask {mask} is {values.shape[1]}x{values.shape[0]} but its image {image} is "
                            f"{size[0]}x{size[1]}; a mask must have its image's size.")
        out.append((image, mask, set(np.unique(values).tolist())))
    return out


def _read_mask(path: Path):
    with open_image(path) as mask:
        if mask.mode not in ("L", "P", "I", "I;16", "1"):
            raise DataError(f"mask {path} is a {mask.mode} image; masks are single-channel (L or P) PNGs whose "
                            "pixel values are class ids.")
        return np.array(mask, dtype=np.int64)


# ----------------------------------------------------------------------------------------------- shared


def _existing_dir(data_dir: str | Path) -> Path:
    root = Path(data_dir)
    if not root.is_dir():
        raise DataError(f"--data_dir {root}: no such directory.")
    return root


def _image_size(path: Path) -> tuple[int, int]:
    try:
        with open_image(path) as image:
            return image.size
    except (OSError, ValueError) as err:
        raise DataError(f"{path}: not a readable image ({err}).") from None


def _lazy(columns: dict, size: int):
    """A `datasets.Dataset` of paths that decodes (and resizes) images and masks when an item is read."""
    import datasets

    dataset = datasets.Dataset.from_dict(columns)
    dataset.set_transform(functools.partial(_decode, size=size))  # a partial pickles into spawned loader workers
    return dataset


def _decode(batch: dict, size: int) -> dict:
    from PIL import Image

    out = {"pixel_values": []}
    for path in batch["image"]:
        image = to_rgb(open_image(path)).resize((size, size), Image.Resampling.BILINEAR)
        out["pixel_values"].append(np.asarray(image, dtype=np.uint8).transpose(2, 0, 1))
    if "mask_path" in batch:
        out["mask"] = [np.asarray(Image.fromarray(_read_mask(Path(p)).astype(np.uint8)).resize(
            (size, size), Image.Resampling.NEAREST)) for p in batch["mask_path"]]
    for key in ("boxes", "classes", "crowd"):
        if key in batch:
            out[key] = batch[key]
    return out


def _carve_validation(splits: dict, percent: int | None, seed: int) -> dict:
    """Hold out `percent` of train (seeded) as validation when the data has neither validation nor test."""
    if "validation" in splits or "test" in splits or not percent:
        return splits
    if not 0 < percent < 100:
        raise DataError(f"--validation_split_percentage {percent}: must be in [0, 100).")
    train = splits["train"]
    order = np.random.default_rng(seed).permutation(len(train))
    held = max(1, round(len(train) * percent / 100))
    if held >= len(train):
        raise DataError(f"train has {len(train)} images: too few to hold out {percent}% for validation.")
    return {"train": train.select(np.sort(order[held:])), "validation": train.select(np.sort(order[:held]))}
