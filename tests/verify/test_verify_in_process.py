"""`accel-train verify` on variants whose process is not what the check sees (the evaluation check's seeded bugs, the
accumulation bugs (a loss divided by hand, a per-micro-batch token mean), a generator made without a seed, an unused
parameter under DDP): run in this process (1 process) or on the session's two gloo ranks (2), through the runner seam
of checks.Runs. The statuses and the cause paragraphs are checked on run
directories written here. The real process path (a variant resumed from another run's checkpoint under `accel-train
launch`, the precision flag) is exercised once, by test_verify.py's toy_train certificate.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import sys
import traceback
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, reset_accelerate

from accel_train.verify import CERTIFICATE, main, parse_args
from accel_train.verify.checks import ACCUMULATION_RTOL, FP32_RTOL, Runs
from accel_train.verify.crashes import UNUSED_PARAMETERS
from accel_train.verify.diagnose import (
    EVALUATION_BATCH,
    EVALUATION_GATHER,
    EVALUATION_RANDOM,
    evaluation_cause,
    precision_cause,
)
from accel_train.verify.evaluation import EVALUATION_RTOL, compare_metrics, evaluation
from accel_train.verify.matrix import SAID, SPECIAL
from accel_train.verify.precision import PRECISION_RTOL, precision
from accel_train.verify.runs import Variant

BUGS = SCRIPTS / "verify"
EVAL_BUGS = BUGS / "eval_bugs.py"


def script_main(script: str, argv: list[str]) -> None:
    """The script's main(argv) in this process (the ranks run it on each rank): loaded from its file, beside its
    folder's common.py."""
    folder = str(Path(script).parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(f"verify_script_{Path(script).stem}", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass of the script looks its module up (toy_train's, token_train's)
    spec.loader.exec_module(module)
    reset_accelerate()
    # a process reads TORCH_DISTRIBUTED_DEBUG when it imports torch.distributed; the pooled ranks imported it long ago
    torch.distributed.set_debug_level_from_env()
    try:
        module.main(argv)
    finally:
        torch.distributed.set_debug_level(torch.distributed.DebugLevel.OFF)


@contextlib.contextmanager
def environment(env: dict[str, str]):
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def in_process(ranks):
    """A runner for checks.Runs (run_variant's signature): the variant's own command, its script's main called here
    for 1 process and on the two ranks for 2. A run that raises ends as a process would: exit code 1, no status, its
    traceback (each rank's) in its log under DIR/logs/."""
    def runner(verify, name, interrupts, env=None, script_args=(), processes=1, **more) -> Variant:
        out = verify.output_dir / name
        command = verify.command(out, script_args, processes, **more)
        argv = command[command.index(verify.script) + 1:]
        env = {**verify.env, **(env or {})}
        log = verify.output_dir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        printed = io.StringIO()  # what the process would print (its start-up report): its log, as run_variant's
        try:
            if processes == 1:
                with environment(env), contextlib.redirect_stdout(printed):
                    script_main(verify.script, argv)
            else:
                ranks.run(script_main, verify.script, argv, env=env)
        except Exception:  # noqa: BLE001 - what a process would print before exiting 1
            log.write_text(printed.getvalue() + traceback.format_exc())
            attempt = {"command": command, "env": env, "returncode": 1, "log": str(log), "status": {}}
            return Variant(name, command, out, env, processes, returncode=1, attempts=[attempt])
        log.write_text(printed.getvalue())
        attempt = {"command": command, "env": env, "returncode": 0, "log": str(log), "status": {"exit": 0}}
        return Variant(name, command, out, env, processes, returncode=0, attempts=[attempt])
    return runner


def verify_here(ranks, out, script, checks, *flags, steps: int = 6) -> tuple[int, dict]:
    code = main(["--checks", checks, "--steps", str(steps), "--output_dir", str(out), "--", str(script), *flags],
                runner=in_process(ranks))
    return code, json.loads((out / CERTIFICATE).read_text())


# (bug, its cause class, the comparison that sees it, those that must agree)
EVALUATION_BUGS = [
    ("dropout_in_eval", EVALUATION_RANDOM, "again", ()),
    ("ignores_mask", EVALUATION_BATCH, "batch_size", ("again",)),
    ("metric_before_gather", EVALUATION_GATHER, "world_size", ("again", "batch_size")),
]
EVALUATED = ["--eval_strategy", "steps"]  # each step: the checkpoint resumed holds one (reused until 2026-12-06)


@pytest.mark.slow
def test_evaluation_seeded_bugs_each_flagged_by_their_comparison_and_the_twin_passes(tmp_path, ranks, capsys):
    """Each bug of eval_bugs.py in a verify of its own (the three would move each other's comparisons), the twin
    with all three fixed in one: per verify, the reference (6 steps, each evaluated: EVALUATED), the evaluation-only
    variant here, the 2-process evaluation on the ranks."""
    for bug, cause, seen_by, agreeing in EVALUATION_BUGS:
        code, certificate = verify_here(ranks, tmp_path / bug, EVAL_BUGS, "evaluation", "--bugs", bug, *EVALUATED)
        result = certificate["checks"]["evaluation"]
        assert (code, result["status"], result["cause"]) == (1, "failed", cause), bug
        measured = result["measured"]
        # clear of the tolerance: dropout's difference is one draw of masks, whose size is chance (the loss 4.4e-4
        # relative since evaluation loaders draw their worker seeds from a generator of their own; before, other
        # masks moved the accuracy by one example, 0.077)
        assert measured[seen_by]["relative"] > 3 * EVALUATION_RTOL, (bug, measured[seen_by])
        assert all(measured[name]["differing"] == [] for name in agreeing), (bug, measured)
        assert "What to change" in result["diagnosis"] and f"evaluation failed ({cause})" in capsys.readouterr().out
    assert measured["world_size"]["differing"] == ["accuracy"]  # the loss is gathered: only the counted metric
    assert measured["eval_batch_size"] == [8, 4] and measured["metrics"]["samples"] == 44

    fixed = ["--bugs", "metric_before_gather,dropout_in_eval,ignores_mask", "--fixed", "true", *EVALUATED]
    code, certificate = verify_here(ranks, tmp_path / "twin", EVAL_BUGS, "evaluation", *fixed)
    result = certificate["checks"]["evaluation"]
    assert (code, result["status"], result["variants"]) == (0, "passed", ["reference", "evaluation", "evaluation-two"])
    for name in ("again", "batch_size", "world_size"):
        assert result["measured"][name]["relative"] <= EVALUATION_RTOL and result["measured"][name]["missing"] == []
        assert set(result["measured"][name]["metrics"]) == {"loss", "samples", "accuracy"}


# (script, the check that names its class, the cause class it must be given): the bugs whose variants' process is not
# what the check sees (a generator made without a seed draws other numbers in one process too); those of a process
# start (a set's order, the generators before seeding) and of a SIGKILL are test_verify.py's, run as processes
SEEDED_HERE = [
    ("divided_loss.py", "accumulation", "loss scaled by the accumulation count"),
    ("unseeded_noise.py", "determinism", "data order / unseeded RNG"),
]


@pytest.mark.slow
@pytest.mark.parametrize("script,check,cause", SEEDED_HERE, ids=[s[0] for s in SEEDED_HERE])
def test_a_seeded_bug_is_flagged_by_its_check_and_its_twin_passes(tmp_path, ranks, capsys, script, check, cause):
    """The bug and its twin (--fixed true), each variant in this process: 2 runs of 1 step each (accumulation), 2 of
    6 steps each (determinism)."""
    code, certificate = verify_here(ranks, tmp_path / "bug", BUGS / script, check)
    result = certificate["checks"][check]
    assert (code, certificate["passed"], result["status"]) == (1, False, "failed")
    assert result["cause"] == cause and "What to change" in result["diagnosis"]
    measured = result["measured"]
    if check == "accumulation":  # the gradient of k accumulated micro-batches is 1/k of one batch's
        assert measured["grad_norm"][0] == pytest.approx(measured["grad_norm"][1] / 2, rel=1e-4)
        assert measured["loss_relative"] > 0.4
    else:  # the largest difference over the compared steps: one step of other data can move the loss by little
        assert measured["first_loss_difference"] and measured["tensors_differing"] > 0
        assert measured["largest_loss_relative"] > 1e-3
    assert f"{check} failed ({cause})" in capsys.readouterr().out
    code, certificate = verify_here(ranks, tmp_path / "twin", BUGS / script, check, "--fixed", "true")
    assert (code, certificate["passed"], certificate["checks"][check]["status"]) == (0, True, "passed")
    assert certificate["variants"] and all(attempt["command"][1] == str(BUGS / script) for variant in
                                           certificate["variants"].values() for attempt in variant["attempts"])

def fabricated(runs_written: dict):
    """A runner for checks.Runs that writes what each named variant's run directory holds (no run): metrics.jsonl
    from "losses", all_results.json from "results", config.yaml from "config", the last checkpoint's train state
    from "precision" and "state", more checkpoints at the steps "checkpoints"; the keyword flags each variant was
    given are kept in `runs_written["asked"]`."""
    def runner(verify, name, interrupts, env=None, script_args=(), processes=1, **more) -> Variant:
        plan, out = runs_written[name], verify.output_dir / name
        runs_written.setdefault("asked", {})[name] = {**more, "env": env, "processes": processes}
        checkpoint = out / "checkpoints" / f"step-{more.get('max_steps', verify.steps):08d}"
        checkpoint.mkdir(parents=True)
        for step in plan.get("checkpoints", []):
            (out / "checkpoints" / f"step-{step:08d}").mkdir()
        (out / "metrics.jsonl").write_text("".join(json.dumps({"step": step, "loss": loss}) + "\n"
                                                   for step, loss in enumerate(plan.get("losses", []), 1)))
        (out / "all_results.json").write_text(json.dumps(plan.get("results", {})))
        (out / "config.yaml").write_text(json.dumps(plan.get("config", {})))  # JSON is YAML
        (checkpoint / "train_state.json").write_text(json.dumps({"precision": plan.get("precision", "fp32"),
                                                                      **plan.get("state", {})}))
        attempt = {"status": {"exit": 0}, "log": None}
        return Variant(name, [], out, env or {}, processes, returncode=0, attempts=[attempt])
    return runner


def check_on(tmp_path, check, planned: dict, *flags):
    verify = parse_args(["--checks", check.__name__, "--output_dir", str(tmp_path), *flags, "--",
                         str(EVAL_BUGS)])
    return check(Runs(verify, None, fabricated(planned))), planned.get("asked", {})


def test_evaluation_statuses_and_what_each_variant_is_asked(tmp_path):
    """Run directories written here: no eval metric is not applicable; the evaluation-only variants resume the
    reference's last checkpoint, one at half the evaluation batch with the second evaluation asked, one on 2
    processes at half the training batch; an odd training batch leaves the world-size comparison out, said."""
    config = {"per_device_eval_batch_size": 8, "per_device_train_batch_size": 4}
    result, asked = check_on(tmp_path / "none", evaluation, {"reference": {"results": {"train_loss": 0.5},
                                                                           "config": config}})
    assert result.status == "not applicable" and "no evaluation set" in result.measured["reason"]
    assert list(asked) == ["reference"]  # nothing more ran
    same = {"eval_loss": 0.5, "eval_accuracy": 0.75, "eval_samples": 6.0}
    planned = {"reference": {"results": same, "config": config},
               "evaluation": {"results": {**same, **{"eval_again_" + k[5:]: v for k, v in same.items()}}},
               "evaluation-two": {"results": {**same, "eval_accuracy": 0.5}}}
    result, asked = check_on(tmp_path / "gather", evaluation, planned)
    checkpoint = (tmp_path / "gather" / "reference" / "checkpoints" / "step-00000006").resolve()
    assert asked["evaluation"] == {"per_device_eval_batch_size": 3, "resume_from_checkpoint": checkpoint,  # 6 // 2
                                   "max_steps": 6, "env": {"ACCEL_TRAIN_EVAL_AGAIN": "1"}, "processes": 1}
    assert asked["evaluation-two"] == {"per_device_train_batch_size": 2, "resume_from_checkpoint": checkpoint,
                                       "max_steps": 6, "env": None, "processes": 2}
    assert (result.status, result.cause) == ("failed", EVALUATION_GATHER)
    assert result.measured["world_size"]["differing"] == ["accuracy"] and result.measured["world_size"]["relative"] \
        == pytest.approx(1 / 3)
    assert "accuracy 0.75 against 0.5" in result.diagnosis and "gather_for_metrics" in result.diagnosis
    planned["reference"]["config"] = {**config, "per_device_train_batch_size": 5}
    planned["asked"] = {}
    result, asked = check_on(tmp_path / "odd", evaluation, planned)
    assert result.status == "passed" and "evaluation-two" not in asked
    assert result.measured["not_compared"] == ["world size: the per-device training batch (5) cannot be halved, and "
                                               "resuming the checkpoint on 2 processes needs its global batch"]
    # --load_best_model_at_end: the final evaluation was of the best checkpoint's weights, restored at the end
    planned["reference"].update(config={**config, "load_best_model_at_end": True}, checkpoints=[3],
                                state={"best_checkpoint": "step-00000003"})
    planned["asked"] = {}
    result, asked = check_on(tmp_path / "best", evaluation, planned)
    best = (tmp_path / "best" / "reference" / "checkpoints" / "step-00000003").resolve()
    assert (asked["evaluation"]["resume_from_checkpoint"], asked["evaluation"]["max_steps"]) == (best, 3)
    assert result.measured["weights_of_step"] == 3


def test_the_evaluation_paragraph_names_the_comparison_that_isolates_the_fewest_causes():
    agree = compare_metrics({"loss": 0.5}, {"loss": 0.5})
    apart = compare_metrics({"loss": 0.5, "accuracy": 0.5}, {"loss": 0.6, "accuracy": 0.5})
    assert (agree["differing"], apart["differing"], apart["relative"]) == ([], ["loss"], pytest.approx(1 / 6))
    assert compare_metrics({"loss": float("nan")}, {"loss": float("nan")})["differing"] == ["loss"]
    measured = {"eval_batch_size": [8, 4], "again": apart, "batch_size": apart, "world_size": apart}
    assert evaluation_cause(measured)[0] == EVALUATION_RANDOM and "training=self.training" in \
        evaluation_cause(measured)[1]
    cause, said = evaluation_cause({**measured, "again": agree})
    assert cause == EVALUATION_BATCH and "evaluation batch sizes 8 and 4: loss 0.5 against 0.6" in said
    assert "attention_mask" in said
    assert evaluation_cause({**measured, "again": agree, "batch_size": agree})[0] == EVALUATION_GATHER


def test_precision_statuses(tmp_path):
    """Run directories written here: an fp32 reference against a bf16 variant of 3 steps, passed within the bound and
    failed past it or on a non-finite loss; a bf16 reference (--mixed_precision auto on a CPU with bf16) against fp32;
    a script that trains in its own precision whatever the flag: not applicable."""
    reference = {"losses": [0.7, 0.69, 0.68, 0.67, 0.66, 0.65]}
    result, asked = check_on(tmp_path / "pass", precision, {"reference": reference, "precision": {
        "losses": [0.7005, 0.6895, 0.681], "precision": "bf16 autocast on cpu"}})
    assert asked["precision"] == {"mixed_precision": "bf16", "max_steps": 3, "env": None, "processes": 1}
    assert (result.status, result.measured["precision"], result.measured["steps_compared"]) == (
        "passed", ["fp32", "bf16 autocast on cpu"], 3)
    assert result.measured["loss_relative"] == pytest.approx(0.001 / 0.681, rel=1e-6)
    assert result.measured["loss_relative"] < PRECISION_RTOL
    result, _ = check_on(tmp_path / "far", precision, {"reference": reference, "precision": {
        "losses": [0.7, 0.7, 0.9], "precision": "bf16 autocast on cpu"}})
    assert (result.status, result.cause) == ("failed", "loss sensitive to low precision")
    assert "At step 3 the run in fp32 logs loss 0.68" in result.diagnosis and "logits.float()" in result.diagnosis
    result, _ = check_on(tmp_path / "nan", precision, {"reference": reference, "precision": {
        "losses": [0.7, float("nan"), 0.68], "precision": "bf16 autocast on cpu"}})
    assert (result.status, result.cause) == ("failed", "non-finite loss in low precision")
    result, asked = check_on(tmp_path / "low", precision, {"reference": {**reference, "precision": "bf16 autocast on "
                                                                         "cpu"}, "precision": reference})
    assert asked["precision"]["mixed_precision"] == "no" and result.measured["precision"] == [
        "fp32", "bf16 autocast on cpu"] and result.variants == ["precision", "reference"]
    result, _ = check_on(tmp_path / "forced", precision, {"reference": reference, "precision": reference})
    assert result.status == "not applicable" and "forces its precision" in result.measured["reason"]
    assert precision_cause({"precision": ["fp32", "bf16"], "losses_by_step": {1: [1.0, 1.2]},
                            "relative_by_step": {1: 0.2}}, True)[0] == "loss sensitive to low precision"


def test_a_per_micro_batch_token_mean_is_flagged_by_accumulation_and_the_token_sum_twin_passes(tmp_path, capsys):
    """token_mean.py: a token mean per micro-batch over blocks of short (1-4 tokens) and long (17-32) rows, against
    its twin's token sums and counts (the loss contract): accumulation, 2 x 8 rows against 16, each variant a run of
    one step in this process (no rank is used: both sides are 1 process). Measured: the bug's gradient norm 16 %
    relative (0.729 against 0.612), its loss 2.1 %; the twin's gradient norm bitwise, its loss 9.8e-8."""
    script = BUGS / "token_mean.py"
    code, certificate = verify_here(None, tmp_path / "bug", script, "accumulation")
    result = certificate["checks"]["accumulation"]
    assert (code, result["status"], result["cause"]) == (1, "failed", "normalisation per micro-batch")
    measured = result["measured"]
    assert measured["grad_norm_relative"] > 100 * ACCUMULATION_RTOL and measured["loss_relative"] > 10 * \
        ACCUMULATION_RTOL
    assert measured["batch_norm_layers"] == [] and "a token mean over variable-length rows" in result["diagnosis"]
    assert "{'loss_sum': sum, 'num_items': count}" in result["diagnosis"]
    assert "accumulation failed (normalisation per micro-batch)" in capsys.readouterr().out
    report = (tmp_path / "bug" / "report.md").read_text()  # the certificate's section of a run report, beside it
    assert "### accumulation: FAILED" in report
    assert "**accumulation: failed (normalisation per micro-batch).**" in report
    code, certificate = verify_here(None, tmp_path / "twin", script, "accumulation", "--fixed", "true")
    result = certificate["checks"]["accumulation"]
    assert (code, result["status"]) == (0, "passed")
    assert result["measured"]["loss_relative"] <= ACCUMULATION_RTOL / 1000
    assert result["measured"]["grad_norm_relative"] <= ACCUMULATION_RTOL / 1000


def test_a_token_mean_over_length_grouped_rows_is_flagged_because_verify_makes_step_one_unequal(tmp_path):
    """token_mean.py --order grouped: rows short or long at random, read in batches of similar lengths (make_loader
    with the lengths): the script's order never makes two micro-batches unequal. verify's variants choose step 1's
    examples (the set's shortest and longest, ordered by length: core/data.py's UnequalFirstStep), so the first
    micro-batch holds 18 length units and the second 245. Measured: the bug's gradient norm 16.8 % relative and its
    whole gradient 1.12 (3.96e-3 and 3.9e-2 with the script's own grouped order: 40 and 29 times less); the twin's
    norm bitwise, its gradient 9.4e-9."""
    script = BUGS / "token_mean.py"
    code, certificate = verify_here(None, tmp_path / "bug", script, "accumulation", "--order", "grouped")
    result = certificate["checks"]["accumulation"]
    assert (code, result["status"], result["cause"]) == (1, "failed", "normalisation per micro-batch")
    short, long = result["measured"]["micro_batch_lengths"]
    assert long > 5 * short
    assert result["measured"]["grad_norm_relative"] > 0.1 and result["measured"]["gradient_relative"] > 0.5
    code, certificate = verify_here(None, tmp_path / "twin", script, "accumulation", "--order", "grouped", "--fixed",
                                    "true")
    result = certificate["checks"]["accumulation"]
    assert (code, result["status"], result["measured"]["micro_batch_lengths"]) == (0, "passed", [short, long])
    assert result["measured"]["grad_norm_relative"] <= FP32_RTOL / 100


@pytest.mark.slow
def test_an_unused_parameter_is_named_by_the_world_size_check_and_its_twin_passes(tmp_path, ranks, capsys):
    """unused_param.py: a head built and never called. world_size and data_accounting, 3 steps: the reference here,
    2 processes on the ranks. DDP's reduction never finishes and step 2 raises: the crash becomes the world-size
    check's finding, with the parameters' names (TORCH_DISTRIBUTED_DEBUG=INFO, set by verify on those processes) and
    what to change; data accounting goes on without that run and says why. The twin (no head) passes both."""
    script = BUGS / "unused_param.py"
    code, certificate = verify_here(ranks, tmp_path / "bug", script, "world_size,data_accounting", steps=3)
    world, accounted = certificate["checks"]["world_size"], certificate["checks"]["data_accounting"]
    assert (code, certificate["passed"], world["status"], world["cause"]) == (1, False, "failed", UNUSED_PARAMETERS)
    assert world["measured"]["parameters_without_gradient"] == ["aux_head.bias", "aux_head.weight"]
    assert world["measured"]["parameter_indices"] == [4, 5] and world["variants"] == ["world-size"]
    assert "aux_head.bias, aux_head.weight got none" in world["diagnosis"]
    assert "leaves_parameters_unused = True" in world["diagnosis"] and "find_unused_parameters" in world["diagnosis"]
    assert certificate["variants"]["world-size"]["attempts"][0]["env"]["TORCH_DISTRIBUTED_DEBUG"] == "INFO"
    assert accounted["status"] == "passed" and accounted["measured"]["not_compared"] == [
        "two processes: its run failed (see world_size)", "across the resume: add resume to --checks"]
    assert f"world_size failed ({UNUSED_PARAMETERS})" in capsys.readouterr().out
    code, certificate = verify_here(ranks, tmp_path / "twin", script, "world_size,data_accounting", "--fixed", "true",
                                    steps=3)
    assert (code, [c["status"] for c in certificate["checks"].values()]) == (0, ["passed", "passed"])


def test_a_world_size_difference_where_the_matrix_marks_the_cell_n_a_is_reported_with_the_matrixs_reason(tmp_path,
                                                                                                        capsys):
    """Run directories written here (no run), through main: a padding-free run (config.yaml) whose 2-process losses
    differ by 7 %. The project's matrix (accel_train/verify/matrix.py, docs/matrix.md) marks padding-free x 2
    processes n/a (two rows on two processes are another batch shape than one row): the world-size check is not
    applicable with that reason and the figures it measured, not failed; verify exits 0. The same difference on a
    run the matrix proves on 2 processes (accumulation alone) still fails."""
    losses = {"losses": [0.7, 0.69, 0.68]}
    config = {"padding_free": True, "gradient_accumulation_steps": 2, "per_device_train_batch_size": 4}
    planned = {"reference": {**losses, "config": config}, "world-size": {"losses": [0.75, 0.74, 0.73]}}
    argv = ["--checks", "world_size", "--steps", "3", "--output_dir", str(tmp_path / "free"), "--", str(EVAL_BUGS)]
    assert main(argv, runner=fabricated(planned)) == 0
    certificate = json.loads((tmp_path / "free" / CERTIFICATE).read_text())
    assert certificate["matrix"]["features"] == ["accumulation", "padding-free"]
    assert certificate["matrix"]["combination"].startswith("not a row of the table")
    assert certificate["matrix"]["not_applicable"] == ["padding-free"] and certificate["matrix"]["said"] == []
    world = certificate["checks"]["world_size"]
    reason = SPECIAL[("padding-free", "2 processes")][1]
    assert world["status"] == "not applicable" and reason in world["measured"]["reason"] and "cause" not in world
    assert world["measured"]["matrix"]["judged"] and world["measured"]["loss_relative"] == pytest.approx(0.05 / 0.73)
    assert world["measured"]["unjudged"]["cause"] and "losses 6.85e-02" in world["measured"]["reason"]
    out = capsys.readouterr().out
    assert "the project's matrix: accumulation, padding-free (not a row of the table" in out
    assert "world_size      NOT APPLICABLE  the project's matrix (docs/matrix.md) marks it n/a" in out
    assert reason in out and "world_size failed" not in out
    report = (tmp_path / "free" / "report.md").read_text()  # the certificate's section of a run report
    assert "| the project's matrix | accumulation, padding-free (not a row of the table" in report
    assert "| the project's matrix | padding-free x 2 processes: n/a (the rows of 2 processes" in report

    planned = {"reference": {**losses, "config": {**config, "padding_free": False}},
               "world-size": {"losses": [0.75, 0.74, 0.73]}}
    argv[argv.index(str(tmp_path / "free"))] = str(tmp_path / "padded")
    assert main(argv, runner=fabricated(planned)) == 1
    world = json.loads((tmp_path / "padded" / CERTIFICATE).read_text())["checks"]["world_size"]
    assert world["status"] == "failed" and world["measured"]["matrix"]["status"] == "proven"
    assert "matrix: proven for accumulation (2 processes)" in capsys.readouterr().out


def test_the_certificate_says_what_the_projects_matrix_proves_for_a_real_runs_combination(tmp_path, capsys):
    """token_train --padding_free true --gradient_accumulation_steps 2, data_accounting alone, 3 steps: the reference
    runs in this process. Its config.yaml names two rows of the project's matrix; the data cells of both are proven
    there, which the certificate and the summary say beside the check's own verdict."""
    flags = ("--padding_free", "true", "--gradient_accumulation_steps", "2", "--per_device_train_batch_size", "4")
    code, certificate = verify_here(None, tmp_path, SCRIPTS / "token_train.py", "data_accounting", *flags, steps=3)
    assert code == 0 and certificate["matrix"]["features"] == ["accumulation", "padding-free"]
    accounted = certificate["checks"]["data_accounting"]
    assert accounted["status"] == "passed" and accounted["measured"]["matrix"]["status"] == "proven"
    assert accounted["measured"]["matrix"]["said"].startswith("proven for accumulation, padding-free (data)")
    assert "matrix: proven for accumulation, padding-free (data)" in capsys.readouterr().out


def test_a_row_the_matrix_says_is_named_from_the_reference_runs_start_up_report(tmp_path, capsys):
    """toy_train --augment 0.3 (noise from torch's global generator in __getitem__): the start-up report says it, the
    matrix's row for it is "said" in every cell, and config.yaml cannot show it: verify reads the reference's log.
    data_accounting alone: the reference (3 steps) in this process."""
    code, certificate = verify_here(None, tmp_path, SCRIPTS / "toy_train.py", "data_accounting", "--augment", "0.3",
                                    steps=3)
    assert certificate["matrix"]["features"] == [] and certificate["matrix"]["said"] == ["augmentation (global RNG)"]
    matrix = certificate["checks"]["data_accounting"]["measured"]["matrix"]
    assert matrix["status"] == "said" and SAID["augmentation (global RNG)"] in matrix["said"]
    assert "; said: augmentation (global RNG)" in capsys.readouterr().out


def test_a_token_budget_run_is_not_compared_across_batch_sizes_or_process_counts(tmp_path, capsys):
    """Run directories written here (no run): a run of --max_tokens_per_batch 1104 (config.yaml). Its micro-batches
    are the plan's, so k micro-batches of B against one of kB, and 1 process against 2, hold other examples by design:
    before, both checks compared them and failed (the accumulation check blaming the script's sampler). Both are not
    applicable with the reason and the flag that checks the rest of the script; nothing is run to compare."""
    config = {"max_tokens_per_batch": 1104, "per_device_train_batch_size": 4}
    planned = {"reference": {"losses": [0.7, 0.69, 0.68], "config": config},
               "accumulation-micro": {"losses": [0.71], "config": {**config, "gradient_accumulation_steps": 2}}}
    argv = ["--checks", "accumulation,world_size", "--steps", "3", "--output_dir", str(tmp_path / "budget"), "--",
            str(EVAL_BUGS)]
    assert main(argv, runner=fabricated(planned)) == 0
    certificate = json.loads((tmp_path / "budget" / CERTIFICATE).read_text())
    for name in ("accumulation", "world_size"):
        check = certificate["checks"][name]
        assert check["status"] == "not applicable", check
        assert "token budget (--max_tokens_per_batch 1104)" in check["measured"]["reason"]
        assert "--max_tokens_per_batch 0" in check["measured"]["reason"]
    assert sorted(planned["asked"]) == ["accumulation-micro", "reference"]  # no batch of kB, no 2-process run
    # the evaluation check's 2-process evaluation resumes the checkpoint on 2: a budget's plan cannot move there
    from accel_train.verify.evaluation import _two_processes

    runs = Runs(parse_args(["--output_dir", str(tmp_path / "evaluation"), "--", str(EVAL_BUGS)]), None)
    assert "resumes on the number of processes it trained on only" in _two_processes(runs, config, {})
    assert "world_size      NOT APPLICABLE" in capsys.readouterr().out
