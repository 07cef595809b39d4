"""Semantic segmentation: IoU against hand-computed values, pixels summed over images (not batch
means), the losses, mask-aware augmentation, image + mask folders (and their bad inputs), the recipe end to
end, and 1 vs 2 processes: the recipe's one real `accelerate launch` (2 processes) trains; its model is evaluated
in this process and on the session's 2 spawned gloo ranks (conftest's `ranks`).
"""

import json
import math
from pathlib import Path

import dense_eval
import numpy as np
import pytest
import semantic_segmentation as recipe
import torch
from conftest import RECIPES, launch, reset_accelerate
from PIL import Image

from accel_train import ConfigError, DataError
from accel_train.tasks.vision.dense.annotated import IGNORE_MASK_VALUE, load_mask_pairs
from accel_train.tasks.vision.dense.augment import BoxMaskAugmentation
from accel_train.tasks.vision.dense.canvases import DenseCollator, DenseDataArguments, load_canvases
from accel_train.tasks.vision.dense.segmentation import (
    SegmentationLoss,
    SegmentationMetrics,
    UNet,
    confusion_per_image,
    segmentation_losses,
)

RECIPE = RECIPES / "semantic_segmentation.py"
QUIET = ["--report_to", "none", "--disable_tqdm", "--save_strategy", "no"]
TINY = ["--config_overrides", '{"widths": [8, 16, 16], "blocks_per_stage": 1}']

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


def metrics_of(pairs, names=("bg", "one")):
    """SegmentationMetrics over images given as (true mask, predicted mask) pairs."""
    rows = [confusion_per_image(torch.tensor(p)[None], torch.tensor(t)[None], len(names)) for t, p in pairs]
    return SegmentationMetrics(list(names))({"confusion": torch.cat(rows)})


# ------------------------------------------------------------------------------------------------ metrics


def test_iou_of_a_mask_with_a_known_intersection():
    # class 1 is columns 0-3 in truth and 2-5 in the prediction: intersection 2 columns, union 6 -> IoU 1/3;
    # background likewise (truth 4-7, predicted 0-1 and 6-7): 1/3. Half the pixels are right.
    truth = np.zeros((8, 8), dtype=np.int64)
    truth[:, :4] = 1
    predicted = np.zeros((8, 8), dtype=np.int64)
    predicted[:, 2:6] = 1
    m = metrics_of([(truth, predicted)])
    assert m["iou_one"] == pytest.approx(1 / 3) and m["iou_bg"] == pytest.approx(1 / 3)
    assert m["miou"] == pytest.approx(1 / 3) and m["pixel_accuracy"] == 0.5


def test_miou_sums_pixels_over_all_images_before_dividing():
    # Image a: 16 pixels of class 1, all found. Image b: 1 pixel of class 1 among 15 of background, missed.
    # Summed: class 1 has TP 16, FN 1 -> 16/17; background TP 15, FP 1 -> 15/16. Per-image means would give
    # (1 + (15/16 + 0) / 2) / 2 instead.
    a = np.ones((4, 4), dtype=np.int64)
    b = np.zeros((4, 4), dtype=np.int64)
    b[0, 0] = 1
    m = metrics_of([(a, a.copy()), (b, np.zeros_like(b))])
    assert m["miou"] == pytest.approx((16 / 17 + 15 / 16) / 2)
    assert m["miou"] != pytest.approx((1 + (15 / 16) / 2) / 2)


def test_ignored_pixels_and_absent_classes_do_not_count():
    truth = np.array([[0, 1], [255, 255]])
    predicted = np.array([[0, 1], [1, 2]])
    m = metrics_of([(truth, predicted)], names=("bg", "one", "two"))
    assert m["miou"] == 1.0 and m["pixel_accuracy"] == 1.0  # the two ignored pixels are not counted at all
    assert math.isnan(m["iou_two"])  # neither present nor predicted (where counted)


def test_losses_are_near_zero_for_a_confident_right_answer_and_log_c_for_a_uniform_one():
    mask = torch.tensor([[[0, 1], [2, 255]]])
    right = torch.nn.functional.one_hot(mask.clamp(max=2), 3).permute(0, 3, 1, 2).float() * 50
    parts = segmentation_losses(right, mask)
    assert parts["ce"].item() == pytest.approx(0, abs=1e-6) and parts["dice"].item() == pytest.approx(0, abs=1e-3)
    parts = segmentation_losses(torch.zeros(1, 3, 2, 2), mask)
    assert parts["ce"].item() == pytest.approx(math.log(3))


# ------------------------------------------------------------------------------------------ augmentation


def test_augmentation_moves_masks_with_the_pixels():
    data = load_canvases(DenseDataArguments(num_train_canvases=32, num_test_canvases=1))
    batch = DenseCollator(data.max_objects)(data.splits["train"].__getitems__(list(range(32))))
    augment = BoxMaskAugmentation([0.0] * 3, [1.0] * 3, scale=(0.7, 1.3), translate=0.2, degrees=20)
    torch.manual_seed(0)
    images, _, _, mask = augment(batch["pixel_values"], mask=batch["mask"])
    assert not torch.equal(mask, batch["mask"])
    # class ids stay class ids; what the map brought in from outside the image is ignored
    assert set(mask.unique().tolist()) <= set(batch["mask"].unique().tolist()) | {IGNORE_MASK_VALUE}
    stroke = images[:, 0] >= 0.5  # moved pixels (mean 0, std 1: the stroke threshold is 128/255)
    inside = mask != IGNORE_MASK_VALUE
    agree = (stroke == (mask > 0))[inside].float().mean().item()
    assert agree > 0.98, agree  # the edges differ a little: bilinear pixels, nearest-neighbour masks


def test_pixels_the_augmentation_brings_in_from_outside_the_image_are_ignored_not_class_0():
    """The warp fills what it brings in from outside the frame with 0: the masks called it class 0 (a user's
    classes.txt whose class 0 is sky trained on borders as sky; the canvases' class 0 is the background, which hid
    it). Those pixels are ignored now (IGNORE_MASK_VALUE, left out of the loss and the metrics); a pixel ignored
    before stays ignored."""
    mask = torch.ones(4, 32, 32, dtype=torch.long)  # class 1 everywhere: no class 0 in the data
    mask[:, 14:18, 14:18] = IGNORE_MASK_VALUE
    images = torch.full((4, 3, 32, 32), 200, dtype=torch.uint8)
    torch.manual_seed(0)
    _, _, _, moved = BoxMaskAugmentation([0.0] * 3, [1.0] * 3, scale=(0.5, 0.5), translate=0.0)(images, mask=mask)
    assert not (moved == 0).any()
    assert (moved == IGNORE_MASK_VALUE).float().mean() > 0.5  # a zoom out to half: three quarters are borders
    assert (moved[:, 15:17, 15:17] == IGNORE_MASK_VALUE).all()  # the centre stays where it was, ignored


# ---------------------------------------------------------------------------------- image + mask folders


def mask_folder(root, split="train", count=3, size=(12, 10), mask_size=None, classes=2):
    rng = np.random.default_rng(0)
    for i in range(count):
        (root / split / "images").mkdir(parents=True, exist_ok=True)
        (root / split / "masks").mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 255, (*size[::-1], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / split / "images" / f"{i}.jpg")
        values = rng.integers(0, classes, (mask_size or size)[::-1], dtype=np.uint8)
        Image.fromarray(values).save(root / split / "masks" / f"{i}.png")
    return root


def test_mask_pairs_load_resize_and_name_their_classes(tmp_path):
    root = mask_folder(tmp_path, "train", count=4, classes=3)
    mask_folder(tmp_path, "test", count=2, classes=3)
    (root / "classes.txt").write_text("sky\nroad\ncar\n")
    data = load_mask_pairs(root, 16, validation_percent=10, seed=0)
    assert data.mask_class_names == ["sky", "road", "car"] and {k: len(v) for k, v in data.splits.items()} == \
        {"train": 4, "test": 2}
    item = data.splits["train"][0]
    assert item["pixel_values"].shape == (3, 16, 16) and item["mask"].shape == (16, 16)
    original = np.array(Image.open(root / "train" / "masks" / "0.png"))
    assert set(np.unique(item["mask"])) <= set(np.unique(original))  # nearest-neighbour: no blended ids


@pytest.mark.parametrize("problem, message", [
    ("size", r"mask .*0.png is 7x5 but its image .*0.jpg is 12x10; a mask must have its image's size"),
    ("missing", r"1.jpg has no mask: expected .*masks/1.png"),
    ("rgb", r"mask .*2.png is a RGB image; masks are single-channel"),
    ("names", r"a mask holds class id 2 but .*classes.txt names 2 classes"),
])
def test_bad_masks_are_clear_data_errors(tmp_path, problem, message):
    root = mask_folder(tmp_path, classes=3)
    if problem == "size":
        Image.fromarray(np.zeros((5, 7), dtype=np.uint8)).save(root / "train" / "masks" / "0.png")
    elif problem == "missing":
        (root / "train" / "masks" / "1.png").unlink()
    elif problem == "rgb":
        Image.new("RGB", (12, 10)).save(root / "train" / "masks" / "2.png")
    else:
        (root / "classes.txt").write_text("a\nb\n")
    with pytest.raises(DataError, match=message):
        load_mask_pairs(root, 16, 10, seed=0)


def test_a_folder_without_train_images_is_a_data_error(tmp_path):
    mask_folder(tmp_path, "test")
    with pytest.raises(DataError, match="no train/images/"):
        load_mask_pairs(tmp_path, 16, 10, seed=0)


# -------------------------------------------------------------------------------------------- the recipe


def test_recipe_trains_on_canvases_and_writes_miou_and_pictures(tmp_path):
    out = tmp_path / "run"
    metrics = recipe.main(["--output_dir", str(out), *QUIET, *TINY, "--num_train_canvases", "48",
                           "--num_test_canvases", "10", "--max_steps", "3", "--per_device_train_batch_size", "16",
                           "--per_device_eval_batch_size", "4"])
    results = json.loads((out / "all_results.json").read_text())
    assert results == pytest.approx(metrics, nan_ok=True) and results["eval_samples"] == 10
    assert {"eval_miou", "eval_pixel_accuracy", "eval_iou_background", "eval_iou_9"} <= set(results)
    assert 0 < results["eval_miou"] <= 1
    assert (out / "report" / "segmentation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_recipe_reads_image_and_mask_folders_and_holds_out_validation(tmp_path):
    root = mask_folder(tmp_path / "data", count=10, classes=3)
    metrics = recipe.main(["--data_dir", str(root), "--canvas_size", "32", "--output_dir", str(tmp_path / "run"),
                           *QUIET, *TINY, "--max_steps", "2", "--per_device_train_batch_size", "4",
                           "--validation_split_percentage", "20"])
    assert metrics["eval_samples"] == 2 and {"eval_iou_0", "eval_iou_1", "eval_iou_2"} <= set(metrics)


def test_label_smoothing_smooths_the_training_cross_entropy_and_not_the_evaluation(tmp_path):
    """--label_smoothing_factor reaches the pixel cross-entropy in training; evaluation (eval_loss, the best model)
    measures the plain one. Before, the flag was silently ignored: the same train_loss with and without it."""
    logits, mask = torch.randn(2, 3, 4, 5), torch.randint(0, 3, (2, 4, 5))
    mask[0, 0] = IGNORE_MASK_VALUE
    ce = torch.nn.functional.cross_entropy(logits, mask.clamp_max(2), label_smoothing=0.2, reduction="none")
    valid = mask != IGNORE_MASK_VALUE
    expected = (ce * valid).flatten(1).sum(1) / valid.flatten(1).sum(1)
    assert torch.allclose(segmentation_losses(logits, mask, label_smoothing=0.2)["ce"], expected, atol=1e-6)
    runs = {}
    for factor in ("0", "0.2"):
        reset_accelerate()
        runs[factor] = recipe.main(["--output_dir", str(tmp_path / factor), *QUIET, *TINY, "--num_train_canvases",
                                    "16", "--num_test_canvases", "4", "--max_steps", "1", "--learning_rate", "0",
                                    "--per_device_train_batch_size", "8", "--label_smoothing_factor", factor])
    assert abs(runs["0.2"]["train_loss"] - runs["0"]["train_loss"]) > 1e-3
    assert runs["0.2"]["eval_loss"] == runs["0"]["eval_loss"]


def test_a_metric_the_recipe_never_reports_is_refused_before_training(tmp_path):
    """--metric_for_best_model mIoU (the metric is miou): the metrics named nothing, so the first evaluation stopped
    the run. SegmentationMetrics lists what it returns (iou_<class> by the class names): refused before a step."""
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"--metric_for_best_model mIoU: .* report only .*eval_miou, "
                                          r"eval_pixel_accuracy, eval_iou_background"):
        recipe.main(["--output_dir", str(out), *QUIET, *TINY, "--num_train_canvases", "16", "--num_test_canvases",
                     "4", "--max_steps", "1", "--metric_for_best_model", "mIoU"])
    assert not (out / "metrics.jsonl").exists()
    names = SegmentationMetrics(["background", "a"]).metric_names
    assert set(SegmentationMetrics(["background", "a"])({"confusion": torch.tensor([[3, 1, 0, 2]])})) == set(names)


def test_unet_keeps_the_input_size_for_any_stem():
    for stem in (1, 2):
        logits = UNet(5, (8, 16), 1, stem)(torch.zeros(2, 3, 40, 40))
        assert logits.shape == (2, 5, 40, 40)


# ------------------------------------------------------------------------------------- 1 vs 2 processes


class _TinySegmenter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 2, 3, padding=1)

    def forward(self, pixel_values):
        return self.conv(pixel_values)


def plot_a_sharded_model_on_rank(out: str) -> None:
    """On each of 2 gloo ranks: the prediction-plot hook at the end of training, for a model that FSDP2's fully_shard
    turned into a sharded module (as Accelerate does to the module a recipe passes to train())."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from accel_train.tasks.vision.dense.prediction_plots import PredictionPlot, draw_segmentation_batch
    from accel_train.tasks.vision.transforms import EvalTransform

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = fully_shard(_TinySegmenter())
    items = [{"pixel_values": torch.full((3, 8, 8), 40 * i, dtype=torch.uint8),
              "mask": torch.zeros(8, 8, dtype=torch.long)} for i in range(3)]
    loss = SegmentationLoss(torch.nn.Identity(), EvalTransform([0.5] * 3, [0.25] * 3), 2)

    def draw(path, batch, predictions):
        (Path(out) / f"drawn_on_rank{dist.get_rank()}").write_text("")
        return draw_segmentation_batch(path, batch, predictions, class_names=["background", "thing"])

    plot = PredictionPlot(model, items, lambda rows: {k: torch.stack([r[k] for r in rows]) for k in rows[0]},
                          loss.predict, draw, Path(out) / "segmentation.png", dist.get_rank() == 0)
    plot.on_train_end(None, {})
    dist.barrier()  # both ranks got here: none is left waiting in the other's all-gather


def test_the_prediction_plot_of_a_sharded_model_runs_its_forward_on_every_rank(tmp_path, ranks):
    """FSDP2 (or ZeRO-3): the sharded model's forward is a collective. The hook ran it on the main process only, which
    waited in an all-gather that rank 1, gone on, never joined: a hang until the timeout (failed before). Every rank
    now runs the forward; only the main process draws."""
    ranks.run(plot_a_sharded_model_on_rank, str(tmp_path), timeout=90)
    assert (tmp_path / "segmentation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.glob("drawn_on_rank*")) == ["drawn_on_rank0"]


@pytest.mark.slow
def test_one_and_two_processes_give_the_same_miou(tmp_path, ranks):
    """Train briefly on two processes (the recipe's real launch), then evaluate the saved model on 1 process (here)
    and 2 (the session's spawned ranks): 30 test canvases in batches of 4 per process leave a last batch that 2
    processes pad with duplicates, which must be dropped. The 2-process training run's own final evaluation (in
    batches of 30) must agree as well."""
    data = ["--num_train_canvases", "512", "--num_test_canvases", "30"]
    small = ["--config_overrides", '{"widths": [8, 16, 32], "blocks_per_stage": 1}']
    launch(RECIPE, [*data, "--output_dir", str(tmp_path / "trained"), *QUIET, *small, "--num_train_epochs", "6",
                    "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "30",
                    "--expected_world_size", "2"], 2)
    common = ["--task", "segmentation", "--weights", str(tmp_path / "trained" / "model.safetensors"), *data, *small,
              "--per_device_eval_batch_size", "4"]
    reset_accelerate()
    dense_eval.main([*common, "--output_dir", str(tmp_path / "one")])
    ranks.run(dense_eval.main, [*common, "--output_dir", str(tmp_path / "two"), "--expected_world_size", "2"])
    one, two = (json.loads((tmp_path / d / "eval.json").read_text()) for d in ("one", "two"))
    trained = json.loads((tmp_path / "trained" / "all_results.json").read_text())
    assert one["eval_samples"] == two["eval_samples"] == 30
    # a model that finds strokes and tells some digits apart, so the summed confusion matrix is not trivial
    assert one["eval_iou_background"] > 0.9 and max(one[f"eval_iou_{d}"] for d in range(10)) > 0.1
    assert one["eval_miou"] == pytest.approx(trained["eval_miou"], abs=1e-12)
    for key in one:
        if key.startswith("eval_") and key != "eval_loss":
            assert one[key] == pytest.approx(two[key], abs=1e-12, nan_ok=True), key
    assert one["eval_loss"] == pytest.approx(two["eval_loss"], abs=1e-5)
