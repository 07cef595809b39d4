"""The pre-flight check: one seeded bug per test, caught before step 0 (errors refuse the start and write
nothing; warnings land in report/preflight.json), a correct run that passes clean, and the overfit mode."""

import json
from types import SimpleNamespace

import pytest
import torch
import toy_train
from accelerate import Accelerator
from accelerate.scheduler import AcceleratedScheduler
from conftest import read_jsonl, reset_accelerate
from torch.utils.data import DataLoader, Sampler
from transformers import get_linear_schedule_with_warmup

from accel_train import ConfigError, TrainConfig, build_scheduler, make_plan, train
from accel_train.observe.preflight.model_checks import check_schedule


def points(n=64, seed=0, label_offset=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] > 0).long() + label_offset
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def loss_fn(model, batch):
    logits = model(batch["x"])
    return {"loss": torch.nn.functional.cross_entropy(logits, batch["labels"]), "logits": logits}


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def fly(out, model=None, loader=None, eval_loader=None, optimizer=None, scheduler=None, accelerator=None, **overrides):
    """Train 2 epochs of 8 steps on 64 points (or as overridden); return the pre-flight findings."""
    settings = dict(output_dir=str(out), report_to=["none"], disable_tqdm=True, run_report=False, save_strategy="no",
                    eval_strategy="no", num_train_epochs=2, per_device_train_batch_size=8, learning_rate=1e-2)
    config = TrainConfig(**{**settings, **overrides})
    train(model or mlp(), loader or DataLoader(points(), batch_size=8, shuffle=True), config=config, loss_fn=loss_fn,
          eval_loader=eval_loader, optimizer=optimizer, scheduler=scheduler, accelerator=accelerator)
    return json.loads((out / "report" / "preflight.json").read_text())["findings"]


def refused(out, match, **kwargs):
    with pytest.raises(ConfigError, match=match) as err:
        fly(out, **kwargs)
    assert "pre-flight check refused" in str(err.value) and "Fix:" in str(err.value)
    assert list(out.iterdir()) == []  # a refused start writes nothing
    return str(err.value)


def warned(findings, check):
    return [f for f in findings if f["level"] == "warning" and f["check"] == check]


def test_a_correct_run_passes_clean(tmp_path):
    findings = fly(tmp_path / "ok", eval_loader=DataLoader(points(24, 1), batch_size=8))
    assert [f for f in findings if f["level"] != "ok"] == []
    checks = {f["check"] for f in findings}
    assert {"world_size", "precision", "global_batch", "steps", "schedule", "optimizer", "train_order",
            "seedable_sampler", "eval_order", "labels"} <= checks
    by_check = {f["check"]: f["message"] for f in findings}
    assert "global batch 8 = 8 per device x 1 process(es) x 1 accumulation" in by_check["global_batch"]
    assert "8 optimizer step(s) per epoch" in by_check["steps"] and "16 in total" in by_check["steps"]
    assert "labels within 0..1" in by_check["labels"]


# ------------------------------------------------------------------------------------------------ errors


def test_schedule_built_for_too_few_steps(tmp_path):
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    short = get_linear_schedule_with_warmup(optimizer, 0, num_training_steps=8)  # one epoch of two
    message = refused(tmp_path / "run", "reaches 0 after step 8 of 16", model=model, optimizer=optimizer,
                      scheduler=short)
    assert "the last 8 steps (50%) train nothing" in message


def test_scheduler_stepped_once_per_process():
    # Accelerate's default (step_scheduler_with_optimizer=True) steps a prepared scheduler N times per step.
    config = TrainConfig(max_steps=20, learning_rate=1e-2, report_to=["none"])
    plan = make_plan(config, batches_per_epoch=10, num_processes=2)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    scheduler = AcceleratedScheduler(build_scheduler(optimizer, config, plan), optimizer, step_with_optimizer=True)
    accelerator = SimpleNamespace(num_processes=2, distributed_type=SimpleNamespace(value="MULTI_CPU"))
    session = SimpleNamespace(accelerator=accelerator, config=config, plan=plan, optimizer=optimizer,
                              scheduler=scheduler)
    [finding] = check_schedule(session)
    assert finding.level == "error" and "reaches 0 after step 10 of 20" in finding.message
    assert "2 times per optimizer step" in finding.message and "build_accelerator" in finding.fix


def test_optimizer_missing_trainable_parameters(tmp_path):
    model = mlp()
    optimizer = torch.optim.AdamW(model[0].parameters(), lr=1e-2)  # the head is left out
    message = refused(tmp_path / "run", "2 trainable parameter tensor.s. .34 values. are not in the optimizer",
                      model=model, optimizer=optimizer)
    assert "2.weight" in message


def test_labels_outside_the_model_range(tmp_path):
    one_based = DataLoader(points(label_offset=1), batch_size=8, shuffle=True)  # 1..2 for 2 classes
    refused(tmp_path / "run", r"labels 1..2, the model scores 2 classes \(the logits\): valid labels are 0..1",
            loader=one_based)


def test_loader_batch_differs_from_the_config(tmp_path):
    refused(tmp_path / "run", "micro-batches of 16 samples, --per_device_train_batch_size is 8",
            loader=DataLoader(points(), batch_size=16, shuffle=True))


def test_precision_other_than_asked(tmp_path):
    refused(tmp_path / "run", "--mixed_precision bf16 was asked, the Accelerator runs no",
            accelerator=Accelerator(step_scheduler_with_optimizer=False), mixed_precision="bf16")


def test_world_size_other_than_asked(tmp_path):
    refused(tmp_path / "run", r"2 processes were asked \(--expected_world_size\), 1 are running",
            accelerator=Accelerator(step_scheduler_with_optimizer=False), expected_world_size=2)


# ------------------------------------------------------------------------------------------------ warnings


def test_training_loader_not_shuffled(tmp_path):
    findings = fly(tmp_path / "run", loader=DataLoader(points(), batch_size=8, shuffle=False))
    assert "not shuffled" in warned(findings, "train_order")[0]["message"]


def test_evaluation_loader_shuffled(tmp_path):
    findings = fly(tmp_path / "run", eval_loader=DataLoader(points(24, 1), batch_size=8, shuffle=True))
    assert "evaluation loader is shuffled" in warned(findings, "eval_order")[0]["message"]


class UnseedableSampler(Sampler):
    """A random order drawn from the global generator, with no set_epoch: cannot be replayed on resume."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())


def test_sampler_that_cannot_be_replayed(tmp_path):
    findings = fly(tmp_path / "run", loader=DataLoader(points(), batch_size=8, sampler=UnseedableSampler(64)))
    assert "UnseedableSampler) has no set_epoch()" in warned(findings, "seedable_sampler")[0]["message"]


def test_schedule_built_for_too_many_steps(tmp_path):
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    long = get_linear_schedule_with_warmup(optimizer, 0, num_training_steps=32)  # the run has 16
    findings = fly(tmp_path / "run", model=model, optimizer=optimizer, scheduler=long)
    assert "still at 50% of its peak when the run ends" in warned(findings, "schedule")[0]["message"]


def test_schedule_without_the_configured_warmup(tmp_path):
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    no_warmup = get_linear_schedule_with_warmup(optimizer, 0, num_training_steps=16)
    findings = fly(tmp_path / "run", model=model, optimizer=optimizer, scheduler=no_warmup, warmup_steps=4)
    assert "peak after 0 step(s), but the warmup is 4" in warned(findings, "schedule")[0]["message"]


def test_optimizer_learning_rate_other_than_the_config(tmp_path):
    model = mlp()
    findings = fly(tmp_path / "run", model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert "peaks at 0.001, --learning_rate is 0.01" in warned(findings, "schedule")[0]["message"]


def test_frozen_parameters_in_the_optimizer(tmp_path):
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model[0].requires_grad_(False)  # frozen after the optimizer was built
    findings = fly(tmp_path / "run", model=model, optimizer=optimizer)
    assert "2 frozen parameter tensor(s) are in the optimizer" in warned(findings, "optimizer")[0]["message"]


def test_low_precision_master_weights(tmp_path):
    findings = fly(tmp_path / "run", model=mlp().to(torch.bfloat16),
                   loader=DataLoader(points(), batch_size=8, shuffle=True, collate_fn=bf16_batch))
    assert "stored in bfloat16" in warned(findings, "precision")[0]["message"]


def bf16_batch(rows):
    return {"x": torch.stack([r["x"] for r in rows]).bfloat16(), "labels": torch.stack([r["labels"] for r in rows])}


def test_learning_rate_zero_is_only_a_warning(tmp_path):  # a legitimate evaluation-only run
    findings = fly(tmp_path / "run", learning_rate=0.0)
    assert "0 at every step: nothing trains" in warned(findings, "schedule")[0]["message"]


def test_intervals_longer_than_the_run(tmp_path):
    findings = fly(tmp_path / "run", logging_steps=50)
    assert "logging every 50 steps, but the run has 16" in warned(findings, "intervals")[0]["message"]


def test_no_preflight_skips_the_check(tmp_path):
    model = mlp()
    optimizer = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    with pytest.raises(FileNotFoundError):  # trains (the bug unseen) and writes no preflight.json
        fly(tmp_path / "run", model=model, optimizer=optimizer, preflight=False)
    assert (tmp_path / "run" / "config.yaml").exists()


@pytest.mark.parametrize("flags, message", [
    ({"profile_steps": "7-5"}, "--profile_steps='7-5': expected START-END optimizer steps with 1 <= START <= END"),
    ({"profile_steps": "a-b"}, "--profile_steps='a-b'"),
    ({"grad_flow_steps": -1}, "--grad_flow_steps=-1: must be >= 0"),
    ({"overfit_batches": 1, "resume_from_checkpoint": "latest"}, "--overfit_batches starts a fresh debug run"),
])
def test_observability_flags_are_checked_when_parsed(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(report_to=["none"], **flags)
    assert TrainConfig(profile_steps="5").profile_range == (5, 5)
    assert TrainConfig(profile_steps="2-4").profile_range == (2, 4)


# ------------------------------------------------------------------------------------------------ overfit mode


def run_toy(out, *args):
    reset_accelerate()
    toy_train.main(["--output_dir", str(out), "--report_to", "none", "--disable_tqdm", "--run_report", "false", *args])
    return json.loads((out / "all_results.json").read_text())


def test_overfit_one_batch_drives_the_loss_near_zero(tmp_path, capsys):
    out = tmp_path / "fit"
    results = run_toy(out, "--overfit_batches", "1", "--learning_rate", "0.05", "--per_device_train_batch_size", "8")
    assert results["overfit_passed"] == 1.0
    assert results["overfit_final_loss"] <= 0.05 * results["overfit_initial_loss"]
    history = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in history] == list(range(1, results["overfit_steps"] + 1))  # every step, no eval
    assert results["overfit_steps"] < 300 and results["train_steps"] == results["overfit_steps"]  # stopped early
    assert not (out / "checkpoints").exists() and "eval_loss" not in results
    seen = json.loads(next(out.glob("toy_rank0_*.json")).read_text())["indices"]
    assert all(sorted(batch) == list(range(8)) for batch in seen)  # the same 8 samples at every step
    assert "overfit check passed" in capsys.readouterr().out


def test_overfit_says_when_it_could_not(tmp_path, capsys):
    results = run_toy(tmp_path / "stuck", "--overfit_batches", "1", "--learning_rate", "1e-6", "--max_steps", "10")
    assert results["overfit_passed"] == 0.0 and results["overfit_steps"] == 10
    assert "overfit check FAILED: after 10 steps" in capsys.readouterr().out
