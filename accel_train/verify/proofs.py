"""What the project's own feature x invariant matrix (verify/matrix.py, docs/matrix.md) proves for the combination a
user's run makes, stated in verify's certificate.

The reference run's config.yaml names the table's rows the run combines (matrix.features_of) and its start-up report
(the variant's log) the rows the table says; for each check with an invariant of the table, the certificate states
the table's word (`measured["matrix"]`). Where a cell of a check's whole subject is n/a (a padding-free run on 2
processes holds other batch shapes) and the check fails, the failure is no bug the project promises to be without:
the check is reported not applicable with the table's reason and what it measured. The check still runs: where it
passes (token_train padding-free on 1 against 2 processes: losses 1.4e-7 relative), that is evidence, kept.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .checks import FAILED, NOT_APPLICABLE, Result, Runs
from .evidence import run_config
from .matrix import combination, features_of, said_for, said_rows
from .report import figure

REFERENCE = "reference"  # the variant whose config.yaml and start-up report are read (the determinism check's run)


def reference_rows(runs: Runs) -> tuple[list[str], list[str]] | None:
    """(the table's rows the reference run combines, the SAID rows its start-up report holds); None before the
    reference ran (or when it failed)."""
    reference = runs.done.get(REFERENCE)
    if reference is None or reference.returncode != 0:
        return None
    log = reference.attempts[0].get("log") if reference.attempts else None
    startup = Path(log).read_text(errors="replace") if log and Path(log).is_file() else ""
    return features_of(run_config(reference.output_dir)), said_rows(startup)


def checked(runs: Runs, name: str, call: Callable[[], Result]) -> Result:
    """Check `name` (`call`) with the table's word on it (once the reference ran). A failure where the table marks
    the check's own invariant n/a for a row the run combines (matrix.JUDGED) becomes not applicable, with the table's
    reason, the figures measured, and the paragraph the failure would have had (under "unjudged")."""
    result = call()
    rows = reference_rows(runs)
    said = said_for(name, *rows) if rows is not None else None
    if said is None:
        return result
    result.measured["matrix"] = said
    if said["judged"] and result.status == FAILED:
        result.measured["unjudged"] = {"measured": figure(name, result), "cause": result.cause,
                                       "diagnosis": result.diagnosis}
        result.measured["reason"] = (f"the project's matrix (docs/matrix.md) marks it n/a for this run: "
                                     f"{said['said']}; measured: {result.measured['unjudged']['measured']}")
        result.status, result.cause, result.diagnosis = NOT_APPLICABLE, None, None
    return result


def certificate_part(runs: Runs) -> dict:
    """verify.json's "matrix": the rows the run combines and what the table says of the combination."""
    rows = reference_rows(runs)
    if rows is None:
        return {"features": None, "combination": "not read: no check ran the reference run to its end"}
    return combination(*rows)
