"""Object detection: the generated canvases, box maths and COCO mAP against hand-computed values,
box-aware augmentation, a user's COCO JSON (and its bad inputs), the recipe end to end, and 1 vs 2 processes.

Fast tests use tiny canvases and tiny models. 1 vs 2 processes: the recipe's one real `accelerate launch` (2 processes)
trains; its model is evaluated in this process and on the session's 2 spawned gloo ranks (conftest's `ranks`).
"""

import json
import math
from dataclasses import replace

import dense_eval
import numpy as np
import object_detection as recipe
import pytest
import torch
from conftest import RECIPES, launch, reset_accelerate
from PIL import Image

from accel_train import ConfigError, DataError
from accel_train.tasks.vision.data import ImageSplit, load_digits
from accel_train.tasks.vision.dense import canvases
from accel_train.tasks.vision.dense.annotated import IGNORE_MASK_VALUE, load_coco_detection
from accel_train.tasks.vision.dense.augment import BoxMaskAugmentation
from accel_train.tasks.vision.dense.canvases import STROKE_THRESHOLD, DenseCollator, DenseDataArguments, load_canvases
from accel_train.tasks.vision.dense.detection import (
    CenterNet,
    DetectionLoss,
    DetectionMetrics,
    batched_nms,
    box_iou,
    center_targets,
    coco_metrics,
    decode_detections,
    generalized_box_iou,
)
from accel_train.tasks.vision.transforms import EvalTransform

RECIPE = RECIPES / "object_detection.py"
QUIET = ["--report_to", "none", "--disable_tqdm", "--save_strategy", "no"]
TINY = ["--config_overrides", '{"widths": [8, 16, 16], "blocks_per_stage": 1, "head_width": 8}']

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


@pytest.fixture(scope="module")
def digits():
    return load_digits()


# ------------------------------------------------------------------------------------------- the canvases


def test_canvases_have_exact_boxes_masks_and_never_mix_splits(digits):
    data = load_canvases(DenseDataArguments(num_train_canvases=40, num_test_canvases=20, max_digits=4))
    assert {k: len(v) for k, v in data.splits.items()} == {"train": 40, "test": 20}
    assert data.class_names == [str(d) for d in range(10)] and data.mask_class_names[0] == "background"
    assert data.max_objects == 4
    for item in data.splits["train"]:
        boxes, classes, mask = np.asarray(item["boxes"]).reshape(-1, 4), item["classes"], item["mask"]
        assert 1 <= len(classes) <= 4
        for (x0, y0, x1, y1), cls in zip(boxes.astype(int), classes, strict=True):
            inside = mask[y0:y1, x0:x1]
            ys, xs = np.nonzero(inside == cls + 1)
            # the box is the tight box of this digit's stroke pixels, which carry its class in the mask
            assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == (0, 0, x1 - x0, y1 - y0)
            assert (item["pixel_values"][0][y0:y1, x0:x1][inside > 0] >= STROKE_THRESHOLD).all()
        assert (mask > 0).sum() == sum(((mask == c + 1) & _in_boxes(boxes, mask.shape)).sum() for c in set(classes))
    again = load_canvases(DenseDataArguments(num_train_canvases=40, num_test_canvases=20))
    assert np.array_equal(again.splits["test"]["pixel_values"], data.splits["test"]["pixel_values"])  # seeded


def test_train_canvases_use_train_digits_and_test_canvases_test_digits(digits, monkeypatch):
    # Relabel every train digit "1" and every test digit "2": the classes on a canvas show where its digits came from.
    fake = {name: ImageSplit(split.images, {"labels": [1 if name == "train" else 2] * len(split)})
            for name, split in digits.splits.items()}
    monkeypatch.setattr(canvases, "load_digits", lambda: replace(digits, splits=fake))
    data = load_canvases(DenseDataArguments(num_train_canvases=30, num_test_canvases=30))
    assert {c for row in data.splits["train"]["classes"] for c in row} == {1}
    assert {c for row in data.splits["test"]["classes"] for c in row} == {2}


def _in_boxes(boxes, shape):
    inside = np.zeros(shape, dtype=bool)
    for x0, y0, x1, y1 in boxes.astype(int):
        inside[y0:y1, x0:x1] = True
    return inside


def test_canvas_flags_are_checked():
    with pytest.raises(ConfigError, match="does not fit a 32 px canvas"):
        DenseDataArguments(canvas_size=32, digit_scale_max=1.5)
    with pytest.raises(ConfigError, match="--num_test_canvases 0"):
        DenseDataArguments(num_test_canvases=0)


# -------------------------------------------------------------------------------------------- box maths


def test_iou_and_giou_by_hand():
    a = torch.tensor([0.0, 0, 10, 10])
    assert box_iou(a, torch.tensor([5.0, 0, 15, 10])).item() == pytest.approx(50 / 150)
    assert generalized_box_iou(a, torch.tensor([5.0, 0, 15, 10])).item() == pytest.approx(50 / 150)
    # disjoint: IoU 0, enclosing box 300 of which the union covers 200
    assert generalized_box_iou(a, torch.tensor([20.0, 0, 30, 10])).item() == pytest.approx(-100 / 300)


def test_nms_drops_overlapping_boxes_of_the_same_class_only():
    boxes = torch.tensor([[[0.0, 0, 10, 10], [1, 0, 11, 10], [1, 0, 11, 10], [30, 30, 40, 40]]])
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6]])
    classes = torch.tensor([[0, 0, 1, 0]])
    keep = batched_nms(boxes, scores, classes, iou_threshold=0.5)
    assert keep.tolist() == [[True, False, True, True]]  # box 1 (class 0) overlaps box 0 by IoU 0.82


def test_decoding_perfect_outputs_gives_back_the_true_boxes():
    boxes = torch.tensor([[[4.0, 6, 20, 30], [40, 8, 47, 26], [0, 0, 0, 0]]])
    classes = torch.tensor([[3, 7, -1]])
    heatmap, target, _ = center_targets(boxes, classes, 10, (16, 16), stride=4)
    xs = (torch.arange(16) + 0.5) * 4
    distances = torch.stack([xs - target[..., 0], xs[:, None] - target[..., 1], target[..., 2] - xs,
                             target[..., 3] - xs[:, None]], dim=1)
    outputs = {"heatmap": torch.logit(heatmap.clamp(1e-4, 1 - 1e-4)), "box": distances}
    det = decode_detections(outputs, (64, 64), max_detections=5)
    found = det["det_classes"][0] >= 0
    assert det["det_classes"][0][found].tolist() == [3, 7] or det["det_classes"][0][found].tolist() == [7, 3]
    order = det["det_classes"][0][found].argsort()
    assert torch.allclose(det["det_boxes"][0][found][order], boxes[0, :2])
    assert det["det_boxes"].shape == (1, 5, 4) and (det["det_classes"][0][~found] == -1).all()


# ---------------------------------------------------------------------------------------------- COCO mAP


def _pad(rows, width):
    """Per-image lists of (box, class[, score]) -> padded arrays with class -1, as the loss function returns."""
    boxes = np.zeros((len(rows), width, 4))
    classes = np.full((len(rows), width), -1)
    scores = np.zeros((len(rows), width))
    for i, row in enumerate(rows):
        for k, entry in enumerate(row):
            boxes[i, k], classes[i, k] = entry[0], entry[1]
            scores[i, k] = entry[2] if len(entry) > 2 else 0
    return boxes, classes, scores


def test_map_of_a_box_off_by_a_known_iou():
    # a 20x20 box found 4 px to the right: IoU = 16*20 / (2*400 - 320) = 2/3, so it counts at the IoU thresholds
    # .50, .55, .60, .65 and misses at .70 ... .95: AP 1 at 4 of the 10 thresholds.
    gt_boxes, gt_classes, _ = _pad([[([10, 10, 30, 30], 0)]], 2)
    det_boxes, det_classes, det_scores = _pad([[([14, 10, 34, 30], 0, 0.9)]], 3)
    m = coco_metrics(gt_boxes, gt_classes, det_boxes, det_scores, det_classes, ["a", "b"], (64, 64))
    assert m["map"] == pytest.approx(0.4) and m["map_50"] == pytest.approx(1.0) and m["map_75"] == 0.0
    assert m["ap_a"] == pytest.approx(0.4) and math.isnan(m["ap_b"])  # b: no true box, no AP


def test_map_with_a_false_positive_ranked_between_two_hits():
    # Ranked detections: hit (0.9), false positive (0.8), hit (0.7) -> precision 1 up to recall 0.5, then 2/3.
    # COCO interpolates precision at 101 recall points: 51 points (0 .. 0.50) at 1, 50 points at 2/3.
    gt_boxes, gt_classes, _ = _pad([[([0, 0, 10, 10], 0)], [([20, 20, 40, 40], 0)]], 1)
    det_boxes, det_classes, det_scores = _pad(
        [[([0, 0, 10, 10], 0, 0.9), ([40, 40, 50, 50], 0, 0.8)], [([20, 20, 40, 40], 0, 0.7)]], 2)
    m = coco_metrics(gt_boxes, gt_classes, det_boxes, det_scores, det_classes, ["a"], (64, 64))
    expected = (51 * 1 + 50 * 2 / 3) / 101
    assert m["map"] == pytest.approx(expected) and m["map_50"] == pytest.approx(expected)
    assert m["mar_100"] == 1.0
    # a detection of the wrong class is a false positive of that class and a miss of the true one
    det_boxes, det_classes, det_scores = _pad([[([0, 0, 10, 10], 0, 0.9)], [([20, 20, 40, 40], 1, 0.9)]], 1)
    m = coco_metrics(gt_boxes, gt_classes, det_boxes, det_scores, det_classes, ["a", "b"], (64, 64))
    assert m["map_50"] == pytest.approx(51 / 101)  # class a: recall 0.5 at precision 1; b has no true box
    nothing = coco_metrics(gt_boxes, gt_classes, det_boxes, det_scores, np.full_like(det_classes, -1), ["a"], (64, 64))
    assert nothing["map"] == 0.0


# ------------------------------------------------------------------------------------------ augmentation


def test_augmentation_moves_boxes_with_the_digits():
    data = load_canvases(DenseDataArguments(num_train_canvases=48, num_test_canvases=1, max_digits=1))
    batch = DenseCollator(1)(data.splits["train"].__getitems__(list(range(48))))
    augment = BoxMaskAugmentation([0.0] * 3, [1.0] * 3, scale=(0.7, 1.3), translate=0.2)
    torch.manual_seed(0)
    images, boxes, classes, mask = augment(batch["pixel_values"], batch["boxes"], batch["classes"], batch["mask"])
    assert not torch.equal(boxes, batch["boxes"])  # they moved
    kept = 0
    for i in range(48):
        if classes[i, 0] < 0:  # pushed mostly off the canvas: dropped
            continue
        kept += 1
        digit = (mask[i] > 0) & (mask[i] != IGNORE_MASK_VALUE)  # out-of-frame pixels are ignored, not a class
        ys, xs = torch.nonzero(digit, as_tuple=True)
        tight = torch.tensor([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], dtype=torch.float)
        if ((boxes[i, 0] == 0) | (boxes[i, 0] == 64)).any():  # clipped at the border: the visible part is inside
            assert (tight[:2] >= boxes[i, 0, :2] - 1.5).all() and (tight[2:] <= boxes[i, 0, 2:] + 1.5).all()
        else:  # the box is still the tight box of the digit's strokes (masks move to the nearest pixel)
            assert torch.allclose(boxes[i, 0], tight, atol=1.5), (i, boxes[i, 0], tight)
        assert (mask[i][digit] == classes[i, 0] + 1).all()
        bright = images[i, 0] >= 0.6  # the moved pixels, standardised with mean 0 and std 1
        ys, xs = torch.nonzero(bright, as_tuple=True)
        assert xs.min() >= boxes[i, 0, 0] - 1.5 and xs.max() + 1 <= boxes[i, 0, 2] + 1.5
    assert kept >= 40


# ------------------------------------------------------------------------------------ a user's COCO JSON


def write_coco(root, images, annotations, categories=({"id": 1, "name": "cat"}, {"id": 5, "name": "dog"}),
               split="train", size=(40, 30)):
    (root / split).mkdir(parents=True, exist_ok=True)
    for entry in images:
        Image.new("RGB", size, (30, 30, 30)).save(root / split / entry["file_name"])
    doc = {"images": images, "annotations": annotations, "categories": list(categories)}
    (root / f"{split}.json").write_text(json.dumps(doc))
    return root


def image_entry(i, size=(40, 30)):
    return {"id": i, "file_name": f"{i}.png", "width": size[0], "height": size[1]}


def test_coco_json_loads_scales_boxes_and_maps_categories(tmp_path):
    root = write_coco(tmp_path, [image_entry(1), image_entry(2)],
                      [{"id": 1, "image_id": 1, "category_id": 5, "bbox": [4, 3, 20, 15]},
                       {"id": 2, "image_id": 1, "category_id": 1, "bbox": [0, 0, 40, 30]},
                       {"id": 3, "image_id": 2, "category_id": 1, "bbox": [1, 1, 2, 2], "iscrowd": 1}])
    data = load_coco_detection(root, 32, validation_percent=50, seed=0)
    assert data.class_names == ["cat", "dog"] and data.max_objects == 2
    assert sorted(data.splits) == ["train", "validation"] and "1 iscrowd annotation(s) kept" in data.notes[0]
    both = [data.splits[s][0] for s in ("train", "validation")]
    first = next(item for item in both if len(item["classes"]) == 2)
    assert first["pixel_values"].shape == (3, 32, 32)
    assert np.allclose(first["boxes"][0], [4 * 32 / 40, 3 * 32 / 30, 24 * 32 / 40, 18 * 32 / 30])
    assert list(first["classes"]) == [1, 0]  # category 5 (dog) is class 1, category 1 (cat) class 0


def test_crowd_regions_are_ignored_by_the_evaluation_as_pycocotools_does_and_not_learned(tmp_path):
    """A detection inside an iscrowd region is neither a hit nor a false positive for pycocotools; dropping the
    crowd annotation at load would count it as a false positive (mAP 0.5 here instead of 1.0)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    size = (32, 32)  # the canvas size: boxes are not rescaled, so the JSON's numbers are the evaluated ones
    real = {"id": 1, "image_id": 1, "category_id": 1, "bbox": [2, 2, 10, 10]}
    crowd = {"id": 2, "image_id": 1, "category_id": 1, "bbox": [14, 14, 16, 16], "iscrowd": 1}
    root = write_coco(tmp_path / "with", [image_entry(1, size)], [real, crowd], size=size)
    # best first: one inside the crowd region, then the true box found exactly
    detections = [([16.0, 16, 24, 24], 0, 0.95), ([2.0, 2, 12, 12], 0, 0.9)]

    truth = COCO()
    truth.dataset = json.loads((root / "train.json").read_text())
    for ann in truth.dataset["annotations"]:
        ann.update(area=ann["bbox"][2] * ann["bbox"][3], iscrowd=ann.get("iscrowd", 0))  # pycocotools needs both
    truth.createIndex()
    rows = np.array([[1, x0, y0, x1 - x0, y1 - y0, score, 1] for (x0, y0, x1, y1), _, score in detections])
    reference = COCOeval(truth, truth.loadRes(rows), "bbox")
    reference.evaluate()
    reference.accumulate()
    reference.summarize()
    assert reference.stats[0] == pytest.approx(1.0)  # the crowd detection is ignored

    data = load_coco_detection(root, 32, validation_percent=0, seed=0)
    batch = DenseCollator(data.max_objects)(data.splits["train"].__getitems__([0]))
    model = CenterNet(2, widths=[8, 16, 16], blocks_per_stage=1, head_width=8)
    augment = BoxMaskAugmentation([0.5] * 3, [0.25] * 3)
    loss_fn = DetectionLoss(augment, EvalTransform([0.5] * 3, [0.25] * 3), max_detections=5)
    with torch.no_grad():
        evaluated = loss_fn(model.eval(), batch)  # what the loop gathers from an evaluation batch
    det_boxes, det_classes, det_scores = _pad([detections], 5)
    gathered = {k: v for k, v in evaluated.items() if k.startswith("gt_")}
    gathered.update(det_boxes=torch.tensor(det_boxes), det_classes=torch.tensor(det_classes),
                    det_scores=torch.tensor(det_scores))
    metrics = DetectionMetrics(data.class_names, 32)(gathered)
    assert metrics["map"] == pytest.approx(reference.stats[0]) and metrics["map_50"] == pytest.approx(1.0)
    assert data.max_objects == 2 and "1 iscrowd annotation(s) kept" in data.notes[0]

    # training: the crowd box is no target; the loss is the loss of the image without it (same augmentation draw)
    plain = load_coco_detection(write_coco(tmp_path / "without", [image_entry(1, size)], [real], size=size), 32, 0, 0)
    losses = []
    for dataset, width in ((data, 2), (plain, 1)):
        torch.manual_seed(0)
        losses.append(loss_fn(model.train(), DenseCollator(width)(dataset.splits["train"].__getitems__([0])))["loss"])
    assert losses[0].item() == pytest.approx(losses[1].item(), abs=1e-6)


@pytest.mark.parametrize("annotations, message", [
    ([{"image_id": 1, "category_id": 1, "bbox": [30, 5, 20, 10]}], r"lies outside its 40x30 image"),
    ([{"image_id": 1, "category_id": 1, "bbox": [-3, 5, 10, 10]}], r"lies outside its 40x30 image"),
    ([], r"the annotation list is empty"),
    ([{"image_id": 1, "category_id": 9, "bbox": [1, 1, 5, 5]}], r"category_id 9 is not in the categories"),
    ([{"image_id": 7, "category_id": 1, "bbox": [1, 1, 5, 5]}], r"image_id 7 is not in the images list"),
    ([{"image_id": 1, "category_id": 1, "bbox": [1, 1, 0, 5]}], r"has no area"),
])
def test_bad_coco_annotations_are_clear_data_errors(tmp_path, annotations, message):
    root = write_coco(tmp_path, [image_entry(1)], annotations)
    with pytest.raises(DataError, match=message):
        load_coco_detection(root, 32, 10, seed=0)


def test_coco_files_that_do_not_match_their_images_are_data_errors(tmp_path):
    box = {"image_id": 1, "category_id": 1, "bbox": [1, 1, 5, 5]}
    root = write_coco(tmp_path, [image_entry(1, size=(50, 30))], [box])
    with pytest.raises(DataError, match=r"is 40x30 but the JSON says 50x30"):
        load_coco_detection(root, 32, 10, seed=0)
    (root / "train" / "1.png").unlink()
    with pytest.raises(DataError, match=r"image 1 \(1.png\) is not in"):
        load_coco_detection(root, 32, 10, seed=0)
    with pytest.raises(DataError, match="no train.json"):
        load_coco_detection(tmp_path / "train", 32, 10, seed=0)


# -------------------------------------------------------------------------------------------- the recipe


def test_recipe_trains_on_canvases_and_writes_map_and_pictures(tmp_path):
    out = tmp_path / "run"
    metrics = recipe.main(["--output_dir", str(out), *QUIET, *TINY, "--num_train_canvases", "64",
                           "--num_test_canvases", "12", "--max_steps", "3", "--per_device_train_batch_size", "16",
                           "--per_device_eval_batch_size", "5", "--max_detections", "20"])
    results = json.loads((out / "all_results.json").read_text())
    assert results == pytest.approx(metrics, nan_ok=True)
    assert results["eval_samples"] == 12
    for key in ("eval_map", "eval_map_50", "eval_map_75", "eval_mar_100", "eval_ap_0", "eval_ap_9"):
        assert key in results and (math.isnan(results[key]) or 0 <= results[key] <= 1)
    assert (out / "report" / "detections.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_metric_the_recipe_never_reports_is_refused_before_training(tmp_path):
    """--metric_for_best_model mAP (the metric is map): DetectionMetrics lists coco_metrics' keys (ap_<class> by the
    class names), so it is refused before a step rather than at the first evaluation."""
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"--metric_for_best_model mAP: .* report only .*eval_map, eval_map_50"):
        recipe.main(["--output_dir", str(out), *QUIET, *TINY, "--num_train_canvases", "16", "--num_test_canvases",
                     "4", "--max_steps", "1", "--metric_for_best_model", "mAP"])
    assert not (out / "metrics.jsonl").exists()
    assert DetectionMetrics(["a", "b"], 32).metric_names == ["map", "map_50", "map_75", "mar_100", "ap_a", "ap_b"]


def test_recipe_reads_a_coco_folder(tmp_path):
    canvases = load_canvases(DenseDataArguments(num_train_canvases=12, num_test_canvases=4, canvas_size=48,
                                                digit_scale_max=1.2))
    root = tmp_path / "coco"
    for split, dataset in canvases.splits.items():
        images, annotations = [], []
        (root / split).mkdir(parents=True)
        for i, item in enumerate(dataset):
            Image.fromarray(item["pixel_values"].transpose(1, 2, 0).astype(np.uint8)).save(root / split / f"{i}.png")
            images.append(image_entry(i, (48, 48)))
            for box, cls in zip(np.asarray(item["boxes"]).reshape(-1, 4), item["classes"], strict=True):
                x0, y0, x1, y1 = (float(v) for v in box)
                annotations.append({"id": len(annotations), "image_id": i, "category_id": int(cls),
                                    "bbox": [x0, y0, x1 - x0, y1 - y0]})
        doc = {"images": images, "annotations": annotations,
               "categories": [{"id": d, "name": f"digit {d}"} for d in range(10)]}
        (root / f"{split}.json").write_text(json.dumps(doc))
    out = tmp_path / "run"
    metrics = recipe.main(["--data_dir", str(root), "--canvas_size", "48", "--output_dir", str(out), *QUIET, *TINY,
                           "--max_steps", "2", "--per_device_train_batch_size", "6"])
    assert metrics["eval_samples"] == 4 and "eval_ap_digit 3" in metrics


def test_bad_model_overrides_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"CenterNet has no field \['depth'\]"):
        recipe.main(["--output_dir", str(tmp_path), *QUIET, "--num_train_canvases", "8", "--num_test_canvases", "2",
                     "--config_overrides", '{"depth": 3}'])
    with pytest.raises(ConfigError, match="output_stride 3"):
        recipe.main(["--output_dir", str(tmp_path), *QUIET, "--num_train_canvases", "8", "--num_test_canvases", "2",
                     "--config_overrides", '{"output_stride": 3}'])


# ------------------------------------------------------------------------------------- 1 vs 2 processes


@pytest.mark.slow
def test_one_and_two_processes_give_the_same_map(tmp_path, ranks):
    """Train briefly on two processes (the recipe's real launch), then evaluate the saved model on 1 process (here)
    and 2 (the session's spawned ranks): 30 test canvases in batches of 4 per process leave a last batch that 2
    processes pad with duplicates, which must be dropped. The 2-process training run's own final evaluation (in
    batches of 30) must agree as well."""
    data = ["--num_train_canvases", "512", "--num_test_canvases", "30"]
    small = ["--config_overrides", '{"widths": [8, 16, 32], "blocks_per_stage": 1, "head_width": 16}']
    launch(RECIPE, [*data, "--output_dir", str(tmp_path / "trained"), *QUIET, *small, "--num_train_epochs", "3",
                    "--per_device_train_batch_size", "16", "--per_device_eval_batch_size", "30",
                    "--expected_world_size", "2"], 2)
    common = ["--task", "detection", "--weights", str(tmp_path / "trained" / "model.safetensors"), *data, *small,
              "--per_device_eval_batch_size", "4"]
    reset_accelerate()
    dense_eval.main([*common, "--output_dir", str(tmp_path / "one")])
    ranks.run(dense_eval.main, [*common, "--output_dir", str(tmp_path / "two"), "--expected_world_size", "2"])
    one, two = (json.loads((tmp_path / d / "eval.json").read_text()) for d in ("one", "two"))
    trained = json.loads((tmp_path / "trained" / "all_results.json").read_text())
    assert one["eval_samples"] == two["eval_samples"] == 30
    assert one["eval_map_50"] > 0.1 and one["eval_map"] == pytest.approx(trained["eval_map"], abs=1e-6)
    for key in one:
        if key.startswith("eval_") and key != "eval_loss":
            assert one[key] == pytest.approx(two[key], abs=1e-9, nan_ok=True), key
    assert one["eval_loss"] == pytest.approx(two["eval_loss"], abs=1e-5)
