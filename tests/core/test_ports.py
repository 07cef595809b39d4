"""The three ports of docs/ports.md, run as their `main(argv)` in this process at tiny sizes: the tutorial loop
(SGD, StepLR per epoch + ReduceLROnPlateau, early stopping, TorchScript), Accelerate's complete_nlp_example (AdamW,
linear warmup per step, accuracy/F1, a checkpoint per epoch, tracking) and a two-input research model (parameter
groups, an auxiliary loss, a stream of (x1, x2, y) tuples). Each test reads the run directory and the printed
start-up report: every behaviour is the user's or stated, and each program, cut by SIGTERM and resumed with
--resume_from_checkpoint latest, ends bitwise equal to its uninterrupted run."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import read_jsonl, reset_accelerate
from safetensors.torch import load_file

from accel_train import Preempted

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "docs" / "ports"))
pytestmark = pytest.mark.usefixtures("one_thread")
QUIET = ["--disable_tqdm", "--run_report", "false"]


def run(program: str, out: Path, *flags: str) -> dict[str, float]:
    reset_accelerate()
    return importlib.import_module(program).main(["--output_dir", str(out), "--tiny", *QUIET, *flags])


def cut_and_resume(monkeypatch, program: str, out: Path, after_step: int, *flags: str) -> None:
    """SIGTERM after `after_step` (the loop checkpoints the next step boundary and stops), then resume latest."""
    monkeypatch.setenv("ACCEL_TRAIN_FAULT", f"sigterm_after_step:{after_step}")
    with pytest.raises(Preempted):
        run(program, out, *flags)
    monkeypatch.delenv("ACCEL_TRAIN_FAULT")
    run(program, out, *flags, "--resume_from_checkpoint", "latest")


def same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


def evaluations(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["eval_loss"]) for r in read_jsonl(out / "metrics.jsonl") if "eval_loss" in r]


def logged_lr(out: Path) -> dict[int, float]:
    """metrics.jsonl's learning_rate at each logged step: the rate *after* that step's schedule step (the
    Trainer's convention), i.e. the rate the next step runs with."""
    return {r["step"]: r["learning_rate"] for r in read_jsonl(out / "metrics.jsonl") if "learning_rate" in r}


def what_ran(out: Path) -> dict:
    return yaml.safe_load((out / "config.yaml").read_text())["what_ran"]


# ------------------------------------------------------------------------------------------- the tutorial loop
TUTORIAL = ["--num_train_epochs", "3", "--logging_steps", "1"]


def test_tutorial_loop_runs_the_users_objects_on_their_clocks_exports_and_resumes_bitwise(tmp_path, capsys,
                                                                                         monkeypatch):
    run("tutorial_loop", tmp_path / "whole", *TUTORIAL)
    report = capsys.readouterr().out
    assert ("schedule         yours, StepLR, stepped each epoch; beside it ReduceLROnPlateau, stepped at each "
            "evaluation, on eval_loss") in report
    assert "optimizer        SGD (yours): lr 0.1, weight decay 0" in report
    assert "clipping         global grad norm clipped to 1 (the default; --max_grad_norm 0 turns it off)" in report
    assert "seed             1" in report and "precision        fp32" in report
    assert "[warning]" not in report  # the port's rate is --learning_rate: nothing to reconcile
    # the tutorial's DataLoader(shuffle=True, generator=...) is reshuffled by the seedable sampler: said, not silent
    assert ("note             the training DataLoader's own generator is not used: its shuffled order comes from "
            "--seed 1 and the epoch") in report
    assert what_ran(tmp_path / "whole") == {
        "optimizer": {"class": "SGD", "given": "yours", "groups": [{"lr": 0.1, "weight_decay": 0.0}]},
        "scheduler": {"class": "StepLR", "given": "yours", "stepped": "each epoch"},
        "plateau": {"class": "ReduceLROnPlateau", "given": "yours", "stepped": "at each evaluation, on eval_loss"},
        "clipping": {"max_grad_norm": 1.0}}
    lr = logged_lr(tmp_path / "whole")  # 4 steps an epoch; epoch 0 ran at 0.1, epoch 1 at 0.01, epoch 2 at 0.001
    assert [lr[s] for s in range(1, 12)] == pytest.approx([0.1] * 3 + [0.01] * 4 + [0.001] * 4)
    # the TorchScript file loads without the Python class and gives the trained model's outputs, as a tuple
    # (docs/deploy.md: an artifact returns a tuple of tensors)
    meta = json.loads((tmp_path / "whole" / "export" / "torchscript" / "export.json").read_text())
    (artifact,) = meta["artifacts"]
    assert artifact["verified"] and artifact["max_abs_diff"] <= 1e-5
    scripted = torch.jit.load(str(tmp_path / "whole" / "export" / "torchscript" / "model.pt"))
    trained = importlib.import_module("tutorial_loop").Net(channels=4)
    trained.load_state_dict(load_file(tmp_path / "whole" / "model.safetensors"))
    x = torch.randn(3, 1, 28, 28)
    (logits,) = scripted(x)
    assert torch.allclose(logits, trained.eval()(x), atol=1e-5)
    cut_and_resume(monkeypatch, "tutorial_loop", tmp_path / "cut", 5, *TUTORIAL)  # in epoch 1
    assert same_weights(tmp_path / "whole", tmp_path / "cut")
    assert evaluations(tmp_path / "cut")[-3:] == evaluations(tmp_path / "whole")[-3:]
    assert logged_lr(tmp_path / "cut") == logged_lr(tmp_path / "whole")  # both schedules' states came back


def test_tutorial_loop_early_stopping_stops_and_the_best_model_is_kept_and_said(tmp_path, capsys):
    """Any evaluation must beat the best by 1.0 to count: the second one does not, patience 1 stops the run there."""
    metrics = run("tutorial_loop", tmp_path / "run", "--num_train_epochs", "3", "--early_stopping_patience", "1",
                  "--early_stopping_threshold", "1.0", "--run_report", "true")
    assert metrics["train_steps"] == 8  # of 12 planned
    assert "| status | stopped early at step 8 of 12 |" in (tmp_path / "run" / "report.md").read_text()
    (best_step, best_loss) = min(evaluations(tmp_path / "run")[:2], key=lambda e: e[1])
    printed = capsys.readouterr().out
    (_, first), (_, second) = evaluations(tmp_path / "run")[:2]  # the first counts as the stopper's best
    assert (f"early stopping: eval_loss has not improved by more than 1 for 1 evaluation(s) (best {first:.6g}, last "
            f"{second:.6g}); the run stops at step 8") in printed
    assert f"restored the best checkpoint {tmp_path / 'run' / 'checkpoints' / f'step-{best_step:08d}'}" in printed
    assert metrics["eval_loss"] == pytest.approx(best_loss)  # the final evaluation is the best model's


# ----------------------------------------------------------------------------------- complete_nlp_example
NLP = ["--num_train_epochs", "2", "--warmup_steps", "2", "--logging_steps", "1"]  # 64 sentences: 4 steps an epoch


def test_complete_nlp_example_states_its_schedule_checkpoints_each_epoch_tracks_and_resumes_bitwise(
        tmp_path, capsys, monkeypatch):
    metrics = run("complete_nlp_example", tmp_path / "whole", *NLP)
    report = capsys.readouterr().out
    assert ("schedule         yours, LambdaLR, stepped each optimizer step (--scheduler_interval step, the default; "
            "epoch steps it at each epoch's end)") in report
    assert "optimizer        AdamW (yours): lr 2e-05, weight decay 0.01" in report  # torch's AdamW default, stated
    assert "clipping         global grad norm clipped to 1 (the default" in report
    assert "seed             42" in report and "[warning]" not in report
    ran = what_ran(tmp_path / "whole")
    assert ran["scheduler"] == {"class": "LambdaLR", "given": "yours", "stepped": "each optimizer step"}
    assert ran["optimizer"]["groups"] == [{"lr": 2e-05, "weight_decay": 0.01}]
    lr = logged_lr(tmp_path / "whole")  # warmup 2 steps to 2e-5, then linear to 0 at step 8: one schedule step each
    assert [lr[s] for s in range(1, 9)] == pytest.approx([1e-5, 2e-5, *(2e-5 * k / 6 for k in range(5, -1, -1))])
    assert sorted(p.name for p in (tmp_path / "whole" / "checkpoints").iterdir()) == ["step-00000004",
                                                                                      "step-00000008"]
    assert {"eval_accuracy", "eval_f1"} <= set(metrics)
    assert list((tmp_path / "whole" / "runs").rglob("events.out.tfevents.*"))  # --report_to tensorboard
    cut_and_resume(monkeypatch, "complete_nlp_example", tmp_path / "cut", 5, *NLP)
    assert same_weights(tmp_path / "whole", tmp_path / "cut")
    assert evaluations(tmp_path / "cut")[-1] == evaluations(tmp_path / "whole")[-1]


# ----------------------------------------------------------------------------------- the two-input research model
RESEARCH = ["--max_steps", "12", "--eval_steps", "4", "--save_steps", "4", "--logging_steps", "2"]


def test_two_input_research_states_its_groups_logs_the_auxiliary_loss_and_resumes_a_stream_bitwise(
        tmp_path, capsys, monkeypatch):
    run("two_input_research", tmp_path / "whole", *RESEARCH)
    report = capsys.readouterr().out
    assert "optimizer        AdamW (yours): lr 0.003, weight decay 0.05; lr 0.001, weight decay 0" in report
    # the built schedule multiplies each group's own rate: its peaks are the groups', not --learning_rate's 5e-05
    assert ("schedule         cosine, peak lr 0.003, 0.001 (your optimizer's rates, each group's own; "
            "--learning_rate does not apply), 2 warmup step(s)") in report
    assert "[warning] schedule" not in report  # no advice to build the groups "with lr=config.learning_rate"
    ran = what_ran(tmp_path / "whole")
    assert ran["optimizer"]["groups"] == [{"lr": 0.003, "weight_decay": 0.05}, {"lr": 0.001, "weight_decay": 0.0}]
    assert ran["scheduler"] == {"class": "LambdaLR", "given": "built: --lr_scheduler_type cosine",
                                "stepped": "each optimizer step"}
    logs = [r for r in read_jsonl(tmp_path / "whole" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in logs] == [2, 4, 6, 8, 10, 12]
    for r in logs:  # each term logged beside the total; the total is main + 0.3 aux (the port's --aux_weight)
        assert r["loss"] == pytest.approx(r["main_loss"] + 0.3 * r["aux_loss"], rel=1e-5)
    # evaluations judge the main task only (loss_fn.evaluation_loss): eval_loss is the final model's cross-entropy
    research = importlib.import_module("two_input_research")
    model = research.TwoInputNet(width=8)
    model.load_state_dict(load_file(tmp_path / "whole" / "model.safetensors"))
    x1, x2, y = research.teacher(1, 128)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(x1, x2), y).item()
    assert evaluations(tmp_path / "whole")[-1][1] == pytest.approx(expected, rel=1e-5)
    cut_and_resume(monkeypatch, "two_input_research", tmp_path / "cut", 5, *RESEARCH)
    assert "the training stream resumes by re-reading, not from a saved position" in capsys.readouterr().out
    assert same_weights(tmp_path / "whole", tmp_path / "cut")
    assert evaluations(tmp_path / "cut")[-2:] == evaluations(tmp_path / "whole")[-2:]


def test_a_loaders_own_generator_is_said_to_be_replaced_by_the_seed(tmp_path, capsys):
    """Two DataLoaders shuffled by generators of different seeds give the same first batch (the order is --seed's,
    so that a resume replays it), and the start-up report says so; make_loader's loader (no generator) gets no note."""
    from torch.utils.data import DataLoader, TensorDataset

    from accel_train import TrainConfig, make_loader, train

    firsts = []
    for seed in (1, 2, None):
        reset_accelerate()
        data = TensorDataset(torch.arange(16.0).unsqueeze(1), torch.zeros(16))
        config = TrainConfig(output_dir=str(tmp_path / f"run{seed}"), max_steps=1, report_to=["none"],
                             disable_tqdm=True, run_report=False, per_device_train_batch_size=4, save_strategy="no",
                             mixed_precision="no", seed=7)
        loader = (make_loader(data, config, train=True) if seed is None else
                  DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed)))
        seen = []

        def loss_fn(model, batch, seen=seen):
            seen.append(batch[0].flatten().tolist())
            return torch.nn.functional.mse_loss(model(batch[0]).squeeze(-1), batch[1])

        train(torch.nn.Linear(1, 1), loader, config=config, loss_fn=loss_fn)
        firsts.append(seen[-1])
        noted = "the training DataLoader's own generator is not used" in capsys.readouterr().out
        assert noted == (seed is not None)
    assert firsts[0] == firsts[1] == firsts[2]


def test_a_plateau_whose_mode_disagrees_with_the_metric_it_is_stepped_on_is_warned(tmp_path, capsys):
    """The tutorial's plateau is mode="min" (a loss). Stepped on eval_accuracy (--metric_for_best_model, greater is
    better) it cuts the rate each time accuracy improves: the pre-flight says so, with both ways out (a warning: a
    mode chosen against the metric on purpose still runs). On eval_loss (the first test) there is no warning."""
    run("tutorial_loop", tmp_path / "run", "--num_train_epochs", "1", "--metric_for_best_model", "eval_accuracy")
    assert ("[warning] plateau: your ReduceLROnPlateau(mode='min') is stepped on eval_accuracy at each evaluation "
            "(--metric_for_best_model), where greater is better: it cuts the learning rate each time eval_accuracy "
            "improves. Fix: build it with mode='max'") in capsys.readouterr().out
