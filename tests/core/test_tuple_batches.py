"""Tuple batches, first-class: a TensorDataset's `(inputs, targets)` and `(x1, x2, y)` batches reach the user's loss as
given, the metrics get the target as "labels", the pre-flight checks integer targets as a dict's labels, and
--export_formats takes the model's inputs from the tuple (every element but the last, named after the forward's
parameters), verifies the artifact, and train() returns to the script. All runs in-process, 1 process."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import reset_accelerate
from torch.utils.data import DataLoader, TensorDataset

from accel_train import ConfigError, TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")


class TwoInputs(torch.nn.Module):
    """forward(x, z=None): 3 class scores from x [B, 4], plus z's [B, 2] when given."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Linear(2, 3)

    def forward(self, x, z=None):
        return self.a(x) + (self.b(z) if z is not None else 0)


def dataset(two: bool, label_offset: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x, z = torch.randn(24, 4, generator=g), torch.randn(24, 2, generator=g)
    y = torch.randint(0, 3, (24,), generator=g) + label_offset
    return TensorDataset(x, z, y) if two else TensorDataset(x, y)


def loss_fn(model, batch):
    *inputs, targets = batch  # the tutorial's unpacking: inputs first, the target last
    logits = model(*inputs)
    return {"loss": torch.nn.functional.cross_entropy(logits, targets), "logits": logits}


def accuracy(outputs):
    return {"accuracy": (outputs["logits"].argmax(-1) == outputs["labels"]).float().mean()}


def run(out, data: TensorDataset, evaluated: bool = True, **overrides):
    reset_accelerate()
    torch.manual_seed(0)
    settings = dict(output_dir=str(out), max_steps=3, report_to=["none"], disable_tqdm=True, run_report=False,
                    per_device_train_batch_size=4, mixed_precision="no", save_strategy="no", seed=0)
    model = TwoInputs()
    result = train(model, DataLoader(data, batch_size=4, shuffle=True), config=TrainConfig(**{**settings, **overrides}),
                   loss_fn=loss_fn, eval_loader=DataLoader(data, batch_size=8) if evaluated else None,
                   metrics_fn=accuracy if evaluated else None)
    return model, result


@pytest.mark.parametrize("two, fmt", [(False, "torchscript"), (True, "onnx")])
def test_export_after_training_on_tuple_batches_takes_the_inputs_from_the_tuple(tmp_path, two, fmt):
    data = dataset(two)
    model, result = run(tmp_path / "run", data, export_formats=[fmt])
    # the script's own code after train() runs: train returned, with the metrics computed from the tuple's targets
    x, *rest = data.tensors
    inputs = (x, rest[0]) if two else (x,)
    with torch.no_grad():
        logits = model(*inputs)
    expected = (logits.argmax(-1) == data.tensors[-1]).float().mean().item()
    assert result.metrics["eval_accuracy"] == pytest.approx(expected)
    meta = json.loads((tmp_path / "run" / "export" / fmt / "export.json").read_text())
    (artifact,) = meta["artifacts"]
    names = ["x", "z"] if two else ["x"]
    assert [i["name"] for i in artifact["inputs"]] == names  # named after forward(x, z)
    assert meta["example_inputs"] == "the run's evaluation data"
    from safetensors.torch import load_file

    kept = load_file(str(tmp_path / "run" / "export" / "example_inputs.safetensors"))
    assert sorted(kept) == names and torch.equal(kept["x"], x[:8])  # the inputs, never the targets
    assert artifact["verified"] and [c["shapes"] for c in artifact["checks"]] == (
        ["2x4 2x2", "3x4 3x2", "1x4 1x2"] if two else ["2x4", "3x4", "1x4"])
    assert artifact["max_abs_diff"] <= 1e-5


def test_integer_targets_of_a_tuple_batch_get_the_label_range_check(tmp_path):
    with pytest.raises(ConfigError, match=r"the training batch has labels 1..3, the model scores 3 classes \(the "
                                          r"model's output\): valid labels are 0..2"):
        run(tmp_path / "run", dataset(two=False, label_offset=1))
    assert not (tmp_path / "run").exists() or list((tmp_path / "run").iterdir()) == []


def test_without_an_evaluation_loader_export_takes_the_training_sets_first_samples(tmp_path):
    data = dataset(two=True)
    _, result = run(tmp_path / "run", data, evaluated=False, export_formats=["torchscript"])
    assert result.state.step == 3  # train() returned to the script
    meta = json.loads((tmp_path / "run" / "export" / "torchscript" / "export.json").read_text())
    assert meta["example_inputs"] == "the run's training data (its first samples)"
    (artifact,) = meta["artifacts"]
    assert [i["name"] for i in artifact["inputs"]] == ["x", "z"] and artifact["verified"]
    from safetensors.torch import load_file

    kept = load_file(str(tmp_path / "run" / "export" / "example_inputs.safetensors"))
    assert torch.equal(kept["x"], data.tensors[0][:8]) and torch.equal(kept["z"], data.tensors[1][:8])
