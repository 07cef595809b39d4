"""`accel-train verify`: the project's exactness checks, run on the user's own script and flags.

    accel-train verify [--checks determinism,resume,accumulation,world_size,evaluation,precision,packing,
                                 data_accounting] (export: opt-in, add it by name)
                       [--steps N]
                       [--launch_args '...'] [--output_dir DIR] -- SCRIPT [script flags]

Each check runs short variants of the user's run (--max_steps N, logging every step, a checkpoint in mid-run), each
in its own directory under --output_dir, and compares them:

    determinism      the same run twice: logged losses and final weights bitwise equal        2 runs of N steps
    resume           SIGKILLed after step N-1 (past a checkpoint at N//2), resumed from it: the
                     uninterrupted run's losses after the resume, weights, optimizer state and
                     generator states, bitwise                                                +2 runs (1 killed)
    accumulation     k micro-batches of B against one batch of kB, fed the same examples: step 1's
                     loss and gradient norm within 1e-5 relative in fp32, 1e-3 in bf16 / fp16,
                     its whole gradient within 1e-4 / 2e-2 relative L2 (kB: the world-size
                     check's 1-process run where their flags agree, compared at its step 1)  2 runs of 1 step, or 1
    world_size       1 process at B against 2 launched at B/2 (the same global batch): every
                     logged loss and step 1's gradient norm within 1e-5 relative in fp32,
                     1e-3 in bf16 / fp16, step 1's whole gradient within 1e-4 / 2e-2, learning
                     rates equal; a BatchNorm model differs by design: status "property"      +1 launch of 2
    evaluation       the reference's last checkpoint evaluated again (resumed with nothing left
                     to train): twice in one process, at another evaluation batch size, on 2
                     processes: every eval_* metric within 1e-4 relative                      +1 run, +1 launch of 2
    precision        the first 3 steps in bf16 against fp32 (the reference on one side, the
                     other precision on the other): losses within 1e-2 relative, finite       +1 run of 3 steps
    packing          --packing / --padding_free only (read from config.yaml): step 1 of packed
                     rows against the same examples padded: loss and gradient norm within
                     1e-4 relative (examples packed together must not see each other)       +1 or 2 runs of 1 step
    export           (opt-in) the reference's final model exported (accel_train.deploy, here,
                     as exported_program or the run's --export_formats) and loaded back: its
                     outputs within 1e-4 of the model's on held-out inputs (not applicable
                     when the run directory cannot be exported, with the exporter's reason)   no run of its own
    data_accounting  every index planned once per epoch across the processes, every index
                     planned fed (no item dropped on the way to the loss), the same plan and
                     no micro-batch twice across the resume, dataset[len] raising: read from
                     the runs above (ACCEL_TRAIN_RECORD_FED=1 in each)                        no run of its own

It writes DIR/verify.json (the certificate: each check passed / failed / not applicable / property, measured
differences, tolerances, the commands run), DIR/report.md (the certificate as a section of a run report: report.py)
and a summary; exit code 0 when no check failed (a property is not a
failure: the certificate lists it under "properties"), 1 when one failed, 2 on bad input. docs/verify.md says what
each check proves and what it cannot see.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ..errors import ConfigError, UserError
from ..sweep.trial import Interrupts, SweepInterrupted
from .accounting import data_accounting
from .checks import FAILED, NOT_APPLICABLE, PROPERTY, Result, Runs, accumulation, determinism, resume
from .crashes import VariantCrashed
from .evaluation import evaluation
from .export import export
from .packing import packing
from .precision import precision
from .proofs import certificate_part, checked
from .report import REPORT, figure, write_report
from .runs import CHECKS, DEFAULT_CHECKS, Variant, Verify, run_variant
from .world import world_size

CERTIFICATE = "verify.json"
# What verify sets on every variant: the user's flags may not name them.
OWN_FLAGS = ("output_dir", "max_steps", "resume_from_checkpoint", "logging_steps", "logging_strategy", "save_steps",
             "save_strategy")


def parse_args(argv: Sequence[str]) -> Verify:
    """The Verify of an `accel-train verify` argv: its own flags, `--`, the script and its flags."""
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    own, user = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(prog="accel-train verify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checks", default=",".join(DEFAULT_CHECKS), help="comma-separated, of: " + ", ".join(CHECKS)
                        + " (default: all but export, which is asked by name; data_accounting reads the runs of "
                        "the others asked: alone, the reference run only)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps of each full variant (>= 3)")
    parser.add_argument("--accumulation_steps", type=int, default=2, help="k of the accumulation check (>= 2)")
    parser.add_argument("--output_dir", default="verify", help="where the variants' run directories and "
                        f"{CERTIFICATE} go")
    parser.add_argument("--launch_args", action="append", default=[], help="flags for accel-train launch, as one "
                        "word: --launch_args '--cpu' (repeated, they add up); without it, each variant is "
                        "`python SCRIPT`")
    parser.add_argument("--accumulation_args", action="append", default=[], help="more of the script's flags for "
                        "the accumulation runs only, as one word: --accumulation_args '--config_overrides "
                        "hidden_dropout_prob=0' (dropout draws its masks per micro-batch)")
    parser.add_argument("--world_size_args", action="append", default=[], help="more of the script's flags for "
                        "both runs of the world-size check only (dropout draws its masks per process): the "
                        "1-process side is then a run of its own, not the reference")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one variant may run")
    args, unknown_words = parser.parse_known_args(_launch_args_joined(own))  # --help exits here
    if split == len(argv):
        raise ConfigError("accel-train verify: put the script and its flags after `--`, e.g. accel-train verify "
                          "--steps 6 -- recipes/nlp_finetune.py --max_train_samples 64")
    if unknown_words:
        raise ConfigError(f"accel-train verify: unknown flags before `--`: {' '.join(unknown_words)} (the script's "
                          "flags go after `--`; accel-train verify --help lists verify's).")
    checks = tuple(name.strip() for name in args.checks.split(",") if name.strip())
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown or not checks:
        raise ConfigError(f"--checks {args.checks}: unknown {', '.join(unknown) or '(none given)'}; choose among "
                          f"{', '.join(CHECKS)}.")
    if args.steps < 3:
        raise ConfigError(f"--steps {args.steps}: at least 3 (a checkpoint at steps//2, a kill after steps-1).")
    if args.accumulation_steps < 2:
        raise ConfigError(f"--accumulation_steps {args.accumulation_steps}: at least 2.")
    if not user or not Path(user[0]).is_file() or not user[0].endswith(".py"):
        raise ConfigError(f"accel-train verify: {user[0] if user else '(nothing)'} after `--` is not a Python "
                          "script file; give the script verify runs, then its flags.")
    named = [flag for flag in OWN_FLAGS if any(a == f"--{flag}" or a.startswith(f"--{flag}=") for a in user[1:])]
    if named:
        raise ConfigError(f"accel-train verify: the script's flags name {', '.join('--' + n for n in named)}, which "
                          "verify sets on each variant; drop them (give verify's --output_dir and --steps instead).")
    return Verify(script=user[0], script_args=user[1:], output_dir=Path(args.output_dir),
                  checks=tuple(name for name in CHECKS if name in checks), steps=args.steps,
                  accumulation=args.accumulation_steps,
                  launch_args=[a for given in args.launch_args for a in shlex.split(given)], timeout=args.timeout,
                  accumulation_args=[a for given in args.accumulation_args for a in shlex.split(given)],
                  world_size_args=[a for given in args.world_size_args for a in shlex.split(given)])


def _launch_args_joined(own: list[str]) -> list[str]:
    """`--launch_args VALUE` as `--launch_args=VALUE` (--accumulation_args, --world_size_args alike): argparse takes
    a value starting with '-' for a flag."""
    out = []
    words = iter(own)
    for word in words:
        value = next(words, None) if word in ("--launch_args", "--accumulation_args", "--world_size_args") else None
        out.append(word if value is None else f"{word}={value}")
    return out


def run_checks(runs: Runs, results: dict[str, Result]) -> None:
    """The checks asked, in order, each result added to `results` as it is known. A variant that crashed for a cause
    verify recognises fails the check that asked for it, named (crashes.py); the other checks go on."""
    calls = {"determinism": lambda: determinism(runs),
             "resume": lambda: resume(runs, results.get("determinism")),
             "accumulation": lambda: accumulation(runs),
             "world_size": lambda: world_size(runs),
             "evaluation": lambda: evaluation(runs),
             "precision": lambda: precision(runs),
             "packing": lambda: packing(runs),
             "export": lambda: export(runs),
             "data_accounting": lambda: data_accounting(runs)}  # last: it reads the runs the checks above made
    for name, call in calls.items():
        if name not in runs.verify.checks:
            continue
        try:
            results[name] = checked(runs, name, call)  # with the project's matrix's word on it
        except VariantCrashed as crash:
            results[name] = Result.of_crash(crash)


def certificate(verify: Verify, results: dict[str, Result], runs: Runs, error: str | None = None,
                exit_code: int | None = None) -> dict:
    """verify.json. `error`: why verify stopped before its checks were done (what it had is kept)."""
    failed = [name for name, result in results.items() if result.status == FAILED]
    document = {"script": verify.script, "script_args": verify.script_args, "launch_args": verify.launch_args,
                "steps": verify.steps, "save_steps": verify.save_steps, "accumulation_steps": verify.accumulation,
                "passed": not failed and error is None,
                "properties": [name for name, result in results.items() if result.status == PROPERTY],
                "exit_code": exit_code if exit_code is not None else 1 if failed else 0,
                "checks": {name: result.as_dict() for name, result in results.items()},
                "variants": {name: variant.record() for name, variant in runs.done.items()},
                "matrix": certificate_part(runs)}
    if error is not None:
        document["error"] = error
    return document


def summary(verify: Verify, results: dict[str, Result], path: Path, matrix: dict | None = None) -> str:
    lines = [f"accel-train verify: {verify.script} ({verify.steps} steps per run)"]
    if matrix and matrix.get("features") is not None:  # what the project's own matrix proves of this combination
        said = "".join(f"; {key.replace('_', ' ')}: {', '.join(matrix[key])}" for key in ("said", "refused")
                       if matrix[key])
        lines.append(f"  the project's matrix: {', '.join(matrix['features']) or 'no feature of it'} "
                     f"({matrix['combination']}){said}")
    for name, result in results.items():
        detail = figure(name, result)
        lines.append(f"  {name:<15} {result.status.upper():<15} {detail}")
        if "matrix" in result.measured and result.status != NOT_APPLICABLE:
            lines.append(f"  {'':<31} matrix: {result.measured['matrix']['said']}")
    for name, result in results.items():
        if result.diagnosis:
            verdict = "is a property of the model" if result.status == PROPERTY else "failed"
            lines += ["", f"{name} {verdict} ({result.cause}): {result.diagnosis}"]
    lines += ["", f"certificate: {path} (and {path.parent / REPORT})"]
    return "\n".join(lines)


def main(argv: Sequence[str], runner: Callable[..., Variant] = run_variant) -> int:
    """`accel-train verify ... -- SCRIPT [flags]`: 0 all passed, 1 a check failed, 2 bad input (run_cli / cli.main),
    128 + the signal's number when SIGINT / SIGTERM stopped it. verify.json is written in every case but bad flags:
    a run that fails or an interrupt keeps the checks done before it, with the reason. `runner`: how the variants
    that a check gets through Runs run (checks.Runs)."""
    verify = parse_args(argv)
    verify.output_dir.mkdir(parents=True, exist_ok=True)
    path = verify.output_dir / CERTIFICATE
    results: dict[str, Result] = {}
    with Interrupts() as interrupts:
        runs = Runs(verify, interrupts, runner)
        try:
            run_checks(runs, results)
        except SweepInterrupted as stop:
            write_certificate(path, certificate(verify, results, runs, f"interrupted: {stop}", 128 + stop.signum))
            print(f"accel-train verify: {stop} What was done is in {path}.", file=sys.stderr)
            return 128 + stop.signum
        except UserError as err:
            write_certificate(path, certificate(verify, results, runs, f"{err.kind}: {err}", 2))
            raise
    document = certificate(verify, results, runs)
    write_certificate(path, document)
    print(summary(verify, results, path, document["matrix"]))
    return document["exit_code"]


def write_certificate(path: Path, document: dict) -> None:
    """verify.json, and its section of a run report beside it (report.md). Strict JSON: a difference that is not a
    number (NaN, an infinite relative difference against 0) is written as the string Python's float() reads back
    ("NaN", "Infinity"), not as the bare tokens json.dumps would write and strict readers (jq, JavaScript) refuse."""
    path.write_text(json.dumps(_strict(document), indent=2, default=str, allow_nan=False))
    write_report(json.loads(path.read_text()), path.parent)  # rendered from what the certificate holds


def _strict(value):
    """`value` with every non-finite float replaced by its name as float() reads it back ("NaN", "Infinity")."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, dict):
        return {key: _strict(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(item) for item in value]
    return value
