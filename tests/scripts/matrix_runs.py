"""How tests/core/test_matrix.py makes a row's runs: uninterrupted, cut (a hook's stop or SIGTERM) and resumed with
`latest`, in this process (`main(argv)`), and its 2-process run on the session's gloo ranks (conftest's Ranks).

The rows are accel_train/verify/matrix.py's (their flags, their record); which script, cut and fault each gets is
test_matrix.py's HOW.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import token_train
import torch
import toy_train
from conftest import reset_accelerate

from accel_train import run_cli
from accel_train.verify.evidence import final_weights

QUIET = ("--report_to", "none", "--disable_tqdm", "--run_report", "false", "--logging_steps", "1")
# 48 points, 4 a micro-batch: 12 micro-batches an epoch, 2 epochs; evaluated and saved every 3 steps
TOY = ("--num_samples", "48", "--per_device_train_batch_size", "4", "--num_train_epochs", "2", "--learning_rate",
       "0.05", "--save_strategy", "steps", "--save_steps", "3", "--eval_strategy", "steps", "--eval_steps", "3")
# 24 sequences of 3 to 40 tokens, 4 a micro-batch: 6 an epoch, 2 epochs (a tiny GPT-2; the default token loss); the
# hook that cuts it stops at a checkpoint (token_train's StopAt acts on_save), hence even steps
TOKEN = ("--num_sequences", "24", "--per_device_train_batch_size", "4", "--num_train_epochs", "2", "--learning_rate",
         "0.01", "--save_strategy", "steps", "--save_steps", "2", "--eval_strategy", "steps", "--eval_steps", "2")


@dataclass(frozen=True)
class Run:
    """How test_matrix.py runs a row (accel_train/verify/matrix.py holds the row: its flags, its record)."""

    script: str  # "toy" (tests/scripts/toy_train.py) or "token" (token_train.py)
    cut_after: int  # the step after which the cut run is interrupted (mid-epoch)
    sigterm: bool = False  # interrupted by SIGTERM (the loop checkpoints at the next step) instead of a hook's stop
    fault: str = ""  # ACCEL_TRAIN_FAULT for every run of it
    stream: bool = False  # the flags need the stream's parquet files (--stream_dir)
    parity: tuple[str, ...] = ()  # flags of both sides of the 2-process comparison (bf16: a few plain SGD steps)


@dataclass(frozen=True)
class Feature(Run):
    flags: tuple[str, ...] = ()
    record: dict = field(default_factory=dict)  # config.yaml entries that name the feature


@dataclass
class Runs:
    """One feature's uninterrupted, cut and resumed runs (and its 2-process run, made when first asked for)."""

    feature: Feature
    full: Path
    cut: Path
    checkpoint_step: int  # the step the resumed run started from
    two: Path | None = None
    one: Path | None = None  # the 1-process side of the 2-process comparison (the full run, unless parity flags)


def argv_of(feature: Feature, out: Path, data: Path) -> list[str]:
    base = TOY if feature.script == "toy" else TOKEN
    stream = ("--stream_dir", str(data)) if feature.stream else ()
    return ["--output_dir", str(out), *QUIET, *base, *stream, *feature.flags]


def run_main(feature: Feature, argv: list[str], monkeypatch, fault: str = "") -> None:
    reset_accelerate()
    main = toy_train.main if feature.script == "toy" else token_train.main
    with monkeypatch.context() as env, fresh_dynamo(argv):
        faults = [f for f in (feature.fault, fault) if f]
        env.setenv("ACCEL_TRAIN_FAULT", faults[-1]) if faults else env.delenv("ACCEL_TRAIN_FAULT", raising=False)
        try:
            run_cli(main, argv)
        except SystemExit as stop:  # run_cli exits 0 after a SIGTERM checkpoint
            assert stop.code == 0, f"{argv}: exit {stop.code}"


@contextmanager
def fresh_dynamo(argv: list[str]) -> Iterator[None]:
    """Dynamo's caches are process-wide: a compiled run starts and leaves them empty, so that the graphs of an earlier
    run (its models, past the recompilation limit) cannot leave this one uncompiled."""
    compiled = "--torch_compile" in argv
    if compiled:
        torch._dynamo.reset()
    try:
        yield
    finally:
        if compiled:
            torch._dynamo.reset()


class RunCache:
    """Each row's runs, made when a cell first asks for them; `catalogue`: how to run each row (test_matrix's)."""

    def __init__(self, root: Path, monkeypatch, ranks, catalogue: dict[str, Feature]):
        self.root, self.monkeypatch, self.runs, self.ranks = root, monkeypatch, {}, ranks
        self.catalogue = catalogue
        self.data = root / "stream"
        toy_train.write_stream_shards(self.data, 48, 8)

    def get(self, name: str) -> Runs:
        if name not in self.runs:
            self.runs[name] = self.make(name)
        return self.runs[name]

    def make(self, name: str) -> Runs:
        feature = self.catalogue[name]
        folder = self.root / re.sub(r"\W+", "_", name)
        full, cut = folder / "full", folder / "cut"
        run_main(feature, argv_of(feature, full, self.data), self.monkeypatch)
        cut_argv = argv_of(feature, cut, self.data)
        if feature.sigterm:  # SIGTERM after step k: the loop checkpoints at k + 1 and stops
            run_main(feature, cut_argv, self.monkeypatch, f"sigterm_after_step:{feature.cut_after}")
            at = feature.cut_after + 1
        else:
            run_main(feature, [*cut_argv, "--stop_at_step", str(feature.cut_after)], self.monkeypatch)
            at = feature.cut_after
        newest = sorted((cut / "checkpoints").glob("step-*"))[-1]
        state = json.loads((newest / "train_state.json").read_text())
        assert newest.name == f"step-{at:08d}" and state["batch_in_epoch"] > 0, \
            f"{name}: the cut must checkpoint step {at} inside an epoch: {newest.name}, batch {state['batch_in_epoch']}"
        run_main(feature, [*cut_argv, "--resume_from_checkpoint", "latest"], self.monkeypatch)
        return Runs(feature, full, cut, at)

    def two_processes(self, name: str) -> Runs:
        runs = self.get(name)
        if runs.two is None:
            feature, runs.two, runs.one = runs.feature, runs.full.parent / "two", runs.full
            steps = list(feature.parity)
            if steps:
                runs.one = runs.full.parent / "one"
                run_main(feature, [*argv_of(feature, runs.one, self.data), *steps], self.monkeypatch)
            argv = [*argv_of(feature, runs.two, self.data), "--per_device_train_batch_size", "2", *steps]
            if "--gradient_accumulation_steps" not in feature.flags:
                argv += ["--gradient_accumulation_steps", "1"]
            fault = {"ACCEL_TRAIN_FAULT": feature.fault} if feature.fault else None
            self.ranks.run(forked_run, feature.script, argv, env=fault)
        return runs


def forked_run(script: str, argv: list[str]) -> None:
    """One rank of a 2-process run (conftest's Ranks calls it on each)."""
    try:
        with fresh_dynamo(argv):
            run_cli(toy_train.main if script == "toy" else token_train.main, argv)
    except SystemExit as stop:
        assert stop.code == 0


def records(out: Path, script: str) -> list[dict]:
    """The run records of rank 0, oldest first (tests/scripts: toy_rank0_<pid>.json or token_rank0_<pid>.json)."""
    paths = sorted(out.glob(f"{script}_rank0_*.json"), key=lambda p: p.stat().st_mtime_ns)
    return [json.loads(p.read_text()) for p in paths]


def fed(record: dict) -> list:
    return record["indices"] if "indices" in record else record["fed"]


def weights(out: Path) -> dict:
    assert (out / "model.safetensors").is_file(), f"{out}: no final weights"
    return final_weights(out)
