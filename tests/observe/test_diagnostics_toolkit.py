"""The opt-in diagnostics: gradient flow equal to a direct computation, activation statistics, vanishing and
unused layers flagged, profiler traces, memory snapshots, anomaly detection, and nothing when off."""

import copy
import json

import pytest
import torch
import toy_train
from accelerate.utils import set_seed
from conftest import read_jsonl, reset_accelerate

from accel_train.observe.probes import flag_layers, layer_grad_norms

QUIET = ["--report_to", "none", "--disable_tqdm", "--run_report", "false", "--save_strategy", "no"]
# 32 samples in one batch of 32: every step sees the whole set, so a direct computation can replay it
FULL_BATCH = ["--num_samples", "32", "--per_device_train_batch_size", "32", "--optim", "sgd", "--sgd_momentum", "0",
              "--learning_rate", "0.5", "--lr_scheduler_type", "constant", "--max_grad_norm", "0",
              "--eval_strategy", "no"]


def run_toy(out, *args):
    reset_accelerate()
    toy_train.main(["--output_dir", str(out), *QUIET, *args])


def toy_model_and_data():
    """toy_train's model (built right after build_accelerator seeds 42) and its training set."""
    set_seed(42)
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Dropout(0.0), torch.nn.Linear(32, 2))
    data = toy_train.Points(32, 0)
    return model, data.x, data.y


def test_gradient_flow_equals_a_direct_computation(tmp_path):
    run_toy(tmp_path / "run", *FULL_BATCH, "--max_steps", "2", "--grad_flow_steps", "1")
    records = read_jsonl(tmp_path / "run" / "diagnostics" / "grad_flow.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    model, x, y = toy_model_and_data()
    for record in records:  # replay: gradient of the full-batch loss, then the plain SGD step the run took
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        for name in ("0", "3"):
            layer = model[int(name)]
            direct = torch.sqrt(layer.weight.grad.pow(2).sum() + layer.bias.grad.pow(2).sum()).item()
            assert record["norms"][name] == pytest.approx(direct, rel=1e-5)
            assert record["sizes"][name] == layer.weight.numel() + layer.bias.numel()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.5 * p.grad
    assert records[0]["flags"] == {"no_gradient": [], "vanishing": [], "exploding": []}


def test_vanishing_unused_and_exploding_layers_are_flagged():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second, self.head = torch.nn.Linear(4, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
            self.unused = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.head(torch.tanh(self.second(1e-7 * torch.tanh(self.first(x)))))  # first: 1e-7 x gradient

    torch.manual_seed(0)
    net = Net()
    net(torch.randn(16, 4)).pow(2).mean().backward()
    norms, sizes = layer_grad_norms(net)
    assert list(norms) == ["first", "second", "head", "unused"] and norms["unused"] is None
    history = {}
    flags = flag_layers(norms, sizes, history)
    assert flags == {"no_gradient": ["unused"], "vanishing": ["first"], "exploding": []}
    later = lambda **scaled: flag_layers({**norms, **scaled}, sizes, copy.deepcopy(history))["exploding"]  # noqa: E731
    assert later(head=norms["head"] * 50) == []  # against its own past, not its peers
    assert later(head=norms["head"] * 500) == ["head"]
    assert later(second=float("inf")) == ["second"]


def test_activation_statistics_equal_a_direct_computation(tmp_path):
    run_toy(tmp_path / "run", *FULL_BATCH, "--max_steps", "2", "--activation_stats_steps", "1")
    records = read_jsonl(tmp_path / "run" / "diagnostics" / "activations.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    model, x, _ = toy_model_and_data()
    hidden = model[0](x).detach()
    stats = records[0]["stats"]
    assert list(stats) == ["0", "1", "2", "3"]  # every leaf module, in forward order
    assert stats["0"]["mean"] == pytest.approx(hidden.mean().item(), rel=1e-5)
    assert stats["0"]["std"] == pytest.approx(hidden.std().item(), rel=1e-5)
    assert stats["1"]["abs_max"] == pytest.approx(torch.tanh(hidden).abs().max().item(), rel=1e-5)
    assert stats["1"]["zero_fraction"] == 0.0 and stats["1"]["nonfinite_fraction"] == 0.0


def test_profiler_writes_a_trace_of_the_chosen_steps(tmp_path):
    out = tmp_path / "run"
    run_toy(out, "--max_steps", "4", "--eval_strategy", "no", "--profile_steps", "2-3")
    [trace] = (out / "profiler").glob("rank0.*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#1", "ProfilerStep#2"}  # optimizer steps 2 and 3 (ProfilerStep#n = step n + 1)
    assert any(e.get("name") == "aten::addmm" for e in events)  # the Linear layers' work is in it
    table = (out / "profiler" / "key_averages_rank0.txt").read_text()
    assert "optimizer steps 2-3" in table and "aten::addmm" in table


def test_memory_snapshot_on_cpu(tmp_path):
    out = tmp_path / "run"
    run_toy(out, "--max_steps", "3", "--eval_strategy", "no", "--memory_snapshot_step", "2")
    snapshot = json.loads((out / "diagnostics" / "memory_step2_rank0.json").read_text())
    params = (6 * 32 + 32 + 32 * 2 + 2) * 4
    assert snapshot["parameters_mb"] == round(params / 2**20, 3)
    assert snapshot["optimizer_state_mb"] >= round(2 * params / 2**20, 3)  # AdamW: two moments per value
    assert snapshot["peak_rss_mb"] > 0 and "no allocation history" in snapshot["note"]


@pytest.mark.filterwarnings("ignore:Error detected in")  # torch's warning with the forward traceback: the point
def test_anomaly_detection_names_the_backward_op(tmp_path):
    with pytest.raises(RuntimeError, match="Function '.*Backward.*' returned nan values"):
        # --no_preflight: its loss check would refuse the poisoned first batch before training, which is the point
        run_toy(tmp_path / "run", "--detect_anomaly", "--poison_index", "3", "--max_steps", "20",
                "--eval_strategy", "no", "--no_preflight")
    assert not torch.is_anomaly_enabled()  # restored when the loop unwinds


def test_diagnostics_off_leave_no_trace(tmp_path):
    run_toy(tmp_path / "run", "--max_steps", "2", "--eval_strategy", "no")
    names = {p.name for p in (tmp_path / "run").iterdir()}
    assert "diagnostics" not in names and "profiler" not in names
