"""verify's export check: the reference run's final model exported as `accel-train export` exports it
(accel_train.deploy.export_run, in this process: no variant of its own), into DIR/export/FORMAT, loaded back the way
a serving stack loads it, and compared with the eager model on held-out inputs at other shapes (the exporter's own
verification, deploy/verify.py). The check reports the largest difference that verification measured, against
deploy's tolerance (DEFAULT_TOLERANCE, max |artifact - model| over every output).

The format: the run's own `--export_formats` (config.yaml), the first of them; else exported_program (torch.export,
with the batch and sequence axes dynamic; 6.8 s on the main job's MiniLM, against torchscript's 3.9 s and onnx's
10.3 s, 2 shared CPU cores). A run directory the exporter cannot export (no config.json or model_factory.json to
rebuild the model from, a model torch.export cannot capture, no inputs to export it with) makes the check not
applicable, with the exporter's reason; an artifact whose outputs differ (or change shape) is a failure naming the
artifact, its outputs and the inputs where they differ.

The exporter runs the model_factory.json the reference run recorded (trust_factory): verify ran that script itself,
and the script's folder is put first on the import path, as `python SCRIPT` puts it for the variants.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from pathlib import Path

import yaml

from ..deploy import DEFAULT_TOLERANCE, export_run
from ..deploy.formats import SUFFIX
from ..errors import ExportError
from ..rundir.layout import CONFIG, EXPORT_DIR
from .checks import FAILED, NOT_APPLICABLE, PASSED, Result, Runs

EXPORT_FORMAT = "exported_program"
EXPORT_DIFFERS = "export differs from the trained model"
EXPORT_ADVICE = (
    "Likely causes: the forward does something the graph cannot keep: a random draw or a mutation of the module's "
    "state that does not depend on self.training (noise, a counter, a cache: the artifact draws or keeps its own), "
    "a Python value computed from a tensor or a shape (float(x.std()), a Python `if` on the data, a loop over "
    "x.size(1)) that the capture froze to the example's, or an op the format computes otherwise. What to change: "
    "gate training-only randomness on self.training, compute from tensors with tensor ops (torch.where, not `if`), "
    "and check with `accel-train export RUN_DIR --format FORMAT` (its export.json lists every input's difference).")


def export(runs: Runs) -> Result:
    """The reference run exported and verified by accel_train.deploy (module docstring)."""
    verify = runs.verify
    reference = runs.finished("reference")
    config_file = reference.output_dir / CONFIG
    config = (yaml.safe_load(config_file.read_text()) or {}) if config_file.is_file() else {}
    fmt = (config.get("export_formats") or [EXPORT_FORMAT])[0]
    out = verify.output_dir / EXPORT_DIR / fmt
    tolerance = {"outputs": f"max |difference| {DEFAULT_TOLERANCE:g}",
                 "why": "accel-train export's own tolerance: an fp32 graph of the same ops, measured 0 "
                        "(exported_program, torchscript) to 3.9e-8 (onnx) on the main job's MiniLM"}
    try:
        with script_folder_first(verify.script):  # judged here, against DEFAULT_TOLERANCE, to report every figure
            export_run(reference.output_dir, fmt, out, tolerance=math.inf, trust_factory=True)
    except ExportError as err:
        if not list(out.glob(f"*{SUFFIX.get(fmt, '')}")):  # nothing written: the model could not be exported
            return Result(NOT_APPLICABLE, {"reason": f"the reference run cannot be exported as {fmt}: {err}"},
                          tolerance, ["reference"])
        measured = {"format": fmt, "directory": str(out), "error": str(err)}
        return Result(FAILED, measured, tolerance, ["reference"], EXPORT_DIFFERS,
                      f"The exported {fmt} artifact was written, and its verification failed: {err} {EXPORT_ADVICE}")
    metadata = json.loads((out / "export.json").read_text())
    artifacts = [{"name": a["name"], "outputs": a["outputs"], "verified": a["verified"],
                  "max_abs_diff": a["max_abs_diff"], "checks": a["checks"]} for a in metadata["artifacts"]]
    if not all(a["verified"] for a in artifacts):
        return Result(NOT_APPLICABLE, {"reason": f"the {fmt} artifact was written but cannot be loaded back here: "
                                       f"{metadata['artifacts'][0].get('note', 'not verified')}"}, tolerance)
    worst = max((a["max_abs_diff"] for a in artifacts), default=0.0)
    differing = [{"artifact": a["name"], "outputs": a["outputs"], **check} for a in artifacts for check in a["checks"]
                 if not check["max_abs_diff"] <= DEFAULT_TOLERANCE]
    measured = {"format": fmt, "directory": str(out), "max_abs_diff": worst, "artifacts": artifacts,
                "differing": differing}
    _record_tolerance(out, artifacts)
    result = Result(PASSED, measured, tolerance, ["reference"])
    if differing:
        result.status, result.cause, result.diagnosis = FAILED, EXPORT_DIFFERS, export_cause(measured)
    return result


def export_cause(measured: dict) -> str:
    """The paragraph of an artifact whose outputs differ from the trained model's."""
    first = measured["differing"][0]
    outputs = first["outputs"]
    named = f"output {outputs[0]!r}" if len(outputs) == 1 else f"one of the outputs {', '.join(outputs)}"
    where = "; ".join(f"{row['inputs']} ({row['shapes']}): {row['max_abs_diff']:.3g}" for row in measured["differing"])
    return (f"The {measured['format']} artifact {first['artifact']} ({measured['directory']}) loaded back differs from "
            f"the trained model in {named} by up to {measured['max_abs_diff']:.3g} (tolerance "
            f"{DEFAULT_TOLERANCE:g}), on {where}. {EXPORT_ADVICE}")


@contextlib.contextmanager
def script_folder_first(script: str):
    """The user's script folder first on sys.path while the exporter imports the model's factory."""
    folder = str(Path(script).resolve().parent)
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        sys.path.remove(folder)


def _record_tolerance(out: Path, artifacts: list[dict]) -> None:
    """export.json says the tolerance verify judged by (the exporter was given none, to measure every input)."""
    path = out / "export.json"
    metadata = json.loads(path.read_text())
    metadata["tolerance"] = DEFAULT_TOLERANCE
    for record in metadata["artifacts"]:
        record["verified"] = all(check["max_abs_diff"] <= DEFAULT_TOLERANCE for check in record["checks"])
    metadata["judged_by"] = "accel-train verify's export check"
    path.write_text(json.dumps(metadata, indent=2))
