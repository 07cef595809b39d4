"""A phone photo is stored sideways with an EXIF Orientation tag that says how to turn it upright; viewers,
annotation tools and `datasets`' Image feature show it turned. Every loader of a user's images reads it upright, so
an image, its boxes (given on the upright image, as the annotation tool showed it) and its mask stay together.

The photo here: upright 24 wide x 40 tall, dark, with a bright block in the top-right corner (x 12-24, y 0-16),
stored turned a quarter to the left with Orientation 6 ("turn 90 degrees clockwise to display").
"""

import json

import numpy as np
import pytest
from PIL import Image

from accel_train.tasks.vision.data import ImageDataset, ImageSplit, fit_square, load_image_folder
from accel_train.tasks.vision.dense.annotated import load_coco_detection, load_mask_pairs

ORIENTATION = 0x0112  # the EXIF tag
BLOCK = (12, 0, 24, 16)  # x0, y0, x1, y1 on the upright photo
JPEG_SLACK = 12  # mean absolute difference, in 0-255 grey levels, that JPEG compression may add


def upright() -> Image.Image:
    image = Image.new("RGB", (24, 40), (20, 20, 20))
    image.paste((235, 235, 235), BLOCK)
    return image


def save_sideways_photo(path) -> None:
    """The upright photo turned 90 degrees counter-clockwise (how the camera stored it), tagged to be turned back."""
    exif = Image.Exif()
    exif[ORIENTATION] = 6
    upright().transpose(Image.Transpose.ROTATE_90).save(path, "JPEG", quality=95, exif=exif)


def test_an_image_folder_reads_the_photo_upright(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        save_sideways_photo(tmp_path / name / "photo.jpg")
    with Image.open(tmp_path / "a" / "photo.jpg") as stored:
        assert stored.size == (40, 24)  # the file's pixels are sideways
    data = load_image_folder(tmp_path)
    item = ImageDataset(data.splits["train"], 24)[0]["pixel_values"].numpy().transpose(1, 2, 0).astype(float)
    expected = np.asarray(fit_square(upright(), 24), dtype=float)  # the centre square of the upright photo
    assert np.abs(item - expected).mean() < JPEG_SLACK
    whole = ImageDataset(ImageSplit([tmp_path / "a" / "photo.jpg"], {"labels": [0]}), 24)[0]["pixel_values"]
    assert whole[:, :8, 12:].float().mean() > 200 and whole[:, :8, :12].float().mean() < 50


def test_boxes_on_the_upright_photo_fit_its_pixels(tmp_path):
    (tmp_path / "train").mkdir()
    save_sideways_photo(tmp_path / "train" / "photo.jpg")
    x0, y0, x1, y1 = BLOCK
    doc = {"images": [{"id": 1, "file_name": "photo.jpg", "width": 24, "height": 40}],  # as the tool showed it
           "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [x0, y0, x1 - x0, y1 - y0]}],
           "categories": [{"id": 1, "name": "block"}]}
    (tmp_path / "train.json").write_text(json.dumps(doc))
    data = load_coco_detection(tmp_path, 32, validation_percent=0, seed=0)
    item = data.splits["train"][0]
    assert np.allclose(item["boxes"][0], [16, 0, 32, 12.8])  # scaled from 24 x 40 to 32 x 32
    pixels = np.asarray(item["pixel_values"], dtype=float).mean(0)  # stretched to 32 x 32
    inside = np.zeros((32, 32), dtype=bool)
    inside[1:12, 17:] = True  # the box less a pixel of resampling blur at its edges
    outside = np.ones((32, 32), dtype=bool)
    outside[:14, 15:] = False
    assert pixels[inside].min() > 180 and pixels[outside].max() < 70


def test_a_mask_drawn_on_the_upright_photo_covers_its_pixels(tmp_path):
    for folder in ("images", "masks"):
        (tmp_path / "train" / folder).mkdir(parents=True)
    save_sideways_photo(tmp_path / "train" / "images" / "photo.jpg")
    mask = np.zeros((40, 24), dtype=np.uint8)
    x0, y0, x1, y1 = BLOCK
    mask[y0:y1, x0:x1] = 1
    Image.fromarray(mask).save(tmp_path / "train" / "masks" / "photo.png")
    data = load_mask_pairs(tmp_path, 24, validation_percent=0, seed=0)
    item = data.splits["train"][0]
    pixels = np.asarray(item["pixel_values"], dtype=float).mean(0)
    block = np.asarray(item["mask"]) == 1
    assert block.sum() == pytest.approx(24 * 24 * (12 * 16) / (24 * 40), abs=24)  # a fifth of the image
    assert pixels[block].mean() > 200 and pixels[~block].mean() < 50
