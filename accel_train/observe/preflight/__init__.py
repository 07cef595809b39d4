"""The pre-flight check: the silent bugs that waste a training run, looked for before step 0.

Each check returns findings with the fix. The rule for the level:

* **error** — the run as set up is certainly not the one asked for, or would crash later: precision or world
  size other than asked, a loader whose batch disagrees with the planned global batch, trainable parameters the
  optimizer never updates, a schedule that reaches zero long before the last step, labels outside the model's
  range, checkpoints that the output directory's disk cannot hold (storage_checks.py). The run refuses to start
  (`ConfigError` listing every error) and writes nothing.
* **warning** — wrong in most runs but with legitimate uses: an unshuffled training loader (data already
  shuffled, a curriculum), a shuffled or truncated evaluation loader, a sampler that cannot be replayed on
  resume, a schedule of another length or warmup than the config says, low-precision master weights, intervals
  longer than the run. Printed, and kept in `preflight.json` and the report.
* **ok** — what was checked and found right, with the numbers (kept for the report).

The checks of the run as set up are in run_checks.py, those that touch the model, the optimizer and the
schedule in model_checks.py.
Cost: no pass over the data and no backward. One evaluation-mode forward of one micro-batch (the first samples of
the training set) when the model's label range is read from its logits, and the loss and metrics functions on that
micro-batch (function_checks.py); the schedule is simulated on a copy of
the scheduler whose parameters are stand-ins. No random number generator is advanced.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from accelerate.utils import gather_object

from ...errors import ConfigError
from .findings import Finding, PreflightResult
from .function_checks import check_functions
from .model_checks import check_labels, check_optimizer, check_plateau, check_schedule, run_schedule, schedule_record
from .run_checks import check_batch, check_loaders, check_precision, check_steps, check_world_size
from .storage_checks import check_disk

CHECKS = (check_world_size, check_precision, check_batch, check_steps, check_schedule, check_plateau, check_optimizer,
          check_loaders, check_labels, check_functions, check_disk)

__all__ = ["run_preflight", "Finding", "PreflightResult", "CHECKS"]


def run_preflight(session) -> PreflightResult:
    """Run every check on every process on the prepared `session` (core.session.Session); raise `ConfigError`
    with all errors (and their fixes) if any process found one, so that every rank refuses the same start.
    Returns the findings otherwise."""
    started = time.perf_counter()
    lrs = _guarded(run_schedule, session)
    findings: list[Finding] = []
    for check in CHECKS:
        try:
            findings += check(session, lrs) if check is check_schedule else check(session)
        except Exception as err:  # a check that cannot run must not stop a run it cannot judge
            findings.append(Finding(check.__name__.removeprefix("check_"), "warning",
                                    f"the check could not run ({type(err).__name__}: {err}).",
                                    "report it; --no_preflight skips the pre-flight check."))
    if session.accelerator.num_processes > 1:  # one collective: every rank takes the same decision
        merged = gather_object([asdict(f) for f in findings])
        findings = [Finding(**d) for d in {tuple(d.values()): d for d in merged}.values()]
    schedule = schedule_record(lrs, session.plan) if lrs else None
    result = PreflightResult(findings, schedule, time.perf_counter() - started)
    if result.errors:
        raise ConfigError("the pre-flight check refused to start this run:\n" +
                          "\n".join(f"  - {f.message} Fix: {f.fix}" for f in result.errors) +
                          "\n(--no_preflight skips the check.)")
    return result


def _guarded(simulate, session):
    try:
        return simulate(session)
    except Exception:  # noqa: BLE001 - check_schedule reports the failure as a finding when it re-runs it
        return None
