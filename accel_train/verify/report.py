"""The certificate as a section of a run report: `DIR/report.md` beside `DIR/verify.json`, in the run report's
Markdown (observe/report/markdown.py: `#` title, `##` sections, two-column tables), rendered from the certificate
alone, so `render(json.load(open("DIR/verify.json")))` writes it again. The same section is also put into the reference
run's own report (`DIR/reference/report.md`, written by observe/report/), between two markers, so a verify that runs
again replaces it instead of adding a second one.

    ## Verify certificate        what was verified, the verdict, properties, why verify stopped (if it did)
    ### <check>: <STATUS>        one table per check (status, measured, tolerance, variants compared, cause),
                                 then the failure's paragraph: the likely cause and what to change
    ## Variants                  each run directory, with a link to its own run report
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..rundir.layout import KEPT_BEGIN, KEPT_END
from .checks import NOT_APPLICABLE, PROPERTY, Result

REPORT = "report.md"
SECTION = "## Verify certificate"
REFERENCE = "reference"  # the variant whose run report gets the section too
# Between the run report's kept-section markers: `accel-train report` writing the report again keeps the section.
BEGIN = f"{KEPT_BEGIN} verify's certificate (verify.json); replaced when verify writes it again -->"
END = KEPT_END


def figure(name: str, result: Result) -> str:
    """The check's measured differences against its tolerance, in one line (the summary's and the report's)."""
    measured = result.measured
    if result.status == NOT_APPLICABLE:
        return measured.get("reason", "")
    if "crashed_variant" in measured:  # crashes.py: the run failed for a recognised cause
        return f"variant {measured['crashed_variant']} failed: {result.cause}"
    if name == "world_size":
        return (f"1 against 2 processes at a global batch of {measured['global_batch']}: losses "
                f"{_e(measured['loss_relative'])}, step 1's grad_norm {_e(measured['grad_norm_relative'])} relative "
                f"(tolerance {result.tolerance['loss'].split(',')[0]}){direction(result)}; weights "
                f"{_e(measured['weights_relative'])}{unequal(measured.get('process_lengths'), 'processes')}")
    if name == "data_accounting":
        fed = sum(rows["fed"] for rows in measured["rows"].values())
        planned = sum(rows["planned"] for rows in measured["rows"].values())
        rows = f"{fed} of {planned} planned rows fed" if measured["rows"] else "rows not compared"
        return (f"{rows}, {len(measured['findings'])} finding(s); compared: "
                f"{', '.join(measured['compared'])}"
                + (f"; not compared: {'; '.join(measured['not_compared'])}" if measured["not_compared"] else ""))
    if name == "evaluation":
        judged = {key: max((float(row["relative"]) for metric, row in measured[key]["metrics"].items()
                            if metric != "loss" or "loss_not_judged" not in measured), default=0.0)
                  for key in ("again", "batch_size", "world_size") if key in measured}
        compared = [f"{key} {_e(relative)}" for key, relative in judged.items()]
        return (f"eval metrics across {', '.join(compared)} relative (tolerance {result.tolerance['metrics']})"
                + ("; eval_loss not judged: a loss over the batch" if "loss_not_judged" in measured else "")
                + (f"; not compared: {'; '.join(measured['not_compared'])}" if measured["not_compared"] else ""))
    if name == "precision":
        return (f"{measured['precision'][1]} against {measured['precision'][0]}: the first {measured['steps_compared']}"
                f" losses {_e(measured['loss_relative'])} relative (tolerance {result.tolerance['loss']})")
    if name == "packing":
        return (f"step 1 {measured['layout'].replace('_', '-')} against padded: loss {_e(measured['loss_relative'])}, "
                f"grad_norm {_e(measured['grad_norm_relative'])} relative (tolerance {result.tolerance['loss']})")
    if name == "export":
        if "error" in measured:
            return f"{measured['format']} artifact written, its verification failed: {measured['error'][:160]}"
        return (f"{measured['format']} loaded back: max |difference| {_e(measured['max_abs_diff'])} against the "
                f"trained model over {sum(len(a['checks']) for a in measured['artifacts'])} inputs (tolerance "
                f"{result.tolerance['outputs'].split()[-1]})")
    if name == "accumulation":
        return (f"loss {_e(measured['loss_relative'])}, grad_norm {_e(measured['grad_norm_relative'])} relative "
                f"(tolerance {result.tolerance['loss']}){direction(result)}"
                f"{unequal(measured.get('micro_batch_lengths'), 'micro-batches')}")
    first = measured.get("first_loss_difference")
    losses = f"losses differ from step {first['step']}" if first else f"{measured['steps_compared']} losses equal"
    return f"{losses}; {measured['tensors_differing']} weight tensors differ (bitwise)"


def unequal(lengths: list | None, parts: str) -> str:
    """'; step 1's micro-batches of lengths 40 and 420': where verify chose step 1's examples unequal (core/data.py's
    UnequalFirstStep: the shortest and the longest of the set)."""
    if not lengths:
        return ""
    return f"; step 1's {parts} of lengths {' and '.join(str(length) for length in lengths)}"


def direction(result: Result) -> str:
    """'; step 1's gradient ... (cosine ...)': the direction figure of the accumulation and world-size checks."""
    measured = result.measured
    if "gradient_relative" in measured:
        tolerance = result.tolerance.get("gradient", "").split(",")[0]
        return (f"; step 1's gradient {_e(measured['gradient_relative'])} relative L2, cosine "
                f"{_e(measured['gradient_cosine'], '.6f')} (tolerance {tolerance})")
    if "gradient_not_compared" in measured:
        return f"; gradient direction not compared: {measured['gradient_not_compared']}"
    return ""


def _e(value, spec: str = ".2e") -> str:
    """A measured figure formatted; verify.json holds a non-finite one as its name ("NaN", "Infinity"), which
    float() reads back, so a report rendered again from the certificate formats it the same."""
    return format(float(value), spec)


def _cell(value) -> str:
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.6g}"
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(rows: list[tuple]) -> list[str]:
    return ["| | |", "|---|---|", *[f"| {_cell(key)} | {_cell(value)} |" for key, value in rows]]


def _check(name: str, result: Result) -> list[str]:
    rows = [("status", result.status), ("measured", figure(name, result))]
    rows += [(f"tolerance: {key}", value) for key, value in result.tolerance.items() if key != "why"]
    if result.variants:
        rows.append(("variants compared", ", ".join(result.variants)))
    if result.cause:
        rows.append(("cause", result.cause))
    if "matrix" in result.measured:  # what the project's own matrix proves for this check and this combination
        rows.append(("the project's matrix", result.measured["matrix"]["said"]))
    out = [f"### {name}: {result.status.upper()}", "", *_table(rows), ""]
    if "why" in result.tolerance:
        out += [f"*Why this tolerance: {result.tolerance['why']}.*", ""]
    if result.diagnosis:
        verdict = "a property of the model" if result.status == PROPERTY else "failed"
        out += [f"**{name}: {verdict} ({result.cause}).** {result.diagnosis}", ""]
    return out


def render(document: dict) -> str:
    """report.md of a certificate (verify.json's document)."""
    return "\n".join([f"# Verify report: {Path(document['script']).name}", "", *_section(document)])


def _section(document: dict, inside: bool = False) -> list[str]:
    """The certificate's `## Verify certificate` section; `inside`: in a variant's own run report (the variants one
    heading lower, linked from beside it)."""
    verdict = "passed" if document.get("passed") else "**FAILED**" if "error" not in document else "**stopped**"
    command = " ".join([document["script"], *document.get("script_args", [])])
    rows = [("script", command), ("verdict", verdict), ("exit code", document.get("exit_code")),
            ("steps per run", document.get("steps")), ("accumulation steps", document.get("accumulation_steps"))]
    if document.get("launch_args"):
        rows.append(("launch args", " ".join(document["launch_args"])))
    if document.get("properties"):
        rows.append(("properties (not failures)", ", ".join(document["properties"])))
    if (document.get("matrix") or {}).get("features") is not None:
        matrix = document["matrix"]
        rows.append(("the project's matrix", f"{', '.join(matrix['features']) or 'no feature of it'} "
                     f"({matrix['combination']})" + "".join(f"; {key}: {', '.join(matrix[key])}"
                                                            for key in ("said", "refused") if matrix[key])))
    if "error" in document:
        rows.append(("stopped", document["error"]))
    out = [SECTION, "", *_table(rows), ""]
    checks = document.get("checks", {})
    out += ["| check | status | measured |", "|---|---|---|"]
    out += [f"| {name} | {_cell(check['status'])} | {_cell(figure(name, Result(**check)))} |"
            for name, check in checks.items()]
    out.append("")
    for name, check in checks.items():
        out += _check(name, Result(**check))
    variants = document.get("variants", {})
    if variants:
        heading, up = ("### Variants", "../") if inside else ("## Variants", "")
        out += [heading, "", "| variant | processes | run directory | exit codes |", "|---|---|---|---|"]
        for name, variant in variants.items():
            folder = Path(variant["output_dir"])
            link = f"[{folder.name}]({up}{folder.name}/report.md)" if (folder / "report.md").is_file() else folder.name
            codes = ", ".join(str(attempt.get("returncode")) for attempt in variant.get("attempts", []))
            out.append(f"| {name} | {variant.get('processes')} | {link} | {codes} |")
        out.append("")
    return out


def write_report(document: dict, directory: Path) -> Path:
    """DIR/report.md, and the section in the reference run's report.md when this verify ran the reference and it
    wrote one (a script with --run_report false writes none)."""
    path = Path(directory) / REPORT
    path.write_text(render(document))
    if REFERENCE in document.get("variants", {}):
        add_to_run_report(document, Path(directory) / REFERENCE / REPORT)
    return path


def add_to_run_report(document: dict, report: Path) -> bool:
    """Put the certificate's section into the run report `report` (at the end, or in place of the section an earlier
    verify put there); False when there is no such report."""
    if not report.is_file():
        return False
    text = report.read_text()
    section = "\n".join([BEGIN, *_section(document, inside=True), END])
    start = text.find(BEGIN)
    stop = text.find(END, start) if start >= 0 else -1
    if start >= 0 and stop >= 0:
        text = text[:start] + section + text[stop + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    report.write_text(text)
    return True
