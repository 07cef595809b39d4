"""verify's export check (accel_train/verify/export.py): the reference run exported by accel_train.deploy in verify's
own process and verified against the trained model. The reference runs in this process (test_verify_in_process's
runner): the process is not what the check sees.
"""

from __future__ import annotations

import json

import pytest
from test_verify_in_process import BUGS, verify_here

from accel_train.deploy import DEFAULT_TOLERANCE
from accel_train.verify import parse_args
from accel_train.verify.export import EXPORT_DIFFERS, export_cause

SCRIPT = BUGS / "export_noise.py"


@pytest.mark.slow
def test_noise_drawn_at_inference_is_flagged_by_export_and_the_twin_passes(tmp_path, capsys):
    """export_noise.py: noise on the hidden layer in every mode (the exported graph draws its own) against its twin
    (noise in training only). Each: the reference (3 steps) here, then its export as exported_program into
    DIR/export/exported_program. Measured: the bug's outputs differ by up to 1.2 (on 3 inputs), the twin's by 0."""
    code, certificate = verify_here(None, tmp_path / "bug", SCRIPT, "export", steps=3)
    result = certificate["checks"]["export"]
    assert (code, result["status"], result["cause"], result["variants"]) == (1, "failed", EXPORT_DIFFERS,
                                                                              ["reference"])
    measured = result["measured"]
    assert measured["format"] == "exported_program" and measured["max_abs_diff"] > 1000 * DEFAULT_TOLERANCE
    assert len(measured["differing"]) == 3 and {row["outputs"][0] for row in measured["differing"]} == {"output"}
    assert "differs from the trained model in output 'output'" in result["diagnosis"]
    assert "self.training" in result["diagnosis"] and f"export failed ({EXPORT_DIFFERS})" in capsys.readouterr().out
    written = json.loads((tmp_path / "bug" / "export" / "exported_program" / "export.json").read_text())
    assert written["tolerance"] == DEFAULT_TOLERANCE and written["artifacts"][0]["verified"] is False
    code, certificate = verify_here(None, tmp_path / "twin", SCRIPT, "export", "--fixed", "true", steps=3)
    result = certificate["checks"]["export"]
    assert (code, result["status"], result["measured"]["max_abs_diff"]) == (0, "passed", 0.0)
    assert "### export: PASSED" in (tmp_path / "twin" / "report.md").read_text()


def test_a_run_directory_that_cannot_be_exported_is_not_applicable_with_the_exporters_reason(tmp_path):
    """divided_loss.py's model (a plain Sequential) records no model_factory.json: the exporter cannot rebuild it.
    The reference (3 steps) runs here; nothing is written under DIR/export."""
    code, certificate = verify_here(None, tmp_path, BUGS / "divided_loss.py", "export", "--fixed", "true", steps=3)
    result = certificate["checks"]["export"]
    assert (code, result["status"]) == (0, "not applicable")
    assert "cannot be exported as exported_program" in result["measured"]["reason"]
    assert "no config.json and no model_factory.json" in result["measured"]["reason"]
    assert not list((tmp_path / "export").glob("*/*.pt2"))


def test_export_is_asked_by_name_only():
    verify = parse_args(["--", str(SCRIPT)])
    assert "export" not in verify.checks and "packing" in verify.checks
    assert "export" in parse_args(["--checks", "determinism,export", "--", str(SCRIPT)]).checks


def test_the_export_paragraph_names_the_output_and_the_inputs():
    row = {"inputs": "batch 3, longer sequence", "shapes": "3x17", "max_abs_diff": 0.25}
    measured = {"format": "onnx", "directory": "v/export/onnx", "max_abs_diff": 0.25,
                "differing": [{"artifact": "model", "outputs": ["logits"], **row}]}
    said = export_cause(measured)
    assert "onnx artifact model (v/export/onnx) loaded back differs from the trained model in output 'logits' by up " \
           "to 0.25" in said and "batch 3, longer sequence (3x17): 0.25" in said
    measured["differing"][0]["outputs"] = ["text_embeds", "image_embeds"]
    assert "in one of the outputs text_embeds, image_embeds" in export_cause(measured)
