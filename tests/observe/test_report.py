"""Run reports: the PNGs exist, decode and hold the run's series; the report is rebuilt on demand and runs are
compared by the CLI; a 2-process run's report and diagnostics (on the session's spawned gloo ranks). The trackers
are in test_trackers.py."""

import json
import shutil

import numpy as np
import pytest
import toy_train
from conftest import read_jsonl, reset_accelerate, toy_on
from PIL import Image

from accel_train.cli import main as cli
from accel_train.observe.report.plots import read_series, series_by_label

RUN = ["--report_to", "none", "--disable_tqdm", "--run_report", "true", "--num_train_epochs", "2",
       "--per_device_train_batch_size", "8",
       "--learning_rate", "0.01", "--warmup_steps", "3", "--logging_steps", "2", "--eval_strategy", "epoch",
       "--save_strategy", "no"]
PLOTS = ("loss", "learning_rate", "lr_schedule", "grad_norm", "throughput", "metrics", "confusion_matrix", "grad_flow",
         "activations")


def run_toy(out, *args):
    reset_accelerate()
    toy_train.main(["--output_dir", str(out), *RUN, *args])
    return out


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("report") / "run"
    return run_toy(out, "--grad_flow_steps", "6", "--activation_stats_steps", "12")


def points(series):
    return list(zip(series["x"], series["y"], strict=True))


def test_report_pngs_decode_and_hold_the_run_series(toy_run):
    report = (toy_run / "report.md").read_text()
    history = read_jsonl(toy_run / "metrics.jsonl")
    train = [r for r in history if "loss" in r]
    evals = [r for r in history if "eval_loss" in r]
    for name in PLOTS:
        assert f"(report/{name}.png)" in report
        with Image.open(toy_run / "report" / f"{name}.png") as image:
            assert image.format == "PNG" and image.width >= 400
            assert len(np.unique(np.asarray(image.convert("L")))) > 10  # something is drawn
    loss = series_by_label(toy_run / "report" / "loss.png")
    assert points(loss["train loss"]) == [(r["step"], pytest.approx(r["loss"])) for r in train]
    assert points(loss["eval loss"]) == [(r["step"], pytest.approx(r["eval_loss"])) for r in evals]
    lr = series_by_label(toy_run / "report" / "learning_rate.png")
    assert points(lr["learning rate (logged)"]) == [(r["step"], pytest.approx(r["learning_rate"])) for r in train]
    simulated = dict(points(lr["schedule simulated before step 0 (group 0)"]))
    assert [pytest.approx(simulated[r["step"]]) for r in train] == [r["learning_rate"] for r in train]
    assert simulated[3] == pytest.approx(0.01) and simulated[24] == pytest.approx(0.0)  # warmup 3, 24 steps
    norm = series_by_label(toy_run / "report" / "grad_norm.png")
    assert points(norm["grad norm"]) == [(r["step"], pytest.approx(r["grad_norm"])) for r in train]
    assert points(series_by_label(toy_run / "report" / "metrics.png")["eval_accuracy"]) == \
        [(r["step"], pytest.approx(r["eval_accuracy"])) for r in evals]
    throughput = series_by_label(toy_run / "report" / "throughput.png")
    assert points(throughput["samples per second"]) == \
        [(r["step"], pytest.approx(r["samples_per_second"])) for r in train]


def test_the_gradient_norm_plot_draws_the_clipping_that_ran(tmp_path):
    """The threshold line is config.yaml's record of the clipping that ran (what_ran), which a DeepSpeed JSON may
    set beside --max_grad_norm at its default (the line was drawn at the flag's 1.0); a run without the record
    draws the flag's."""
    import yaml

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0, "grad_norm": 0.8}) + "\n"
                                                    for s in (1, 2)))
    config = {"max_grad_norm": 1.0, "what_ran": {"clipping": {"max_grad_norm": 0.5, "set_by": "DeepSpeed's config"}}}
    for record, threshold in ((config, 0.5), ({"max_grad_norm": 1.0}, 1.0)):
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(record))
        assert cli(["report", str(tmp_path)]) == 0
        panel = read_series(tmp_path / "report" / "grad_norm.png")["panels"][0]
        assert panel["hlines"] == {f"clipping threshold {threshold:g}": threshold}


def test_confusion_matrix_is_the_last_evaluation(toy_run):
    results = json.loads((toy_run / "all_results.json").read_text())
    matrix = np.array(read_series(toy_run / "report" / "confusion_matrix.png")["matrix"])
    assert matrix.shape == (2, 2) and matrix.sum() == results["eval_samples"] == 37
    assert np.trace(matrix) / matrix.sum() == pytest.approx(results["eval_accuracy"])


def test_gradient_flow_plot_holds_the_recorded_norms(toy_run):
    records = read_jsonl(toy_run / "diagnostics" / "grad_flow.jsonl")
    assert [r["step"] for r in records] == [6, 12, 18, 24]
    flow = series_by_label(toy_run / "report" / "grad_flow.png")
    for record in records:
        expected = [record["norms"][n] / record["sizes"][n] ** 0.5 for n in ("0", "3")]
        assert flow[f"step {record['step']}"]["y"] == pytest.approx(expected)
    assert "**Gradient flow**: 4 recorded step(s), 2 layers" in (toy_run / "report.md").read_text()


def test_report_rebuilt_on_demand(toy_run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(toy_run, copy)
    (copy / "report.md").unlink()
    for png in (copy / "report").glob("*.png"):
        if png.name != "lr_schedule.png":  # drawn at the start of a run, kept
            png.unlink()
    assert cli(["report", str(copy)]) == 0
    assert (copy / "report.md").read_text().startswith("# Run report: copy")
    rebuilt, original = read_series(copy / "report" / "loss.png"), read_series(toy_run / "report" / "loss.png")
    assert rebuilt["panels"] == original["panels"] and rebuilt["title"] == "loss: copy"
    assert cli(["report", str(tmp_path / "nothing")]) == 2
    assert "is not a run directory" in capsys.readouterr().err


def test_compare_overlays_runs(toy_run, tmp_path):
    other = run_toy(tmp_path / "other", "--learning_rate", "0.05")
    out = tmp_path / "cmp"
    assert cli(["compare", str(toy_run), str(other), "-o", str(out)]) == 0
    loss = series_by_label(out / "loss.png")
    assert set(loss) == {"run train", "run eval", "other train", "other eval"}
    for name, path in (("run", toy_run), ("other", other)):
        history = [r for r in read_jsonl(path / "metrics.jsonl") if "loss" in r]
        assert loss[f"{name} train"]["y"] == pytest.approx([r["loss"] for r in history])
    written = {p.name for p in out.iterdir()}
    assert {"learning_rate.png", "grad_norm.png", "samples_per_second.png", "metrics.png"} <= written
    compare = (out / "compare.md").read_text()
    assert "| learning_rate | 0.01 | 0.05 |" in compare and "| eval_accuracy |" in compare


def test_nlp_recipe_report(tiny_bert, sst_like, tmp_path):
    import nlp_finetune

    out = tmp_path / "nlp"
    reset_accelerate()
    nlp_finetune.main(["--model_name_or_path", str(tiny_bert), "--train_file", str(sst_like["train"]),
                       "--validation_file", str(sst_like["dev"]), "--output_dir", str(out), "--report_to", "none",
                       "--disable_tqdm", "--num_train_epochs", "2", "--learning_rate", "3e-3", "--max_seq_length", "32",
                       "--per_device_train_batch_size", "8", "--save_strategy", "no", "--load_best_model_at_end",
                       "false"])
    findings = json.loads((out / "report" / "preflight.json").read_text())["findings"]
    assert [f for f in findings if f["level"] != "ok"] == []  # the shipped recipe passes clean
    assert any("labels within 0..1 (2 classes, from the logits)" in f["message"] for f in findings)
    confusion = read_series(out / "report" / "confusion_matrix.png")
    assert confusion["labels"] == ["0", "1"] and np.array(confusion["matrix"]).sum() == 40
    report = (out / "report.md").read_text()
    from accel_train.core.accelerator import native_bf16

    precision = "bf16 autocast on cpu" if native_bf16() else "fp32"  # the recipe's default, auto, on this machine
    assert f"| precision | {precision} |" in report and "BertForSequenceClassification" in report


def test_two_processes_report_and_diagnostics(tmp_path, ranks):
    """toy_train on the session's 2 spawned gloo ranks."""
    out = tmp_path / "ddp"
    toy_on(ranks, ["--output_dir", str(out), *RUN, "--grad_flow_steps", "3", "--profile_steps", "2-2",
                   "--memory_snapshot_step", "2"], processes=2)
    info = json.loads((out / "report" / "run_info.json").read_text())
    assert info["world_size"] == 2 and info["distributed_type"] == "MULTI_CPU"
    findings = json.loads((out / "report" / "preflight.json").read_text())["findings"]
    assert [f for f in findings if f["level"] != "ok"] == [] and len({f["check"] + f["message"] for f in findings}) \
        == len(findings)  # the ranks' findings merged, not doubled
    assert "global batch 16 = 8 per device x 2 process(es)" in " ".join(f["message"] for f in findings)
    flow = read_jsonl(out / "diagnostics" / "grad_flow.jsonl")
    assert [r["step"] for r in flow] == [3, 6, 9, 12]  # main process only, once per recorded step
    for rank in (0, 1):  # every process traces and snapshots its own memory
        assert len(list((out / "profiler").glob(f"rank{rank}.*.pt.trace.json"))) == 1
        assert (out / "diagnostics" / f"memory_step2_rank{rank}.json").exists()
    assert "| world size | 2 process(es), MULTI_CPU |" in (out / "report.md").read_text()
