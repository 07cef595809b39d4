"""Weight averaging (--ema_decay): the average follows its warmed-up decay exactly, is evaluated beside the live
weights (eval_ema_*), becomes the final model with --save_ema_as_final, and resumes bitwise from a checkpoint saved
mid-epoch, on 1 process and on 2."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import toy_train
from conftest import read_jsonl, reset_accelerate, stop_then_resume, toy_on, toy_records
from safetensors.torch import load_file

from accel_train import ConfigError, TrainConfig, run_cli
from accel_train.core.ema import WeightAverage
from accel_train.core.evaluation import check_monitored_metric, metric_name

QUIET = ["--report_to", "none", "--disable_tqdm", "--run_report", "false"]


def test_the_average_follows_the_warmed_up_decay_and_the_swap_restores_the_live_weights_bitwise():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    average = WeightAverage(model, decay=0.9)
    expected = {n: t.detach().clone() for n, t in average.average.items()}
    g = torch.Generator().manual_seed(0)
    for t in range(30):
        with torch.no_grad():
            for tensor in average.live.values():
                tensor.copy_(torch.randn(tensor.shape, generator=g))
        decay = min(0.9, (1 + t) / (10 + t))
        for name, tensor in average.live.items():
            expected[name] = decay * expected[name] + (1 - decay) * tensor
        average.update()
    assert set(average.average) == {"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var"}
    for name, value in expected.items():
        torch.testing.assert_close(average.average[name], value, rtol=0, atol=1e-6)
    live = {n: t.detach().clone() for n, t in average.live.items()}
    with average.swapped():
        assert all(torch.allclose(average.live[n], expected[n], rtol=0, atol=1e-6) for n in expected)
        assert model[0].weight is average.live["0.weight"], "the model's own parameters hold the average"
    assert all(torch.equal(average.live[n], live[n]) for n in live), "the live weights come back bitwise"
    assert WeightAverage(model, 0.9, warmup=False).current_decay() == 0.9


def test_the_average_of_a_bf16_model_keeps_moving_and_survives_evaluations_and_a_checkpoint(tmp_path):
    """An average of bf16 weights is kept in fp32: at decay 0.999 each update, 0.001 x (weight - average), is under
    half of bf16's step at 1.0 (2^-8), and an average kept in bf16 would never leave 1.0. Evaluating it (the model
    holds it, rounded to bf16) neither rounds it nor changes the live weights, and it is saved and loaded as it is."""
    model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    average = WeightAverage(model, 0.999, warmup=False)
    assert {t.dtype for t in average.average.values()} == {torch.float32}
    with torch.no_grad():
        for name, tensor in average.live.items():
            average.average[name].fill_(1.0)
            tensor.fill_(2.0)
    for _ in range(1000):
        average.update()
        with average.swapped():  # an evaluation of the average every step
            assert model.weight.dtype == torch.bfloat16
    expected = 2 - 0.999 ** 1000  # 1.632: the fp32 average of 2.0 seen 1,000 times from 1.0
    assert all(torch.allclose(t, torch.full_like(t, expected), atol=1e-4) for t in average.average.values())
    with average.swapped():
        assert model.weight.dtype == torch.bfloat16 and model.weight.eq(torch.tensor(expected).bfloat16()).all()
    assert model.weight.eq(2.0).all() and model.bias.eq(2.0).all()  # the live weights, bitwise
    average.save(tmp_path)
    again = WeightAverage(model, 0.999, warmup=False)
    again.load(tmp_path, 1)
    assert all(again.average[n].equal(average.average[n]) for n in average.average) and again.updates == 1000
    average.copy_into_model()
    assert model.weight.dtype == torch.bfloat16 and model.weight.eq(torch.tensor(expected).bfloat16()).all()


def run(argv):
    reset_accelerate()
    run_cli(toy_train.main, argv)


def test_a_run_evaluates_the_average_beside_the_live_weights_and_saves_it_as_the_final_model(tmp_path):
    out = tmp_path / "run"
    run(["--output_dir", str(out), *QUIET, "--num_train_epochs", "3", "--learning_rate", "0.05",
         "--ema_decay", "0.9", "--save_ema_as_final", "--eval_strategy", "epoch"])
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "eval_loss" in r]
    assert len(records) == 3 and all("eval_ema_loss" in r and "eval_ema_accuracy" in r for r in records)
    assert all(r["eval_ema_loss"] != r["eval_loss"] for r in records), "the average is not the live weights"
    # the final model is the average: its loss on the evaluation set is eval_ema_loss
    weights = load_file(out / "model.safetensors")
    model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Dropout(0.0),
                                torch.nn.Linear(32, 2))
    model.load_state_dict(weights)
    points = toy_train.Points(37, 1)
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(points.x), points.y).item()
    assert abs(loss - records[-1]["eval_ema_loss"]) < 1e-6, (loss, records[-1])
    assert abs(loss - records[-1]["eval_loss"]) > 1e-4, "the saved model would be the live weights"
    results = json.loads((out / "all_results.json").read_text())
    assert (results["eval_ema_loss"], results["eval_loss"]) == (records[-1]["eval_ema_loss"], records[-1]["eval_loss"])
    # the best step chosen by the weights saved: the average's loss under --save_ema_as_final (the default metric)
    best = tmp_path / "best"
    run(["--output_dir", str(best), *QUIET, "--num_train_epochs", "3", "--learning_rate", "0.05", "--ema_decay", "0.9",
         "--save_ema_as_final", "--eval_strategy", "epoch", "--save_strategy", "epoch", "--load_best_model_at_end"])
    records = [r for r in read_jsonl(best / "metrics.jsonl") if "eval_ema_loss" in r][:3]
    model.load_state_dict(load_file(best / "model.safetensors"))
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(points.x), points.y).item()
    assert abs(loss - min(r["eval_ema_loss"] for r in records)) < 1e-6
    state = json.loads((best / "checkpoints" / "step-00000036" / "train_state.json").read_text())
    assert state["best_metric_name"] == "eval_ema_loss"  # not the live eval_loss, whose best step may be another
    for flags, refusal in ((["--save_ema_as_final", "--metric_for_best_model", "accuracy"],
                            "best by eval_accuracy, a metric of the live weights.*eval_ema_accuracy"),
                           (["--metric_for_best_model", "ema_loss"], "saves that step's live weights.*Add "
                                                                     "--save_ema_as_final.*\\(eval_loss\\)")):
        with pytest.raises(ConfigError, match=refusal):
            TrainConfig(output_dir=str(tmp_path), ema_decay=0.9, load_best_model_at_end=True, **{
                "save_ema_as_final": "--save_ema_as_final" in flags, "metric_for_best_model": flags[-1]})


def test_the_averages_metrics_can_choose_the_best_model_and_keep_their_names(tmp_path):
    class Metrics:  # a metrics function that names what it returns, as the recipes' do
        metric_names = ("accuracy", "eval_rouge1")

        def __call__(self, outputs):
            return {"accuracy": 1.0, "eval_rouge1": 0.5}

    config = TrainConfig(output_dir=str(tmp_path), metric_for_best_model="ema_accuracy", ema_decay=0.9)
    check_monitored_metric(config, Metrics(), True)  # eval_ema_accuracy: evaluated beside the live weights
    check_monitored_metric(dataclasses.replace(config, metric_for_best_model="ema_rouge1"), Metrics(), True)
    with pytest.raises(ConfigError, match="report only eval_loss"):
        check_monitored_metric(dataclasses.replace(config, ema_decay=0.0), Metrics(), True)
    assert [metric_name(k, p) for k, p in (("eval_rouge1", "eval_ema"), ("rouge1", "test"), ("eval_rouge1", "test"),
                                             ("eval_ema_loss", "eval_ema"))] == \
        ["eval_ema_rouge1", "test_rouge1", "test_rouge1", "eval_ema_loss"]


@pytest.mark.parametrize("final", ["live", "weight average"])
def test_the_confusion_matrix_is_of_the_weights_saved_as_the_final_model(tmp_path, final):
    out = tmp_path / "run"
    run(["--output_dir", str(out), *QUIET, "--num_train_epochs", "1", "--learning_rate", "0.5", "--ema_decay", "0.99",
         "--eval_strategy", "epoch", *(["--save_ema_as_final"] if final == "weight average" else [])])
    results = json.loads((out / "all_results.json").read_text())
    saved = json.loads((out / "report" / "confusion_matrix.json").read_text())
    matrix = torch.tensor(saved["matrix"])
    accuracy = (matrix.diag().sum() / matrix.sum()).item()
    assert results["eval_accuracy"] != results["eval_ema_accuracy"], "pick a run where the two differ"
    expected = results["eval_ema_accuracy" if final == "weight average" else "eval_accuracy"]
    assert saved["weights"] == final and accuracy == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("final", ["live", "weight average"])
def test_the_classification_png_and_table_are_of_the_weights_saved_as_the_final_model(tmp_path, monkeypatch, capsys,
                                                                                      final):
    """ClassificationFinish plotted ClassificationMetrics' last confusion matrix, which the weight average's
    evaluation (run after the live one's) had written, and printed the live weights' per-class numbers beside it:
    the png was the average's while the live weights were saved. Both are now of the saved weights, as
    report/confusion_matrix.json is (the plot captured: the png's drawing is matplotlib's)."""
    from torch.utils.data import DataLoader

    from accel_train import train
    from accel_train.tasks.vision import classification

    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=g)
    y = (x @ torch.randn(6, 6, generator=g)).argmax(-1)
    rows = [{"x": a, "labels": b} for a, b in zip(x, y, strict=True)]
    names = ["a", "b", "c", "d", "e", "f"]
    metrics_fn = classification.ClassificationMetrics(names)
    out = tmp_path / "run"
    plotted = []
    monkeypatch.setattr(classification, "save_confusion_matrix", lambda confusion, *_, **__: plotted.append(confusion))

    def loss_fn(model, batch):
        logits = model(batch["x"])
        return {"loss": torch.nn.functional.cross_entropy(logits, batch["labels"]), "logits": logits}

    config = TrainConfig(output_dir=str(out), report_to=["none"], disable_tqdm=True, run_report=False,
                         per_device_train_batch_size=4, num_train_epochs=1, learning_rate=0.5, ema_decay=0.99,
                         eval_strategy="epoch",
                         save_strategy="no", save_ema_as_final=final == "weight average")
    reset_accelerate()
    torch.manual_seed(0)
    result = train(torch.nn.Linear(6, 6), DataLoader(rows[:64], batch_size=4, shuffle=True), config=config,
                   eval_loader=DataLoader(rows[64:], batch_size=8), loss_fn=loss_fn, metrics_fn=metrics_fn,
                   hooks=[classification.ClassificationFinish("validation", False, metrics_fn, names, str(out))])
    live, average = result.metrics["eval_accuracy"], result.metrics["eval_ema_accuracy"]
    assert live != average, "pick a run where the two differ"
    expected = average if final == "weight average" else live
    saved = json.loads((out / "report" / "confusion_matrix.json").read_text())
    assert saved["weights"] == final and plotted[-1].tolist() == saved["matrix"]
    assert plotted[-1].trace() / plotted[-1].sum() == pytest.approx(expected, abs=1e-6)
    assert f"eval top-1 accuracy {expected:.2%}" in capsys.readouterr().out


def averaging(out, processes, *extra):
    """toy_train's flags: averaging, checkpointing every 4 steps, logging every step (so that --stop_at_step can cut
    at any step), the same global batch of 4 on 1 process and on 2."""
    batch = str(4 // processes)
    return ["--output_dir", str(out), *QUIET, "--num_train_epochs", "3", "--dropout", "0.2", "--ema_decay", "0.95",
            "--save_ema_as_final", "--save_strategy", "steps", "--save_steps", "4", "--eval_strategy", "epoch",
            "--logging_steps", "1", "--per_device_train_batch_size", batch, *extra]


@pytest.mark.parametrize("processes", [1, 2])
def test_a_run_with_an_average_resumes_bitwise(tmp_path, ranks, processes):
    """In this process (1) or on the session's two gloo ranks (2): the whole run, and the run cut after step 10
    (inside the first epoch of 24 steps) then resumed with latest from step 8's checkpoint, as after a SIGKILL: steps 9
    and 10 are trained again. What is under test is the average's state in the checkpoint, and that the average the
    cut run went on to build is not the one resumed; a SIGKILL itself is tests/rundir/test_reliability.py's."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    stop_then_resume(lambda out, *more: toy_on(ranks, averaging(out, processes, *more), processes), full, cut, 10, 8)
    assert [r["step"] for r in toy_records(cut)[0]] == [10, 72], "cut at 10, resumed to the end of 72 steps"
    a, b = load_file(full / "model.safetensors"), load_file(cut / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0, "the final average differs after the resume"
    ema = [[r["eval_ema_loss"] for r in read_jsonl(d / "metrics.jsonl") if "eval_ema_loss" in r] for d in (full, cut)]
    assert ema[0][-1] == ema[1][-1]


def test_averaging_refuses_what_it_cannot_do(tmp_path, capsys):
    def fails(argv, *fragments):
        reset_accelerate()
        with pytest.raises(SystemExit) as exit_info:
            run_cli(toy_train.main, argv)
        assert exit_info.value.code == 2
        message = capsys.readouterr().err
        assert all(f in message for f in fragments) and "Traceback" not in message, message

    out = ["--output_dir", str(tmp_path / "run"), *QUIET]
    fails([*out, "--save_ema_as_final"], "--save_ema_as_final needs an average", "--ema_decay")
    fails([*out, "--ema_decay", "1.0"], "--ema_decay=1.0", "must be in [0, 1)")
    run([*out, "--save_strategy", "steps", "--save_steps", "4"])  # a run without an average
    fails([*out, "--save_strategy", "steps", "--save_steps", "4", "--ema_decay", "0.9", "--resume_from_checkpoint",
           "latest"], "holds no weight average", "without --ema_decay")
    with pytest.raises(ConfigError, match="under DEEPSPEED: ZeRO-3 keeps no weights in the module"):
        from accel_train.core.ema import REFUSED_ENGINES, weight_average

        class DeepSpeed:  # what weight_average reads off an Accelerator under DeepSpeed
            class distributed_type:
                value = REFUSED_ENGINES[0]

        weight_average(DeepSpeed(), torch.nn.Linear(2, 2), TrainConfig(ema_decay=0.9))
