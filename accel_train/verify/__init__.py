"""`accel-train verify`: the exactness checks, run on the user's own script and flags (usage: command.py).

    command.py    the command line, the order of the checks, the certificate (verify.json) and the summary
    report.py     the certificate as a section of a run report (report.md beside verify.json)
    runs.py       the variants: the user's command with verify's flags, each run as processes of its own
    checks.py     determinism, resume, accumulation: which variants each compares, and how
    world.py      world size: 1 process against 2 launched at the same global batch
    evaluation.py evaluation: the reference's weights evaluated again (observe/eval_again.py), at another batch
                  size, on 2 processes
    precision.py  precision: the first steps in bf16 against fp32
    packing.py    packing: a packed (or padding-free) step against the same examples padded
    export.py     export (opt-in): the reference run exported and verified by accel_train.deploy, in process
    accounting.py data accounting: what each process fed (observe/fed_record.py), from the runs above
    evidence.py   what is compared, read from the variants' run directories
    diagnose.py   the paragraph a failed check gets: the likely cause and what to change
    crashes.py    a variant that failed for a cause its log names (an unused parameter under DDP): a finding of the
                  check that ran it, not an error that stops verify
"""

from .command import CERTIFICATE, main, parse_args
from .runs import CHECKS, Verify, VerifyError

__all__ = ["CERTIFICATE", "CHECKS", "Verify", "VerifyError", "main", "parse_args"]
