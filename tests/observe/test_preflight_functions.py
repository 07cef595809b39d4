"""The pre-flight runs the user's loss_fn and metrics_fn on the first training samples before the first step: a loss
that raises or returns a wrong thing, and a metric of the wrong type, refuse the start naming the function, the
batch's structure and what it returned (nothing written); a metric that raises on one batch is a warning (it may need
every class), and the run goes on. In-process, 1 process, 6 steps of a linear classifier on (x, y) tuples."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import reset_accelerate
from torch.utils.data import DataLoader, TensorDataset

from accel_train import ConfigError, TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(24, 4, generator=g), torch.randint(0, 3, (24,), generator=g))


def cross_entropy(model, batch):
    x, y = batch
    logits = model(x)
    return {"loss": torch.nn.functional.cross_entropy(logits, y), "logits": logits}


def accuracy(outputs):
    return {"accuracy": (outputs["logits"].argmax(-1) == outputs["labels"]).float().mean()}


def fly(out, loss_fn=cross_entropy, metrics_fn=accuracy):
    reset_accelerate()
    torch.manual_seed(0)
    config = TrainConfig(output_dir=str(out), max_steps=6, report_to=["none"], disable_tqdm=True, run_report=False,
                         per_device_train_batch_size=4, mixed_precision="no", save_strategy="no", seed=0)
    return train(torch.nn.Linear(4, 3), DataLoader(data(), batch_size=4), config=config, loss_fn=loss_fn,
                 eval_loader=DataLoader(data(), batch_size=8), metrics_fn=metrics_fn)


def dict_loss(model, batch):  # written for dict batches, given tuples
    return torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"])


def per_sample(model, batch):  # reduction="none" forgotten
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="none")


def a_float(model, batch):
    return float(torch.nn.functional.cross_entropy(model(batch[0]), batch[1]))


def not_finite(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1]) * float("nan")


def short_per_sample(model, batch):
    losses = torch.nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="none")
    return {"loss": losses.mean(), "per_sample_loss": losses[:1]}


BATCH = r"list\(float32\[4, 4\], int64\[4\]\)"


@pytest.mark.parametrize("loss_fn, match", [
    (dict_loss, rf"the loss function dict_loss raised TypeError: list indices must be integers or slices, not str on "
                rf"the first training batch, {BATCH}"),
    (per_sample, rf"the loss function per_sample returned a loss of shape \[4\] on the first training batch, {BATCH}"),
    (a_float, rf"the loss function a_float must return a scalar tensor .*; it returned float \(on the first training "
              rf"batch, {BATCH}; it returned float 1\.39"),
    (not_finite, rf"the loss function not_finite returned nan on the first training batch, {BATCH}, before any "
                 "update"),
    (short_per_sample, r"loss_fn returned per_sample_loss of shape \(1,\) for a batch of 4 samples"),
])
def test_a_loss_that_fails_on_the_first_batch_refuses_the_start(tmp_path, loss_fn, match):
    with pytest.raises(ConfigError, match=match) as err:
        fly(tmp_path / "run", loss_fn=loss_fn)
    assert "pre-flight check refused" in str(err.value)
    assert not (tmp_path / "run").exists() or list((tmp_path / "run").iterdir()) == []


@pytest.mark.parametrize("metrics_fn, match", [
    (lambda o: {"per_class": torch.ones(3)}, r"metrics_fn returned 'per_class' = Tensor of shape \(3,\)"),
    (lambda o: {"best": "cat"}, r"metrics_fn returned 'best' = str: each metric must be one number"),
    (lambda o: 0.5, r"the metrics function <lambda> returned float 0.5, not a mapping"),
])
def test_a_metric_of_the_wrong_type_refuses_the_start(tmp_path, metrics_fn, match):
    with pytest.raises(ConfigError, match=match):
        fly(tmp_path / "run", metrics_fn=metrics_fn)
    assert not (tmp_path / "run").exists() or list((tmp_path / "run").iterdir()) == []


def every_class_recall(outputs):  # needs all 3 classes: a batch of 4 may lack one
    labels, predicted = outputs["labels"], outputs["logits"].argmax(-1)
    if len(torch.unique(labels)) < 3:
        raise ValueError(f"recall needs every class, the labels hold {sorted(set(labels.tolist()))}")
    return {"recall": torch.stack([(predicted[labels == c] == c).float().mean() for c in range(3)]).mean()}


def test_a_metric_that_raises_on_one_batch_is_a_warning_and_the_run_goes_on(tmp_path):
    first = data().tensors[1][:4]
    assert len(torch.unique(first)) < 3  # the pre-flight's batch lacks a class; the whole set has all three
    result = fly(tmp_path / "run", metrics_fn=every_class_recall)
    assert 0 <= result.metrics["eval_recall"] <= 1
    findings = json.loads((tmp_path / "run" / "report" / "preflight.json").read_text())["findings"]
    loss, warning = [x for x in findings if x["check"] == "functions"]
    assert loss["level"] == "ok" and loss["message"].startswith("the loss function cross_entropy returned a finite")
    assert warning["level"] == "warning"
    assert warning["message"].startswith("the metrics function every_class_recall raised ValueError: recall needs "
                                         "every class")


def refused_on_this_rank(out: str) -> None:
    with pytest.raises(ConfigError, match=r"the loss function per_sample returned a loss of shape \[4\]"):
        fly(__import__("pathlib").Path(out), loss_fn=per_sample)


def test_two_processes_refuse_the_same_start(tmp_path, ranks):
    """Every rank runs the check on the same first samples (read by index), and the findings are merged: both refuse
    before anything is written."""
    ranks.run(refused_on_this_rank, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists() or list((tmp_path / "run").iterdir()) == []
