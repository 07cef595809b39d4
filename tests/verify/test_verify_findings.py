"""verify's findings from what the variants left, without running anything: run directories, logs and statuses are
written here by a runner of checks.Runs's signature (no process, no training). What the 7 recipes' certificates
(benchmarks/verify_recipes.py) showed the checks must say: a script that refuses accumulation, a BatchNorm model under
accumulation; a crash whose log names its cause. And the certificate's section of a run report (report.md).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SCRIPTS
from safetensors.torch import save_file

from accel_train.verify import parse_args
from accel_train.verify.checks import Result, Runs, accumulation
from accel_train.verify.command import certificate
from accel_train.verify.crashes import UNUSED_PARAMETERS, recognised_crash
from accel_train.verify.diagnose import BATCH_NORM_ACCUMULATION, EVALUATION_BATCH, OTHER_EXAMPLES
from accel_train.verify.evaluation import evaluation
from accel_train.verify.report import figure, render, write_report
from accel_train.verify.runs import Variant

TOY = SCRIPTS / "toy_train.py"
REFUSAL = ("--gradient_accumulation_steps 2: a contrastive loss computed per micro-batch sees 2x fewer negatives than "
           "the batch it stands for, so it is refused.")


def written(plans: dict):
    """A runner that writes each named variant's run directory from `plans[name]`: step 1's loss and grad_norm
    (metrics.jsonl: "loss", "norm"), config.yaml ("config", else the batch (8) and accumulation asked), the weights'
    names (model.safetensors: "weights"), all_results.json ("results"), what it fed ("fed": epoch 0's micro-batches
    and how many made step 1) and a checkpoint at the last step (the precision it trained in: "precision", fp32);
    "refused":
    the run exits 2 with that message in its status, as run_cli writes it for a ConfigError."""
    def runner(verify, name, interrupts, env=None, script_args=(), processes=1, **more) -> Variant:
        plan, out = plans[name], verify.output_dir / name
        out.mkdir(parents=True)
        if "refused" in plan:
            status = {"exit": 2, "kind": "config error", "message": plan["refused"]}
            return Variant(name, [], out, {}, processes, returncode=2, attempts=[{"status": status, "log": None}])
        (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": plan.get("loss", 1.0),
                                                       "grad_norm": plan.get("norm", 1.0)}))
        config = plan.get("config") or {"per_device_train_batch_size": more.get("per_device_train_batch_size", 8),
                                        "gradient_accumulation_steps": more.get("gradient_accumulation_steps")}
        (out / "config.yaml").write_text(json.dumps(config))
        save_file({name: torch.ones(2) for name in plan.get("weights", ["w"])}, str(out / "model.safetensors"))
        (out / "all_results.json").write_text(json.dumps(plan.get("results", {})))
        if "fed" in plan:  # what the process fed (observe/fed_record.py): epoch 0's plan, step 1 = its first n
            batches, n = plan["fed"]
            (out / "diagnostics").mkdir()
            (out / "diagnostics" / "fed_rank0.jsonl").write_text(
                json.dumps({"plan": 0, "batches": batches}) + "\n" + json.dumps({"step": 1, "segments": [[0, 0, n]]}))
        checkpoint = out / "checkpoints" / f"step-{more.get('max_steps', verify.steps):08d}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "train_state.json").write_text(json.dumps({"precision": plan.get("precision", "fp32")}))
        return Variant(name, [], out, {}, processes, returncode=0, attempts=[{"status": {"exit": 0}, "log": None}])
    return runner


def accumulation_on(tmp_path, plans: dict):
    verify = parse_args(["--checks", "accumulation", "--output_dir", str(tmp_path), "--", str(TOY)])
    return accumulation(Runs(verify, None, written(plans)))


def test_a_script_that_refuses_accumulation_makes_the_check_not_applicable(tmp_path):
    """The multimodal recipes' losses couple the batch and refuse --gradient_accumulation_steps > 1 (exit 2): the
    accumulation check is not applicable, with the script's own reason (it stopped verify with exit code 2)."""
    result = accumulation_on(tmp_path, {"accumulation-micro": {"refused": REFUSAL}})
    assert result.status == "not applicable"
    assert result.measured["reason"] == f"the script refuses --gradient_accumulation_steps 2: {REFUSAL}"


def test_accumulation_shares_the_world_size_checks_one_batch_where_their_flags_agree(tmp_path):
    """With world_size asked too and the same flags of their own, the accumulation check's one batch is the world-size
    check's 1-process run, compared at its step 1 (k micro-batches of G/k against G): one variant fewer (the main
    job's README command: 10 variants, not 11). Where the flags differ, or the reference accumulates by itself, it
    is a 1-step run of its own at k x B, as before."""
    def sides(name: str, *flags: str, reference_config: dict | None = None):
        out = tmp_path / name
        verify = parse_args(["--checks", "determinism,accumulation,world_size", "--output_dir", str(out), *flags,
                             "--", str(TOY)])
        plans = {"reference": {"config": reference_config or {"per_device_train_batch_size": 8}},
                 "accumulation-micro": {}, "accumulation-full": {}, "world-size-one": {}}
        runs = Runs(verify, None, written(plans))
        runs.finished("reference")
        return accumulation(runs)

    result = sides("same")  # no flags of their own: the reference (B = 8) is the world-size check's 1-process side
    assert result.variants == ["accumulation-micro", "reference"] and result.measured["micro_batch"] == 4
    assert "weights_max_abs" not in result.measured  # the reference went on past step 1: its weights are not step 1's
    dropout_off = "--config_overrides hidden_dropout_prob=0"
    result = sides("both", "--accumulation_args", dropout_off, "--world_size_args", dropout_off)
    assert result.variants == ["accumulation-micro", "world-size-one"] and result.measured["micro_batch"] == 4
    result = sides("one", "--accumulation_args", dropout_off)
    assert result.variants == ["accumulation-micro", "accumulation-full"] and result.measured["micro_batch"] == 8
    assert result.measured["weights_max_abs"] == 0.0
    result = sides("accumulating", reference_config={"per_device_train_batch_size": 8,
                                                     "gradient_accumulation_steps": 4})
    assert result.variants == ["accumulation-micro", "accumulation-full"]


def test_accumulation_fails_when_the_two_sides_step_held_other_examples(tmp_path):
    """The runs record which examples each step fed (ACCEL_TRAIN_RECORD_FED, set on the variants whenever accumulation
    is asked): k micro-batches whose step held other examples than the one batch of kB compare other data, whatever
    the loss and the norm say. Found on the main job at seed 3, 2 x 16 against 32: length grouping grouped by the
    micro-batch (core/data.py now groups by the optimizer step), one example of step 1 differed and the gradient
    norm 1.1e-2, reported as a loss defect."""
    verify = parse_args(["--checks", "accumulation", "--output_dir", str(tmp_path / "other"), "--", str(TOY)])
    assert verify.env == {"ACCEL_TRAIN_RECORD_FED": "1", "ACCEL_TRAIN_UNEQUAL_FIRST_STEP": "1",
                          "ACCEL_TRAIN_FIXED_BATCHES": "1"}
    # nothing recorded, the script's order; a recipe's default token budget left off in every check's runs
    assert parse_args(["--checks", "determinism", "--", str(TOY)]).env == {"ACCEL_TRAIN_FIXED_BATCHES": "1"}
    plans = {"accumulation-micro": {"fed": ([[0, 1], [2, 3], [4, 5]], 2)},
             "accumulation-full": {"fed": ([[0, 1, 2, 4], [3, 5]], 1)}}
    result = accumulation(Runs(verify, None, written(plans)))
    assert (result.status, result.cause) == ("failed", OTHER_EXAMPLES)
    assert result.measured["examples_only_in"] == {"micro-batches": [3], "one batch": [4]}
    assert "[3]" in result.diagnosis and "gradient_accumulation_steps" in result.diagnosis
    plans["accumulation-full"]["fed"] = ([[3, 2, 1, 0], [4, 5]], 1)
    result = accumulation_on(tmp_path / "same", plans)
    assert (result.status, result.measured["same_examples"]) == ("passed", True)


def test_batch_norm_under_accumulation_is_a_property_not_a_failure(tmp_path):
    """A model with BatchNorm normalises each micro-batch by its own statistics: k micro-batches of B never make the
    step one batch of kB makes (the vision recipes: it failed them). A property, as under world size; a model without
    batch-norm buffers that differs as much still fails."""
    bn = ["stem.0.weight", "stem.1.running_mean", "stem.1.running_var", "stem.1.weight"]
    plans = {"accumulation-micro": {"loss": 2.0, "norm": 1.3, "weights": bn},
             "accumulation-full": {"loss": 2.1, "norm": 1.0, "weights": bn}}
    result = accumulation_on(tmp_path / "bn", plans)
    assert (result.status, result.cause) == ("property", BATCH_NORM_ACCUMULATION)
    assert result.measured["batch_norm_layers"] == ["stem.1"] and "stem.1" in result.diagnosis
    for plan in plans.values():
        plan["weights"] = ["stem.0.weight", "stem.1.weight"]
    result = accumulation_on(tmp_path / "ln", plans)
    assert (result.status, result.cause) == ("failed", "normalisation per micro-batch")


def test_a_crash_is_named_only_from_what_its_log_says(tmp_path):
    """DDP's unfinished reduction without TORCH_DISTRIBUTED_DEBUG: the indices, and how to get the names; any other
    failure (or a refusal, exit 2) is not recognised and stays verify's error."""
    log = tmp_path / "world-size.log"
    log.write_text("RuntimeError: Expected to have finished reduction in the prior iteration before starting a new "
                   "one. ...\nParameter indices which did not receive grad for rank 1: 4 5\n In addition, you can set "
                   "the environment variable TORCH_DISTRIBUTED_DEBUG ...\n")

    def ended(code):
        return Variant("world-size", [], tmp_path, processes=2, returncode=code, attempts=[{"log": str(log)}])

    crash = recognised_crash(ended(1))
    assert crash.cause == UNUSED_PARAMETERS and crash.measured["parameter_indices"] == [4, 5]
    assert crash.measured["parameters_without_gradient"] == []
    assert "indices 4 5 of model.parameters() (rerun with TORCH_DISTRIBUTED_DEBUG=INFO" in crash.diagnosis
    assert recognised_crash(ended(2)) is None and recognised_crash(ended(0)) is None
    log.write_text("RuntimeError: out of memory\n")
    assert recognised_crash(ended(1)) is None


def test_the_certificate_is_a_section_of_a_run_report(tmp_path):
    """report.md rendered from a certificate made here (no run): the run report's Markdown, a table per check with its
    status, measured differences and tolerances, the failure's paragraph, the properties, the variants linked to their
    own run reports; rendered again from verify.json alone, the same text."""
    verify = parse_args(["--checks", "determinism,resume,accumulation,world_size", "--output_dir", str(tmp_path),
                         "--", str(TOY), "--hidden", "8"])
    runs = Runs(verify, None)
    for name in ("reference", "repeat"):
        (tmp_path / name).mkdir()
        runs.done[name] = Variant(name, ["python", str(TOY)], tmp_path / name, returncode=0,
                                  attempts=[{"returncode": 0}])
    (tmp_path / "reference" / "report.md").write_text("# Run report: reference\n")
    results = {
        "determinism": Result("passed", {"steps_compared": 6, "first_loss_difference": None, "tensors_differing": 0},
                              {"loss": "bitwise", "weights": "bitwise"}, ["reference", "repeat"]),
        "resume": Result("not applicable", {"reason": "the run is not deterministic"}, {"loss": "bitwise"}),
        "accumulation": Result("failed", {"loss_relative": 0.5, "grad_norm_relative": 0.5},
                               {"loss": "relative 0.0001", "why": "reduction order"}, ["accumulation-micro"],
                               "loss scaled by the accumulation count", "The accumulated gradient is 1/2 | of it."),
        "world_size": Result("property", {"global_batch": 8, "loss_relative": 0.07, "grad_norm_relative": 0.1,
                                          "weights_relative": 0.2}, {"loss": "relative 0.001, every logged step"},
                             ["reference", "world-size"], "per-process batch statistics (BatchNorm)", "BatchNorm."),
    }
    document = certificate(verify, results, runs)
    path = write_report(document, tmp_path)
    text = path.read_text()
    assert path == tmp_path / "report.md" and text.startswith("# Verify report: toy_train.py\n\n## Verify certificate")
    assert f"| script | {TOY} --hidden 8 |" in text and "| verdict | **FAILED** |" in text
    assert "| properties (not failures) | world_size |" in text
    assert "| accumulation | failed | loss 5.00e-01, grad_norm 5.00e-01 relative (tolerance relative 0.0001) |" in text
    assert "| resume | not applicable | the run is not deterministic |" in text
    section = text[text.index("### accumulation: FAILED"):text.index("### world_size")]
    assert "| tolerance: loss | relative 0.0001 |" in section and "| cause | loss scaled by the accumulation count |" \
        in section and "*Why this tolerance: reduction order.*" in section
    assert "**accumulation: failed (loss scaled by the accumulation count).** The accumulated gradient is 1/2 | of " \
           "it." in section
    assert "**world_size: a property of the model (per-process batch statistics (BatchNorm)).** BatchNorm." in text
    assert "| reference | 1 | [reference](reference/report.md) | 0 |" in text and "| repeat | 1 | repeat | 0 |" in text
    assert render(json.loads(json.dumps(document, default=str))) == text


def test_the_loss_of_a_loss_over_the_batch_is_not_judged_across_evaluation_batches(tmp_path):
    """The multimodal recipes' contrastive eval loss: each pair's loss has the batch's other pairs as negatives, so it
    changes with the evaluation batch and the processes while every retrieval metric (over the gathered set) agrees;
    it failed their evaluation check. When eval_loss alone differs (two evaluations in one process agreeing) and the
    script refuses accumulation (its loss couples the batch), the loss is not judged, said; the same figures from a
    script that accepts accumulation still fail (padding: outputs depend on the batch)."""
    same = {"eval_recall@1": 0.125, "eval_samples": 32.0}
    plans = {"reference": {"results": {**same, "eval_loss": 5.0}, "config": {"per_device_eval_batch_size": 256,
                                                                              "per_device_train_batch_size": 8}},
             "evaluation": {"results": {**same, "eval_loss": 4.3, "eval_again_loss": 4.3,
                                        "eval_again_recall@1": 0.125, "eval_again_samples": 32.0}},
             "evaluation-two": {"results": {**same, "eval_loss": 6.4}},
             "accumulation-micro": {"refused": REFUSAL}}
    verify = parse_args(["--checks", "evaluation", "--output_dir", str(tmp_path / "pairs"), "--", str(TOY)])
    result = evaluation(Runs(verify, None, written(plans)))
    assert result.status == "passed" and result.measured["batch_size"]["relative"] == pytest.approx(0.7 / 5)
    # the accumulation check ran first (verify's order): its refused variant is the evidence, not run again
    verify = parse_args(["--checks", "accumulation,evaluation", "--output_dir", str(tmp_path / "both"), "--",
                         str(TOY)])
    runs = Runs(verify, None, written(plans))
    assert accumulation(runs).status == "not applicable"
    assert evaluation(runs).measured["loss_not_judged"] == result.measured["loss_not_judged"]
    assert result.measured["batch_size"]["differing"] == [] and result.measured["world_size"]["differing"] == []
    assert result.measured["loss_not_judged"].startswith("the loss couples the examples of a batch (the script refuses "
                                                         "gradient accumulation: --gradient_accumulation_steps 2: a")
    assert result.variants == ["reference", "evaluation", "evaluation-two", "accumulation-micro"]
    assert figure("evaluation", result) == ("eval metrics across again 0.00e+00, batch_size 0.00e+00, world_size "
                                            "0.00e+00 relative (tolerance relative 0.0001, each eval_* metric); "
                                            "eval_loss not judged: a loss over the batch")
    plans["accumulation-micro"] = {}
    verify = parse_args(["--checks", "evaluation", "--output_dir", str(tmp_path / "padding"), "--", str(TOY)])
    result = evaluation(Runs(verify, None, written(plans)))
    assert (result.status, result.cause) == ("failed", EVALUATION_BATCH) and "loss_not_judged" not in result.measured


def test_evaluation_allows_rounding_in_every_precision_and_fails_past_it(tmp_path):
    """In bf16 autocast (the main job's default) another evaluation batch pads other shapes, and bf16 rounds to 2^-9:
    at seeds 1 and 3 the main job's eval_loss moved by 2.2e-5 and 1.2e-5 (every other metric equal); in fp32 the text
    generation recipe's source_reliance, a metric made of a small difference, moved 1.04e-5 across world sizes. Both
    failed the check once (1e-5): every precision is judged within 1e-4 (the seeded bugs move a metric by 1.8e-3 at
    least), and a difference past it fails."""
    same = {"eval_accuracy": 0.5, "eval_samples": 32.0}
    cases = (("bf16 autocast on cpu", 1.0219417, "passed"), ("fp32", 1.0219417, "passed"), ("fp32", 1.0217, "failed"))
    for number, (precision, other, status) in enumerate(cases):
        plans = {"reference": {"results": {**same, "eval_loss": 1.0219637}, "precision": precision,
                               "config": {"per_device_eval_batch_size": 64, "per_device_train_batch_size": 32}},
                 "evaluation": {"results": {**same, "eval_loss": other, "eval_again_loss": other,
                                            "eval_again_accuracy": 0.5, "eval_again_samples": 32.0}},
                 "evaluation-two": {"results": {**same, "eval_loss": 1.0219637}},
                 "accumulation-micro": {}}  # eval_loss alone differs: does the loss couple the batch? (it does not)
        verify = parse_args(["--checks", "evaluation", "--output_dir", str(tmp_path / str(number)), "--", str(TOY)])
        result = evaluation(Runs(verify, None, written(plans)))
        assert result.status == status, (precision, result.measured["batch_size"])
        assert result.measured["batch_size"]["relative"] == pytest.approx(abs(other - 1.0219637) / 1.0219637,
                                                                          rel=1e-2)
        assert result.tolerance["metrics"].startswith("relative 0.0001")
