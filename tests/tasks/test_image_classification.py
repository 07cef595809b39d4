"""The image-classification recipe and accel_train.tasks.vision.

Fast tests build tiny image folders with PIL in tmp_path and train tiny models through `main(argv)`; the
1-vs-2-process comparison is the recipe's one real `accelerate launch` (2 processes) against `main(argv)` here.
"""

import json
import math

import image_classification as recipe
import numpy as np
import pytest
import torch
import yaml
from conftest import RECIPES, ROOT, SHARED_DATA, launch, reset_accelerate
from PIL import Image
from safetensors.torch import load_file

from accel_train import ConfigError, DataError, ModelError, TrainConfig, parse_config
from accel_train.tasks.vision.data import (
    ImageDataArguments,
    ImageDataset,
    load_digits,
    load_image_data,
    load_image_folder,
)
from accel_train.tasks.vision.transforms import MixupCutmix, TrainAugmentation

RECIPE = RECIPES / "image_classification.py"
COLOURS = [(220, 40, 40), (40, 220, 40), (40, 40, 220)]
QUIET = ["--report_to", "none", "--disable_tqdm", "--save_strategy", "no"]
TINY_RESNET = ["--config_overrides", '{"widths": [8, 16], "blocks_per_stage": 1}']
TINY_VIT = ["--model_type", "vit", "--config_overrides",
            '{"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}']


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


def colour_folder(root, counts, classes=("red", "green", "blue"), size=16, seed=0):
    """<root>/<split>/<class>/*.png: noisy images of one colour per class (easy to learn, hard to fake)."""
    rng = np.random.default_rng(seed)
    for split, n in counts.items():
        for cls, colour in zip(classes, COLOURS, strict=False):
            folder = root / split / cls
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = np.clip(np.array(colour) + rng.normal(0, 25, (size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i:03d}.png")
    return root


def run(tmp_path, data_dir, *flags, name="out"):
    out = tmp_path / name
    metrics = recipe.main(["--data_dir", str(data_dir), "--output_dir", str(out), *QUIET, *flags])
    return out, metrics


def test_the_metrics_declare_exactly_the_names_they_return():
    """`metric_names` is what a call returns (per-class keys of names that clean up alike included), so the session
    refuses a --metric_for_best_model no evaluation reports before training, not at the first evaluation."""
    from accel_train.core.evaluation import check_monitored_metric
    from accel_train.tasks.vision.classification import ClassificationMetrics

    metrics = ClassificationMetrics(["red", "red!", "blue"], top_k=2)
    returned = metrics({"logits": torch.eye(3), "labels": torch.tensor([0, 1, 1])})
    assert list(returned) == metrics.metric_names == ["accuracy", "top2_accuracy", "accuracy_0_red",
                                                      "accuracy_1_red", "accuracy_blue"]
    mistyped = TrainConfig(output_dir="unused", metric_for_best_model="eval_acuracy")
    with pytest.raises(ConfigError, match=r"--metric_for_best_model eval_acuracy: the evaluations of this run report "
                                          r"only eval_loss, .*eval_accuracy, eval_top2_accuracy, eval_accuracy_0_red"):
        check_monitored_metric(mistyped, metrics, has_eval_loader=True)


# ------------------------------------------------------------------------------------------- end to end


def test_tiny_model_learns_colours_and_writes_the_results(tmp_path, capsys):
    data = colour_folder(tmp_path / "data", {"train": 10, "test": 3})
    out, metrics = run(tmp_path, data, *TINY_RESNET, "--num_train_epochs", "8", "--per_device_train_batch_size", "6",
                       "--per_device_eval_batch_size", "4", "--learning_rate", "0.01", "--color_jitter", "0")
    results = json.loads((out / "all_results.json").read_text())
    assert results == pytest.approx(metrics, nan_ok=True)
    assert results["eval_samples"] == 9 and results["test_samples"] == 9  # test is the evaluation split here
    assert results["eval_accuracy"] == results["test_accuracy"] == 1.0
    assert results["eval_top5_accuracy"] == 1.0
    assert [results[f"test_accuracy_{c}"] for c in ("red", "green", "blue")] == [1.0, 1.0, 1.0]
    assert (out / "confusion_matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(load_file(out / "model.safetensors")) >= {"head.weight", "stem.0.weight"}
    assert json.loads((out / "preprocessor_config.json").read_text())["size"] == {"height": 16, "width": 16}
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model_type"] == "small_resnet" and saved["data_dir"] == str(data)
    printed = capsys.readouterr().out
    assert "per-class test accuracy" in printed and "test top-1 accuracy 100.00%" in printed


def test_validation_carved_from_train_and_test_evaluated_at_the_end(tmp_path, capsys):
    # 20% of train becomes validation (evaluated during training); test is evaluated once at the end. With
    # channels_last, mixup + cutmix and a multistep schedule by name.
    data = colour_folder(tmp_path / "data", {"train": 10, "test": 2})
    out, metrics = run(tmp_path, data, *TINY_RESNET, "--validation_split_percentage", "20", "--max_steps", "4",
                       "--per_device_train_batch_size", "8", "--channels_last", "--mixup_alpha", "0.4",
                       "--cutmix_alpha", "1.0", "--lr_scheduler_type", "multistep", "--lr_scheduler_kwargs",
                       '{"milestones": [2]}', "--logging_steps", "1")
    assert metrics["eval_samples"] == 6 and metrics["test_samples"] == 6
    assert {"test_accuracy", "test_top5_accuracy", "test_loss", "test_accuracy_red"} <= set(metrics)
    assert json.loads((out / "all_results.json").read_text()) == pytest.approx(metrics)
    rates = [r["learning_rate"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
             if "learning_rate" in r]
    assert len(rates) == 4 and rates[2] == pytest.approx(rates[1] * 0.1)  # the milestone at step 2
    assert math.isfinite(metrics["train_loss"]) and (out / "confusion_matrix.png").is_file()
    assert "per-class test accuracy" in capsys.readouterr().out


def test_transformers_model_from_config_then_pretrained_with_a_new_head(tmp_path):
    data3 = colour_folder(tmp_path / "three", {"train": 4, "test": 2})
    first, _ = run(tmp_path, data3, *TINY_VIT, "--max_steps", "2", name="first")
    config = json.loads((first / "config.json").read_text())
    assert config["model_type"] == "vit" and config["id2label"] == {"0": "blue", "1": "green", "2": "red"}
    assert config["image_size"] == 16
    # Two classes now: the head is re-initialised for them, the backbone comes from `first` (lr 0: unchanged).
    data2 = colour_folder(tmp_path / "two", {"train": 4, "test": 2}, classes=("warm", "cold"))
    second, _ = run(tmp_path, data2, "--model_name_or_path", str(first), "--max_steps", "1",
                    "--learning_rate", "0", name="second")
    before, after = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert after["classifier.weight"].shape[0] == 2 and before["classifier.weight"].shape[0] == 3
    backbone = [k for k in before if not k.startswith("classifier")]
    assert backbone and all(torch.equal(before[k], after[k]) for k in backbone)
    assert json.loads((second / "config.json").read_text())["id2label"] == {"0": "cold", "1": "warm"}


def test_unknown_model_type_and_bad_overrides_are_user_errors(tmp_path):
    data = colour_folder(tmp_path / "data", {"train": 3, "test": 1})
    with pytest.raises(ModelError, match="--model_type not_a_model: unknown"):
        run(tmp_path, data, "--model_type", "not_a_model", name="a")
    with pytest.raises(ConfigError, match="no field 'hiden_size'"):
        run(tmp_path, data, "--model_type", "vit", "--config_overrides", "hiden_size=8", name="b")


@pytest.mark.slow
def test_one_and_two_processes_give_the_same_evaluation(tmp_path):
    """9 validation and 27 test images, eval batch 4 per process: the last batches are padded with duplicates,
    which must be dropped. lr 0 and a model without batch norm keep the seeded initial weights on 1 and 2
    processes, so every metric must agree. 1 process: `main(argv)` here; 2: the real launcher."""
    data = colour_folder(tmp_path / "data", {"train": 4, "validation": 3})
    for i, name in enumerate(("blue", "green", "red")):
        colour_folder(data, {"test": 8 + i}, classes=(name,), seed=i + 1)
    common = [str(x) for x in ("--data_dir", data, *TINY_VIT, "--learning_rate", 0, "--max_steps", 2,
                               "--per_device_train_batch_size", 2, "--per_device_eval_batch_size", 4, *QUIET)]
    reset_accelerate()
    recipe.main([*common, "--output_dir", str(tmp_path / "one")])
    launch(RECIPE, [*common, "--output_dir", str(tmp_path / "two"), "--expected_world_size", "2"], 2)
    one, two = (json.loads((tmp_path / d / "all_results.json").read_text()) for d in ("one", "two"))
    assert (one["eval_samples"], one["test_samples"]) == (two["eval_samples"], two["test_samples"]) == (9, 27)
    compared = [k for k in one if k.startswith(("eval_", "test_")) and "loss" not in k]
    assert len(compared) == 2 * 6  # samples, accuracy, top-5 and 3 classes, for validation and test
    for key in compared:
        assert one[key] == two[key], key
    for key in ("eval_loss", "test_loss"):
        assert one[key] == pytest.approx(two[key], abs=1e-5)


# ----------------------------------------------------------------------------------------- loading data


def test_corrupt_and_non_image_files_are_skipped_counted_and_reported(tmp_path):
    data = colour_folder(tmp_path / "data", {"train": 3, "test": 2})
    (data / "train" / "red" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    png = (data / "train" / "red" / "000.png").read_bytes()
    (data / "train" / "green" / "truncated.png").write_bytes(png[: len(png) // 2])
    (data / "test" / "blue" / "notes.txt").write_text("labels were checked by hand")
    (data / "train" / "blue" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")  # hidden files are not data
    loaded = load_image_folder(data)
    assert [len(loaded.splits[s]) for s in ("train", "test")] == [9, 6]
    [note] = loaded.notes
    assert note.startswith("skipped 3 file(s)")
    for name in ("train/red/broken.jpg", "train/green/truncated.png", "test/blue/notes.txt"):
        assert name in note


def test_grayscale_rgba_palette_and_other_modes_become_rgb(tmp_path):
    data = colour_folder(tmp_path / "data", {"train": 2})
    base = Image.open(data / "train" / "red" / "000.png")
    for mode in ("L", "LA", "RGBA", "P", "CMYK", "I"):
        suffix = {"CMYK": "jpg", "I": "tif"}.get(mode, "png")
        base.convert(mode).save(data / "train" / "red" / f"mode_{mode}.{suffix}")
    Image.new("RGB", (24, 20), (9, 9, 9)).save(data / "train" / "green" / "wide.png")  # another size, too
    loaded = load_image_folder(data)
    assert "converted to RGB: 1 CMYK image(s), 1 I image(s), 1 L image(s), 1 LA image(s), 1 P image(s), " \
           "1 RGBA image(s)" in loaded.notes
    assert loaded.image_size == 16  # the most common size
    items = [ImageDataset(loaded.splits["train"], 16)[i] for i in range(len(loaded.splits["train"]))]
    assert {tuple(x["pixel_values"].shape) for x in items} == {(3, 16, 16)}
    assert {x["pixel_values"].dtype for x in items} == {torch.uint8}
    grey = next(x for i, x in enumerate(items) if loaded.splits["train"].images[i].name == "mode_L.png")
    assert torch.equal(grey["pixel_values"][0], grey["pixel_values"][1])  # grey: equal channels


def test_empty_class_folder_is_a_clear_error(tmp_path):
    data = colour_folder(tmp_path / "data", {"train": 2, "test": 1})
    (data / "train" / "purple").mkdir()
    (data / "test" / "purple").mkdir()
    with pytest.raises(DataError, match=r"train/purple has no readable images \(no files\)"):
        run(tmp_path, data)
    (data / "train" / "purple" / "bad.jpg").write_bytes(b"nope")
    with pytest.raises(DataError, match=r"train/purple has no readable images \(1 unreadable file"):
        load_image_folder(data)


def test_test_classes_that_differ_from_train_are_a_clear_error(tmp_path):
    data = colour_folder(tmp_path / "data", {"train": 2})
    colour_folder(data, {"test": 1}, classes=("red", "green", "yellow"))
    with pytest.raises(DataError, match=r"missing: \['blue'\], not in train: \['yellow'\]"):
        run(tmp_path, data)
    with pytest.raises(DataError, match="no such directory"):
        run(tmp_path, tmp_path / "nowhere", name="b")


def test_validation_split_is_stratified_and_seeded(tmp_path):
    data = colour_folder(tmp_path / "data", {"train": 10})
    args = ImageDataArguments(data_dir=str(data), validation_split_percentage=20)
    a, b, c = load_image_data(args, seed=1), load_image_data(args, seed=1), load_image_data(args, seed=2)
    assert np.bincount(a.splits["validation"].labels).tolist() == [2, 2, 2]
    assert np.bincount(a.splits["train"].labels).tolist() == [8, 8, 8]
    assert list(a.splits["validation"].images) == list(b.splits["validation"].images)
    assert list(a.splits["validation"].images) != list(c.splits["validation"].images)
    assert not set(a.splits["validation"].images) & set(a.splits["train"].images)
    assert a.eval_split == "validation"
    with pytest.raises(DataError, match="validation_split_percentage"):
        load_image_data(ImageDataArguments(data_dir=str(data), validation_split_percentage=5), seed=1)


def test_dataset_name_reads_a_local_datasets_folder(tmp_path):
    import datasets

    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=["cat", "dog"])})
    for split, n in (("train", 6), ("test", 2)):
        rows = {"img": [Image.new("L", (12, 10), 40 * i) for i in range(n)], "label": [i % 2 for i in range(n)]}
        (tmp_path / "hub" / "data").mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_dict(rows, features=features).to_parquet(tmp_path / "hub" / "data" / f"{split}-0.parquet")
    data = load_image_data(ImageDataArguments(dataset_name=str(tmp_path / "hub")), seed=0)
    assert data.class_names == ["cat", "dog"] and data.image_size == 10
    assert {k: len(v) for k, v in data.splits.items()} == {"train": 6, "test": 2}
    item = ImageDataset(data.splits["train"], 10)[3]
    assert item["pixel_values"].shape == (3, 10, 10) and item["labels"] == 1
    with pytest.raises(DataError, match="--label_column_name nope: no such column"):
        load_image_data(ImageDataArguments(dataset_name=str(tmp_path / "hub"), label_column_name="nope"), seed=0)


def test_embedded_digits_and_the_cifar_subset_load(tmp_path):
    digits = load_digits()
    assert digits.image_size == 28 and digits.class_names == [str(d) for d in range(10)]
    assert np.bincount(digits.splits["test"].labels).tolist() == [100] * 10
    assert len(digits.splits["train"]) == 4000
    cifar = SHARED_DATA / "cifar10-subset"
    if not cifar.is_dir():
        pytest.skip(f"{cifar} is not here")
    data = load_image_folder(cifar)
    assert (len(data.splits["train"]), len(data.splits["test"]), data.image_size) == (5000, 1000, 32)
    assert data.notes == () and len(data.class_names) == 10


def test_shipped_cifar_config_parses():
    path = RECIPES / "configs" / "image_classification_cifar10.yaml"
    config, data, aug, model = parse_config(recipe.CONFIG_TYPES, ["--config", str(path)], defaults=recipe.DEFAULTS)
    assert data.data_dir == "../shared/data/cifar10-subset" and (ROOT / data.data_dir).resolve() == (
        SHARED_DATA / "cifar10-subset").resolve()
    assert config.lr_scheduler_type == "cosine" and model.model_type == "small_resnet"


# ---------------------------------------------------------------------------------------- augmentation


def test_augmentation_is_reproducible_under_a_seed():
    images = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    augment = TrainAugmentation(16, [0.5] * 3, [0.25] * 3, crop_scale=(0.3, 1.0), color_jitter=0.3)

    def draw(seed):
        torch.manual_seed(seed)
        return augment(images)

    first = draw(0)
    assert first.dtype == torch.float32 and first.shape == (8, 3, 16, 16)
    assert torch.equal(first, draw(0)) and not torch.equal(first, draw(1))
    assert not torch.allclose(first, (images.float() / 255 - 0.5) / 0.25)  # it did change the images


def test_mixup_and_cutmix_targets_match_the_mixed_pixels():
    images = torch.stack([torch.full((3, 8, 8), float(i)) for i in range(4)])
    labels = torch.tensor([0, 1, 2, 0])
    for mixing in (MixupCutmix(3, mixup_alpha=0.5), MixupCutmix(3, cutmix_alpha=1.0)):
        torch.manual_seed(3)
        mixed, targets = mixing(images, labels)
        torch.manual_seed(3)
        again, _ = mixing(images, labels)
        assert torch.equal(mixed, again)
        assert torch.allclose(targets.sum(1), torch.ones(4))
        # sample 1 (value 1) is mixed with sample 2 (value 2): its mean pixel gives the weight of its own label
        own = 2 - mixed[1].mean()
        assert targets[1, 1].item() == pytest.approx(own.item(), abs=1e-6)
    assert MixupCutmix(3)(images, labels)[1] is labels  # off: labels pass through for plain cross-entropy
