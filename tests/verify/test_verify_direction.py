"""The direction of step 1's gradient in `accel-train verify`'s accumulation and world-size checks: the opt-in record
(ACCEL_TRAIN_RECORD_GRADIENT=1, observe/gradient_record.py), its comparison (verify/gradients.py), a seeded bug that
only the direction shows (tests/scripts/verify/sorted_rows.py: equal loss and gradient norm by construction) and the
certificate's section in the reference run's own report.md. Variants run in this process (1 process) or on the
session's two gloo ranks (2), through checks.Runs' runner seam (test_verify_in_process.py's verify_here).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import toy_main
from safetensors.torch import load_file, save_file
from test_verify_in_process import BUGS, verify_here

from accel_train.observe.gradient_record import VARIABLE, GradientRecorder, gradient_file
from accel_train.observe.report import write_report as write_run_report
from accel_train.rundir.checkpoint import MANIFEST, TRAIN_STATE
from accel_train.verify import CERTIFICATE, parse_args
from accel_train.verify.checks import (
    ACCUMULATION_GRADIENT_RTOL,
    ACCUMULATION_RTOL,
    FP32_GRADIENT_RTOL,
    FP32_RTOL,
    Runs,
    bounds,
)
from accel_train.verify.command import write_certificate
from accel_train.verify.diagnose import GRADIENT_DIRECTION
from accel_train.verify.gradients import gradient_direction
from accel_train.verify.report import BEGIN, END, SECTION, add_to_run_report, write_report
from accel_train.verify.runs import Variant
from accel_train.verify.world import WORLD_GRADIENT_RTOL, WORLD_SIZE_RTOL

SORTED_ROWS = BUGS / "sorted_rows.py"


def whole_relative(a, b) -> float:
    """||a - b|| / ||b|| over every tensor of two recorded gradients, computed here again from the files."""
    difference = sum(float((a[n].double() - b[n].double()).square().sum()) for n in b)
    return math.sqrt(difference / sum(float(b[n].double().square().sum()) for n in b))


def test_a_sorted_collator_is_seen_by_the_gradient_direction_only_and_its_twin_passes(tmp_path, capsys):
    """sorted_rows.py: the labels left unsorted by a collator that sorts the rows; accumulation, 2 x 8 rows against
    16, one step each in this process. Step 1's loss (log 4) and gradient norm agree within ACCUMULATION_RTOL by
    construction, so the loss-and-norm check passed this bug; the whole gradient differs by 0.90 of its norm
    (cosine 0.59). The twin's gradients agree within 1e-6."""
    code, certificate = verify_here(None, tmp_path / "bug", SORTED_ROWS, "accumulation")
    result = certificate["checks"]["accumulation"]
    assert (code, result["status"], result["cause"]) == (1, "failed", GRADIENT_DIRECTION)
    measured = result["measured"]
    assert measured["loss_relative"] <= ACCUMULATION_RTOL and measured["grad_norm_relative"] <= ACCUMULATION_RTOL
    assert measured["gradient_relative"] > 25 * ACCUMULATION_GRADIENT_RTOL and measured["gradient_cosine"] < 0.9
    assert (measured["gradient_values"], measured["gradient_only_one_side"]) == (4 * 64 + 4, [])
    micro = load_file(gradient_file(tmp_path / "bug" / "accumulation-micro"))
    full = load_file(gradient_file(tmp_path / "bug" / "accumulation-full"))
    assert sorted(micro) == ["bias", "weight"]  # the bare model's names, one file per variant
    assert whole_relative(micro, full) == pytest.approx(measured["gradient_relative"], rel=1e-9)  # re-derivable
    assert "the gradients point elsewhere" in result["diagnosis"] and "What to change" in result["diagnosis"]
    assert f"accumulation failed ({GRADIENT_DIRECTION})" in capsys.readouterr().out
    assert "relative L2, cosine 0.59" in (tmp_path / "bug" / "report.md").read_text()

    code, certificate = verify_here(None, tmp_path / "twin", SORTED_ROWS, "accumulation", "--fixed", "true")
    result = certificate["checks"]["accumulation"]
    assert (code, result["status"]) == (0, "passed")
    assert result["measured"]["gradient_relative"] <= 1e-6 and result["measured"]["gradient_cosine"] > 1 - 1e-9


def test_the_record_is_opt_in_and_changes_nothing_the_run_computes(tmp_path, monkeypatch):
    """toy_train, 3 steps with accumulation 2, in this process: without ACCEL_TRAIN_RECORD_GRADIENT no file; with it
    one file holding step 1's gradient, and the same losses and final weights bitwise as without."""
    args = ["--max_steps", "3", "--gradient_accumulation_steps", "2", "--logging_steps", "1", "--report_to", "none",
            "--save_strategy", "no", "--eval_strategy", "no", "--max_grad_norm", "0.01"]
    monkeypatch.delenv(VARIABLE, raising=False)
    toy_main([*args, "--output_dir", str(tmp_path / "off")])
    monkeypatch.setenv(VARIABLE, "1")
    toy_main([*args, "--output_dir", str(tmp_path / "on")])
    assert not gradient_file(tmp_path / "off").exists() and not (tmp_path / "off" / "diagnostics").exists()
    grads = load_file(gradient_file(tmp_path / "on"))
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads.values())
    # recorded before clipping: --max_grad_norm 0.01 clips step 1, the file keeps the norm the loop logged
    logged = [json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in logged if r.get("step") == 1 and "grad_norm" in r)
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
    assert norm == pytest.approx(first["grad_norm"], rel=1e-5) and norm > 0.01
    losses = [(tmp_path / run / "metrics.jsonl").read_text() for run in ("off", "on")]
    assert [json.loads(line).get("loss") for line in losses[0].splitlines()] == \
        [json.loads(line).get("loss") for line in losses[1].splitlines()]
    weights = [load_file(tmp_path / run / "model.safetensors") for run in ("off", "on")]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])


def test_the_comparison_counts_a_missing_gradient_as_zero_and_says_why_none_was_compared(tmp_path):
    """Files written here: a parameter with a gradient on one side only counts as zero on the other and is named; a
    run whose record was skipped (FSDP / DeepSpeed) or is missing is not compared, with the reason."""
    for run, tensors in (("a", {"w": torch.tensor([3.0, 0.0]), "extra": torch.tensor([4.0])}),
                         ("b", {"w": torch.tensor([3.0, 4.0])})):
        gradient_file(tmp_path / run).parent.mkdir(parents=True)
        save_file(tensors, str(gradient_file(tmp_path / run)))
    measured = gradient_direction(tmp_path / "a", tmp_path / "b")
    # a - b = (0, -4, 4): sqrt(32) / 5; a . b = 9 over |a| = 5, |b| = 5
    assert measured["gradient_relative"] == pytest.approx(math.sqrt(32) / 5)
    assert measured["gradient_cosine"] == pytest.approx(9 / 25)
    assert measured["gradient_only_one_side"] == ["extra"]
    gradient_file(tmp_path / "sharded").parent.mkdir(parents=True)
    save_file({}, str(gradient_file(tmp_path / "sharded")), metadata={"skipped": "under FSDP each process holds a "
                                                                                 "shard"})
    assert gradient_direction(tmp_path / "sharded", tmp_path / "b") == {
        "gradient_not_compared": "sharded: under FSDP each process holds a shard"}
    assert "did not reach an optimizer step" in gradient_direction(tmp_path / "b", tmp_path / "none")[
        "gradient_not_compared"]


def certificate_document(tmp_path, status: str) -> dict:
    differs = {"step": 2} if status == "failed" else None
    check = {"status": status, "measured": {"steps_compared": 6, "first_loss_difference": differs,
                                            "tensors_differing": 3 if differs else 0},
             "tolerance": {"loss": "bitwise"}, "variants": ["reference", "repeat"]}
    return {"script": "job.py", "script_args": [], "passed": status != "failed", "exit_code": int(status == "failed"),
            "steps": 6, "accumulation_steps": 2, "checks": {"determinism": check},
            "variants": {"reference": {"output_dir": str(tmp_path / "reference"), "processes": 1, "attempts": []},
                         "repeat": {"output_dir": str(tmp_path / "repeat"), "processes": 1, "attempts": []}}}


def test_the_certificate_is_a_section_of_the_reference_runs_report_replaced_when_verify_writes_it_again(tmp_path):
    """Run directories written here: verify's report goes into DIR/reference/report.md after the run report's own
    sections, its variants linked from there; written again, the section is replaced, not repeated, and what the run
    report holds around it stays. Without a run report (--run_report false) nothing is written there."""
    (tmp_path / "repeat").mkdir()
    (tmp_path / "repeat" / "report.md").write_text("# repeat\n")
    run_report = tmp_path / "reference" / "report.md"
    assert not add_to_run_report(certificate_document(tmp_path, "passed"), run_report)
    run_report.parent.mkdir()
    run_report.write_text("# Run report\n\n## Results\n\n| | |\n")
    write_report(certificate_document(tmp_path, "passed"), tmp_path)
    first = run_report.read_text()
    assert first.startswith("# Run report\n\n## Results\n") and first.count(SECTION) == 1
    assert "### determinism: PASSED" in first and "[repeat](../repeat/report.md)" in first
    assert (tmp_path / "report.md").read_text().count(SECTION) == 1  # DIR/report.md is kept, links beside it
    assert "[repeat](repeat/report.md)" in (tmp_path / "report.md").read_text()
    run_report.write_text(first + "\nwritten after the section\n")
    write_report(certificate_document(tmp_path, "failed"), tmp_path)
    again = run_report.read_text()
    assert again.count(SECTION) == again.count(BEGIN) == again.count(END) == 1
    assert "### determinism: FAILED" in again and "PASSED" not in again
    assert again.startswith("# Run report\n\n## Results\n") and again.endswith("\nwritten after the section\n")
    # `accel-train report` writes the run's report afresh from its files: the certificate's section stays, once
    (run_report.parent / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    for _ in range(2):
        rewritten = write_run_report(run_report.parent).read_text()
        assert rewritten.startswith("# Run report") and "## Results" not in rewritten  # the run report's own text
        assert rewritten.count(SECTION) == rewritten.count(BEGIN) == rewritten.count(END) == 1
        assert "### determinism: FAILED" in rewritten and rewritten.endswith(END + "\n")


def test_the_certificate_is_strict_json_with_a_non_finite_difference(tmp_path):
    """A relative difference against 0 is infinite and a failed run's NaN: verify.json holds them as the strings
    float() reads back (strict readers refuse bare NaN / Infinity), and the report rendered from it formats them."""
    document = certificate_document(tmp_path, "failed")
    document["checks"]["accumulation"] = {
        "status": "failed", "measured": {"loss_relative": float("inf"), "grad_norm_relative": float("nan")},
        "tolerance": {"loss": "relative 0.001"}, "variants": ["accumulation-micro"]}
    path = tmp_path / CERTIFICATE
    write_certificate(path, document)
    strict = json.loads(path.read_text(), parse_constant=lambda token: pytest.fail(f"bare {token} in verify.json"))
    assert strict["checks"]["accumulation"]["measured"] == {"loss_relative": "Infinity", "grad_norm_relative": "NaN"}
    assert "| accumulation | failed | loss inf, grad_norm nan relative (tolerance relative 0.001) |" in \
        (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_the_world_size_check_sees_the_sorted_collator_by_the_gradient_direction(tmp_path, ranks):
    """sorted_rows.py, world_size only, 3 steps: the reference (8 rows, in this process, with its run report) against
    2 processes of 4 rows (the ranks); each process sorts its own rows, so the labels go to other rows than in one
    process: step 1's loss and gradient norm agree, the whole gradient does not (and step 2's loss follows). The twin
    passes. The certificate is a section of the reference's report.md."""
    code, certificate = verify_here(ranks, tmp_path / "bug", SORTED_ROWS, "world_size", "--run_report", "true",
                                    steps=3)
    result = certificate["checks"]["world_size"]
    assert (code, result["status"], result["cause"]) == (1, "failed", GRADIENT_DIRECTION)
    measured = result["measured"]
    # step 1 agrees in loss and norm; the updates that followed the turned gradient move step 2's loss
    assert measured["losses_by_step"]["1"] <= WORLD_SIZE_RTOL and measured["grad_norm_relative"] <= WORLD_SIZE_RTOL
    assert measured["first_loss_difference"]["step"] == 2
    assert measured["gradient_relative"] > 25 * WORLD_GRADIENT_RTOL and measured["gradient_cosine"] < 0.5
    assert gradient_file(tmp_path / "bug" / "reference").is_file()  # the 1-process side recorded it
    report = (tmp_path / "bug" / "reference" / "report.md").read_text()
    assert report.count(SECTION) == 1 and f"**world_size: failed ({GRADIENT_DIRECTION}).**" in report
    code, certificate = verify_here(ranks, tmp_path / "twin", SORTED_ROWS, "world_size", "--fixed", "true", steps=3)
    result = certificate["checks"]["world_size"]
    assert (code, result["status"]) == (0, "passed") and result["measured"]["gradient_relative"] <= 1e-6
    assert os.environ.get(VARIABLE) is None  # the runner's environment is put back


def test_the_recorder_divides_by_the_fp16_loss_scale_and_skips_a_sharded_gradient_saying_why(tmp_path):
    """The recorder on a stand-in accelerator (no run): under an fp16 loss scaler the saved gradient is the unscaled
    one the optimizer steps with; under FSDP the file holds no tensor, its reason, which the comparison reports; only
    step 1 is saved, and only by the main process."""
    model = torch.nn.Linear(2, 1)
    model.weight.grad, model.bias.grad = torch.full((1, 2), 1024.0), torch.tensor([2048.0])
    scaler = SimpleNamespace(get_scale=lambda: 1024.0)

    def accelerator(kind: str, main: bool = True):
        return SimpleNamespace(unwrap_model=lambda m: m, is_main_process=main, scaler=scaler,
                               distributed_type=SimpleNamespace(value=kind))

    GradientRecorder(accelerator("MULTI_GPU", main=False), model, tmp_path / "other").before_clip(1)
    recorder = GradientRecorder(accelerator("MULTI_GPU"), model, tmp_path / "ddp")
    recorder.before_clip(2)
    assert not gradient_file(tmp_path / "ddp").exists() and not gradient_file(tmp_path / "other").exists()
    recorder.before_clip(1)
    saved = load_file(gradient_file(tmp_path / "ddp"))
    assert torch.equal(saved["weight"], torch.ones(1, 2)) and torch.equal(saved["bias"], torch.tensor([2.0]))
    assert model.weight.grad[0, 0] == 1024.0  # the run's own gradient untouched
    GradientRecorder(accelerator("FSDP"), model, tmp_path / "fsdp").before_clip(1)
    assert load_file(gradient_file(tmp_path / "fsdp")) == {}
    assert gradient_direction(tmp_path / "fsdp", tmp_path / "ddp") == {
        "gradient_not_compared": "fsdp: under FSDP each process holds a shard of the gradient: no whole gradient to "
                                 "record"}


def test_only_the_variants_a_direction_is_judged_on_record_their_gradient(tmp_path):
    """What each variant's environment gets (no run: a runner that keeps it): the accumulation and world-size sides
    record; the reference only when it may be the world-size check's 1-process side (not with --world_size_args,
    which give that side a run of its own); the other checks' variants never."""
    def asked(*flags) -> dict:
        verify = parse_args(["--output_dir", str(tmp_path), *flags, "--", str(SORTED_ROWS)])
        seen = {}

        def runner(verify, name, interrupts, env=None, **more):
            seen[name] = (env or {}).get(VARIABLE)
            return Variant(name, [], tmp_path / name, env or {}, returncode=0, attempts=[{"status": {"exit": 0}}])

        runs = Runs(verify, None, runner)
        for name in ("reference", "repeat", "accumulation-micro", "world-size-one", "world-size", "precision"):
            with contextlib.suppress(Exception):  # require_finished reads files these runs did not write
                runs.finished(name)
        return seen

    assert asked() == {"reference": "1", "repeat": None, "accumulation-micro": "1", "world-size-one": "1",
                       "world-size": "1", "precision": None}
    assert asked("--world_size_args", "--seed 3")["reference"] is None
    assert asked("--checks", "determinism,accumulation")["reference"] is None


def test_the_bounds_are_fp32s_only_when_every_side_trained_in_fp32(tmp_path):
    """Checkpoints written here: two sides that recorded fp32 are held to FP32_RTOL and FP32_GRADIENT_RTOL (rounding
    of about 1e-7); a side in bf16 autocast, or one that recorded no precision (no checkpoint), keeps the bounds
    bf16's rounding set."""
    def run(name: str, precision: str | None) -> Path:
        checkpoint = tmp_path / name / "checkpoints" / "step-00000001"
        checkpoint.mkdir(parents=True)
        (checkpoint / MANIFEST).write_text("{}")
        (checkpoint / TRAIN_STATE).write_text(json.dumps({} if precision is None else {"precision": precision}))
        return tmp_path / name

    low = (ACCUMULATION_RTOL, ACCUMULATION_GRADIENT_RTOL)
    fp32, bf16, silent = run("a", "fp32"), run("b", "bf16 autocast on cpu"), run("c", None)
    assert bounds(low, fp32, run("d", "fp32")) == (FP32_RTOL, FP32_GRADIENT_RTOL, "fp32")
    assert bounds(low, fp32, bf16) == (*low, "bf16 autocast on cpu, fp32")
    assert bounds(low, fp32, silent) == (*low, "fp32, unrecorded precision")
    assert bounds(low, fp32, tmp_path / "never-ran") == (*low, "fp32, unrecorded precision")
    assert FP32_RTOL < ACCUMULATION_RTOL / 10 and FP32_GRADIENT_RTOL < ACCUMULATION_GRADIENT_RTOL / 10
