"""verify's packing check (accel_train/verify/packing.py): packed and padding-free steps against the same examples
padded. Every variant runs in this process (test_verify_in_process's runner, or run directories written here): the
process is not what the check sees.
"""

from __future__ import annotations

import pytest
from test_verify_in_process import BUGS, fabricated, verify_here

from accel_train.verify import parse_args
from accel_train.verify.checks import Runs
from accel_train.verify.packing import NOT_ISOLATED, PACKING_EXAMPLES, PACKING_RTOL, layout_of, packing

SCRIPT = BUGS / "packed_positions.py"
LAYOUTS = {"packing": ["--packing", "true"], "padding_free": ["--padding_free", "true", "--per_device_train_batch_size",
                                                               "8"]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_examples_that_see_each_other_in_a_packed_row_are_flagged_and_the_twin_passes(tmp_path, capsys, layout):
    """packed_positions.py: a collator numbering positions across the row (the packed examples attend to each other)
    against its twin (the project's PackedCollator). --checks packing alone: 2 runs of 1 step each, here. Measured:
    the bug's gradient norm 4.8 % (packing) and 3.1 % (padding-free) relative, its loss 0.15 %; the twin 9.4e-8
    (packing) and 0 (padding-free)."""
    code, certificate = verify_here(None, tmp_path / "bug", SCRIPT, "packing", *LAYOUTS[layout], steps=3)
    result = certificate["checks"]["packing"]
    assert (code, result["status"], result["cause"]) == (1, "failed", NOT_ISOLATED)
    measured = result["measured"]
    assert measured["layout"] == layout and measured["grad_norm_relative"] > 100 * PACKING_RTOL
    assert measured["examples"] == (PACKING_EXAMPLES if layout == "packing" else None)
    assert result["variants"] == ["packing-packed", "packing-padded"]
    assert "position ids restart at 0" in result["diagnosis"] and "check_isolation" in result["diagnosis"]
    assert f"packing failed ({NOT_ISOLATED})" in capsys.readouterr().out
    asked = certificate["variants"]["packing-padded"]["attempts"][0]["command"]
    assert asked[len(asked) - asked[::-1].index(f"--{layout}")] == "false"  # the last --packing / --padding_free
    assert "### packing: FAILED" in (tmp_path / "bug" / "report.md").read_text()
    code, certificate = verify_here(None, tmp_path / "twin", SCRIPT, "packing", *LAYOUTS[layout], "--fixed", "true",
                                    steps=3)
    result = certificate["checks"]["packing"]
    assert (code, result["status"]) == (0, "passed")
    assert max(result["measured"]["loss_relative"], result["measured"]["grad_norm_relative"]) <= PACKING_RTOL / 100


@pytest.mark.slow
def test_a_padding_free_reference_in_fp32_is_the_packed_side(tmp_path):
    """determinism then packing on the padding-free twin (3 steps): the reference's step 1 is compared, one run of one
    step is added."""
    code, certificate = verify_here(None, tmp_path, SCRIPT, "determinism,packing", *LAYOUTS["padding_free"],
                                    "--fixed", "true", steps=3)
    result = certificate["checks"]["packing"]
    assert (code, result["status"], result["variants"]) == (0, "passed", ["reference", "packing-padded"])
    assert list(certificate["variants"]) == ["reference", "repeat", "packing-padded"]


def test_a_run_that_does_not_pack_is_not_applicable_and_starts_nothing(tmp_path):
    """Without --packing / --padding_free: decided from the flags (no reference yet) or the reference's config.yaml
    (run directories written here), nothing run for the check."""
    code, certificate = verify_here(None, tmp_path / "flags", SCRIPT, "packing", "--padding_free", "false")
    result = certificate["checks"]["packing"]
    assert (code, result["status"], certificate["variants"]) == (0, "not applicable", {})
    assert "the script's flags: no --packing, no --padding_free" in result["measured"]["reason"]
    planned = {"reference": {"config": {"packing": False, "padding_free": False, "max_train_samples": 64}}}
    result = on_reference(tmp_path / "config", planned, "--packing")  # the resolved config is what the run did
    assert result.status == "not applicable" and "config.yaml" in result.measured["reason"]
    assert list(planned["asked"]) == ["reference"]


def test_packing_that_no_padded_step_can_match_is_not_applicable_with_why(tmp_path):
    planned = {"reference": {"config": {"packing": True, "packing_split": True, "max_train_samples": 64}}}
    result = on_reference(tmp_path / "split", planned)
    assert result.status == "not applicable" and "--packing_split cuts long examples" in result.measured["reason"]
    planned = {"reference": {"config": {"packing": True}}}
    result = on_reference(tmp_path / "subset", planned)
    assert result.status == "not applicable" and "no --max_train_samples" in result.measured["reason"]
    assert list(planned["asked"]) == ["reference"]


def test_packing_asked_alone_reads_the_references_config_before_giving_flags(tmp_path):
    """--checks packing alone on a --packing script: the reference runs first, so a script without --max_train_samples
    is not applicable with why, instead of a packed variant that refuses the flag (verify stopped with exit 2)."""
    planned = {"reference": {"config": {"packing": True}}}
    verify = parse_args(["--checks", "packing", "--output_dir", str(tmp_path), "--", str(SCRIPT), "--packing", "true"])
    result = packing(Runs(verify, None, fabricated(planned)))
    assert result.status == "not applicable" and "no --max_train_samples" in result.measured["reason"]
    assert list(planned["asked"]) == ["reference"]


def test_what_the_packed_and_padded_variants_are_asked(tmp_path):
    """--packing: both sides one step over the same 16 examples (8 with the user's --max_train_samples 8) in one
    batch; the padded side without --max_seq_length. Run directories written here."""
    planned = {"reference": {"config": {"packing": True, "max_train_samples": 8}},
               "packing-packed": {"losses": [2.0]}, "packing-padded": {"losses": [2.0]}}
    result = on_reference(tmp_path, planned, "--packing", "--max_seq_length", "64", "--max_train_samples", "8")
    same = {"max_steps": 1, "mixed_precision": "no", "max_train_samples": 8, "per_device_train_batch_size": 8,
            "gradient_accumulation_steps": 1, "dataloader_drop_last": "false", "env": None, "processes": 1}
    assert planned["asked"]["packing-packed"] == same and planned["asked"]["packing-padded"] == same
    assert result.measured["examples"] == 8 and result.measured["loss_relative"] == 0.0


def test_the_layout_is_read_as_parse_config_reads_booleans(tmp_path):
    assert layout_of(None, ["--packing"]) == "packing"
    assert layout_of(None, ["--packing", "--max_seq_length", "64"]) == "packing"
    assert layout_of(None, ["--padding_free=true"]) == "padding_free"
    assert layout_of(None, ["--packing", "true", "--packing", "false"]) is None
    assert layout_of(None, ["--packing", "--no_packing"]) is None
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("padding_free: true\n")
    assert layout_of(None, ["--config", str(yaml_file)]) == "padding_free"
    assert layout_of(None, ["--config", str(yaml_file), "--padding_free", "false"]) is None
    assert layout_of({"packing": True}, []) == "packing" and layout_of({"packing": False}, ["--packing"]) is None


def on_reference(tmp_path, planned: dict, *flags):
    """The packing check after the reference ran (its run directory written from `planned`)."""
    verify = parse_args(["--checks", "packing", "--output_dir", str(tmp_path), "--", str(SCRIPT), *flags])
    runs = Runs(verify, None, fabricated(planned))
    runs.finished("reference")
    return packing(runs)
