"""Observability, built on the core as hooks and probes; the core never imports it.

    observer.py   the built-in Observer hook: pre-flight, run facts, overfit verdict, report at the end
    probes.py     opt-in diagnostics: gradient flow, activation statistics, profiler, memory snapshots
    overfit.py    --overfit_batches: can this model, loss and optimizer learn at all?
    preflight/    the checks before step 0 (findings, run checks, model checks)
    report/       report.md, its plots, and `accel-train compare`
"""
