"""The feature x invariant matrix (docs/matrix.md): every feature of the loop against every promise it keeps.

A cell is *proven* (a test checks it: here, or the named test elsewhere), *refused* by name before training (a test
sees the refusal), *said* before training (the run goes ahead and its start-up report names what does not hold: a
test sees the line), or *n/a* (the reason is in the table). Every cell of FEATURES x INVARIANTS has an entry, and
`test_every_cell_is_accounted_for` fails on a new feature or invariant until its cells are filled in; it prints the
table, which docs/matrix.md holds (a test keeps the two equal).

The runs are tiny and in-process (`main(argv)`); each feature's three runs — uninterrupted, cut (stopped by a hook or
by SIGTERM, which checkpoints), resumed with `latest` — are made once and shared by that feature's cells. The
2-process cells run on the session's two gloo ranks (conftest's `ranks`, spawned once): the launcher is not what they
test, `tests/launch/` launches for real.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import token_train
import toy_train
from conftest import ROOT, read_jsonl, reset_accelerate
from safetensors.torch import load_file

from accel_train import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

QUIET = ("--report_to", "none", "--disable_tqdm", "--run_report", "false", "--logging_steps", "1")
# 48 points, 4 a micro-batch: 12 micro-batches an epoch, 2 epochs; evaluated and saved every 3 steps
TOY = ("--num_samples", "48", "--per_device_train_batch_size", "4", "--num_train_epochs", "2", "--learning_rate",
       "0.05", "--save_strategy", "steps", "--save_steps", "3", "--eval_strategy", "steps", "--eval_steps", "3")
# 24 sequences of 3 to 40 tokens, 4 a micro-batch: 6 an epoch, 2 epochs (a tiny GPT-2; the default token loss); the
# hook that cuts it stops at a checkpoint (token_train's StopAt acts on_save), hence even steps
TOKEN = ("--num_sequences", "24", "--per_device_train_batch_size", "4", "--num_train_epochs", "2", "--learning_rate",
         "0.01", "--save_strategy", "steps", "--save_steps", "2", "--eval_strategy", "steps", "--eval_steps", "2")
ROLLBACK = ("--spike_window", "3", "--spike_threshold", "10", "--on_spike", "rollback", "--shuffle", "false")


@dataclass(frozen=True)
class Feature:
    script: str  # "toy" (tests/scripts/toy_train.py) or "token" (token_train.py)
    flags: tuple[str, ...]
    cut_after: int  # the step after which the cut run is interrupted (mid-epoch)
    sigterm: bool = False  # interrupted by SIGTERM (the loop checkpoints at the next step) instead of a hook's stop
    record: dict = field(default_factory=dict)  # config.yaml entries that name the feature
    fault: str = ""  # ACCEL_TRAIN_FAULT for every run of it
    stream: bool = False  # the flags need the stream's parquet files (--stream_dir)
    parity: tuple[str, ...] = ()  # flags of both sides of the 2-process comparison (bf16: a few plain SGD steps)


FEATURES: dict[str, Feature] = {
    "map-style data": Feature("toy", (), 7),
    "accumulation": Feature("toy", ("--gradient_accumulation_steps", "2"), 4,
                            record={"gradient_accumulation_steps": 2}),
    "bf16": Feature("toy", ("--mixed_precision", "bf16"), 7, record={"mixed_precision": "bf16"},
                    parity=("--max_steps", "3", "--optim", "sgd")),
    "packing": Feature("token", ("--pack_width", "40", "--per_device_train_batch_size", "2"), 2,
                       record={"pack_width": 40}),
    "padding-free": Feature("token", ("--padding_free", "true"), 4, record={"padding_free": True}),
    "chunked CE": Feature("token", ("--loss_chunk_size", "8"), 4, record={"loss_chunk_size": 8}),
    "length buckets": Feature("token", ("--length_buckets", "16,32,40"), 4, record={"length_buckets": "16,32,40"}),
    # 64 padded tokens a micro-batch: 11 micro-batches of 1 to 6 sequences an epoch (tests/core/test_token_batches.py)
    "token budget": Feature("token", ("--max_tokens_per_batch", "64"), 4, record={"max_tokens_per_batch": 64}),
    "token budget + accumulation + bf16 + weight averaging": Feature(
        "token", ("--max_tokens_per_batch", "64", "--gradient_accumulation_steps", "2", "--mixed_precision", "bf16",
                  "--ema_decay", "0.9"), 3, sigterm=True,
        record={"max_tokens_per_batch": 64, "gradient_accumulation_steps": 2, "mixed_precision": "bf16",
                "ema_decay": 0.9}),
    "stream": Feature("toy", ("--max_steps", "20"), 7, stream=True),
    "stream + 2 workers": Feature("toy", ("--max_steps", "20", "--dataloader_num_workers", "2"), 7, stream=True,
                                  record={"dataloader_num_workers": 2}),
    "shuffled stream": Feature("toy", ("--max_steps", "20", "--stream_shuffle", "8"), 7, sigterm=True, stream=True,
                               record={"stream_shuffle": 8}),
    "augmentation (SeededItems)": Feature("toy", ("--augment", "0.3", "--seeded_items", "true",
                                                  "--dataloader_num_workers", "2"), 7,
                                          record={"augment": 0.3, "seeded_items": True}),
    "rollback": Feature("toy", (*ROLLBACK, "--spike_index", "20", "--spike_scale", "1e4"), 9,
                        record={"on_spike": "rollback"}),
    "rollback + padding-free": Feature("token", (*ROLLBACK[:6], "--padding_free", "true", "--spike_batch", "4"), 8,
                                       record={"on_spike": "rollback", "padding_free": True}),
    "rollback + token budget": Feature("token", (*ROLLBACK[:6], "--max_tokens_per_batch", "64", "--spike_batch",
                                                 "4"), 8, record={"on_spike": "rollback", "max_tokens_per_batch": 64}),
    "spike skip": Feature("toy", ("--spike_window", "3", "--spike_threshold", "10", "--on_spike", "skip",
                                  "--spike_index", "20", "--spike_scale", "1e4"), 7, record={"on_spike": "skip"}),
    "dropout": Feature("toy", ("--dropout", "0.2"), 7, record={"dropout": 0.2}),
    "weight averaging": Feature("toy", ("--ema_decay", "0.9"), 7, record={"ema_decay": 0.9}),
    "gradient checkpointing": Feature("token", ("--gradient_checkpointing", "true"), 4,
                                      record={"gradient_checkpointing": True}),
    "automatic batch size": Feature("toy", ("--per_device_train_batch_size", "8", "--gradient_accumulation_steps",
                                            "1", "--auto_find_batch_size", "true"), 4, fault="oom_above:4",
                                    record={"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2}),
    "best model + early stopping": Feature("toy", ("--metric_for_best_model", "eval_loss", "--load_best_model_at_end",
                                                   "true", "--early_stopping_patience", "20"), 7,
                                           record={"metric_for_best_model": "eval_loss"}),
    "SIGTERM": Feature("toy", ("--dropout", "0.2"), 7, sigterm=True, record={"dropout": 0.2}),
    "Muon": Feature("toy", ("--optim", "muon"), 7, record={"optim": "muon"}),
    "Muon + accumulation": Feature("toy", ("--optim", "muon", "--gradient_accumulation_steps", "2"), 4,
                                   record={"optim": "muon", "gradient_accumulation_steps": 2}),
    "Muon + bf16": Feature("toy", ("--optim", "muon", "--mixed_precision", "bf16"), 7,
                           record={"optim": "muon", "mixed_precision": "bf16"}),
    "Muon + weight averaging + SIGTERM": Feature("toy", ("--optim", "muon", "--ema_decay", "0.9"), 7, sigterm=True,
                                                 record={"optim": "muon", "ema_decay": 0.9}),
    # checkpoints written in the background (the race itself, a write slower than the steps: test_async_save.py)
    "async save": Feature("toy", ("--async_save", "true"), 7, record={"async_save": True}),
    "async save + stream": Feature("toy", ("--max_steps", "20", "--async_save", "true"), 7, stream=True,
                                   record={"async_save": True}),
    "async save + weight averaging + SIGTERM": Feature("toy", ("--async_save", "true", "--ema_decay", "0.9"), 7,
                                                       sigterm=True, record={"async_save": True, "ema_decay": 0.9}),
}
BASELINES = {"toy": "map-style data", "token": "token baseline"}  # model FLOPs are compared with these
RUNS = {**FEATURES, "token baseline": Feature("token", (), 4)}  # what RunCache can make

INVARIANTS = ("resume", "data", "history", "2 processes", "model FLOPs", "run record")
INVARIANT_TEXT = {
    "resume": "cut mid-epoch (a stop, or SIGTERM) and resumed with `latest`: bitwise the uninterrupted run's weights",
    "data": "each example fed once per epoch; the resumed run feeds exactly the uninterrupted run's batches after "
            "the checkpoint",
    "history": "metrics.jsonl: one timeline, its steps never go back",
    "2 processes": "2 processes x B/2 = 1 process x B: the same data (the ranks' halves of each micro-batch), weights "
                   "and evaluation, within TOLERANCE (AdamW "
                   "turns rounding-sized gradient differences into up to 2 x lr on its first steps: bf16 is compared "
                   "after 3 SGD steps)",
    "model FLOPs": "the FLOPs counted per sample (per token) are the model's, as without the feature",
    "run record": "config.yaml names what ran",
}

# 2 processes against 1: the largest weight difference allowed (measured: toy fp32 < 1e-6 after 24 AdamW steps, the
# token model 2.2e-5 after 12, bf16 SGD 3 steps ~1e-4)
TOLERANCE = {"toy": 1e-5, "token": 1e-4, "bf16": 2e-3}

# Cells that are not proven by the tests below: (status, reason or the test that proves it elsewhere).
ELSEWHERE = "tests/core/test_spike_guard.py::test_rollback_gives_bitwise_the_run_whose_data_never_held_the_spiked_batch"
SPECIAL: dict[tuple[str, str], tuple[str, str]] = {
    ("stream", "2 processes"): ("n/a", "each process reads its own shards: the global batch holds other examples "
                                       "than one process's; tests/core/test_stream_resume.py resumes 2 bitwise"),
    ("stream + 2 workers", "2 processes"): ("n/a", "as for a stream"),
    ("shuffled stream", "2 processes"): ("n/a", "as for a stream"),
    ("async save + stream", "2 processes"): ("n/a", "as for a stream"),
    ("stream", "data"): ("proven", "here, on the resumed run; a stream has no epoch-wide index to check once-ness"),
    ("rollback", "data"): ("proven", ELSEWHERE + " (the kept batches are the run's without the spiked one)"),
    ("rollback", "2 processes"): ("proven", "here, with a rank that does not see the newest checkpoint yet; with "
                                            "accumulation: tests/core/test_spike_guard.py::test_rollback_agrees_"
                                            "across_ranks_with_accumulation"),
    ("rollback + padding-free", "2 processes"): ("n/a", "the spiked micro-batch is found by content on 1 process"),
    ("rollback + padding-free", "model FLOPs"): ("n/a", "padding-free rows: attention FLOPs per token depend on "
                                                        "the row's length"),
    ("token budget", "2 processes"): ("proven", "tests/core/test_token_batches.py::test_two_processes_run_as_many_"
                                                "micro_batches_and_give_the_token_mean_gradient (a plan for 2 deals "
                                                "whole batches, one per rank a round: the same number on each rank, "
                                                "the step the token mean of the examples of both)"),
    ("token budget + accumulation + bf16 + weight averaging", "2 processes"): (
        "n/a", "as for a token budget: the plan deals whole batches, not halves of one process's"),
    ("rollback + token budget", "2 processes"): ("n/a", "the spiked micro-batch is found by content on 1 process"),
    ("spike skip", "2 processes"): ("proven", "tests/core/test_spike_guard.py::test_the_guard_agrees_across_ranks_"
                                              "and_resumes_with_its_window_bitwise"),
    ("packing", "model FLOPs"): ("n/a", "packed rows are longer sequences: attention FLOPs per token differ"),
    ("padding-free", "model FLOPs"): ("n/a", "one row of every example: attention FLOPs per token differ"),
    ("packing", "2 processes"): ("proven", "tests/tasks/test_packing.py::test_a_packed_step_on_two_processes_is_the_"
                                           "padded_steps_gradient"),
    ("padding-free", "2 processes"): ("n/a", "the rows of 2 processes are 2 rows, not one: a different batch shape "
                                             "(the step gradient equals the padded one's, test_packing.py)"),
    ("automatic batch size", "2 processes"): ("proven", "tests/core/test_speed.py::test_auto_batch_size_agrees_"
                                                        "across_processes"),
    ("augmentation (SeededItems)", "2 processes"): ("proven", "here: each item's noise is a function of (seed, "
                                                              "epoch, index), on any rank"),
    ("dropout", "2 processes"): ("n/a", "each process draws its own dropout masks; resumed bitwise on 2: "
                                        "tests/launch/test_distributed.py::test_resume_mid_epoch_is_exact"),
    ("Muon + bf16", "2 processes"): ("n/a", "Muon, as AdamW, makes bf16's rounding-sized gradient differences "
                                            "update-sized (Newton-Schulz lifts every direction of the gradient to "
                                            "~1: 0.012 after 3 steps at lr 0.05); bf16 on 2 processes is the bf16 "
                                            "row's (SGD), Muon on 2 the Muon rows' (fp32: 0 difference in its matrix)"),
    ("SIGTERM", "2 processes"): ("n/a", "dropout, as above; SIGTERM agreed across ranks: tests/rundir/"
                                        "test_reliability.py::test_sigterm_saves_at_the_step_boundary_and_exits_"
                                        "cleanly (slow)"),
}
SAID = {  # feature -> the start-up line a run without the fix gets (a test below sees it)
    "augmentation (global RNG)": "the training set's items draw from the global random generator(s) of torch",
}


def cell_status(feature: str, invariant: str) -> tuple[str, str]:
    if (feature, invariant) in SPECIAL:
        return SPECIAL[(feature, invariant)]
    return "proven", "here"


# ------------------------------------------------------------------------------------------------------ the runs


@dataclass
class Runs:
    """One feature's uninterrupted, cut and resumed runs (and its 2-process run, made when first asked for)."""

    feature: Feature
    full: Path
    cut: Path
    checkpoint_step: int  # the step the resumed run started from
    two: Path | None = None
    one: Path | None = None  # the 1-process side of the 2-process comparison (the full run, unless parity flags)


def _argv(feature: Feature, out: Path, data: Path) -> list[str]:
    base = TOY if feature.script == "toy" else TOKEN
    stream = ("--stream_dir", str(data)) if feature.stream else ()
    return ["--output_dir", str(out), *QUIET, *base, *stream, *feature.flags]


def _run(feature: Feature, argv: list[str], monkeypatch, fault: str = "") -> None:
    reset_accelerate()
    main = toy_train.main if feature.script == "toy" else token_train.main
    with monkeypatch.context() as env:
        faults = [f for f in (feature.fault, fault) if f]
        env.setenv("ACCEL_TRAIN_FAULT", faults[-1]) if faults else env.delenv("ACCEL_TRAIN_FAULT", raising=False)
        try:
            run_cli(main, argv)
        except SystemExit as stop:  # run_cli exits 0 after a SIGTERM checkpoint
            assert stop.code == 0, f"{argv}: exit {stop.code}"


class RunCache:
    def __init__(self, root: Path, monkeypatch, ranks):
        self.root, self.monkeypatch, self.runs, self.ranks = root, monkeypatch, {}, ranks
        self.data = root / "stream"
        toy_train.write_stream_shards(self.data, 48, 8)

    def get(self, name: str) -> Runs:
        if name not in self.runs:
            self.runs[name] = self.make(name)
        return self.runs[name]

    def make(self, name: str) -> Runs:
        feature = RUNS[name]
        folder = self.root / re.sub(r"\W+", "_", name)
        full, cut = folder / "full", folder / "cut"
        _run(feature, _argv(feature, full, self.data), self.monkeypatch)
        if feature.sigterm:  # SIGTERM after step k: the loop checkpoints at k + 1 and stops
            _run(feature, _argv(feature, cut, self.data), self.monkeypatch, f"sigterm_after_step:{feature.cut_after}")
            at = feature.cut_after + 1
        else:
            _run(feature, [*_argv(feature, cut, self.data), "--stop_at_step", str(feature.cut_after)], self.monkeypatch)
            at = feature.cut_after
        newest = sorted((cut / "checkpoints").glob("step-*"))[-1]
        state = json.loads((newest / "train_state.json").read_text())
        assert newest.name == f"step-{at:08d}" and state["batch_in_epoch"] > 0, \
            f"{name}: the cut must checkpoint step {at} inside an epoch: {newest.name}, batch {state['batch_in_epoch']}"
        _run(feature, [*_argv(feature, cut, self.data), "--resume_from_checkpoint", "latest"], self.monkeypatch)
        return Runs(feature, full, cut, at)

    def two_processes(self, name: str) -> Runs:
        runs = self.get(name)
        if runs.two is None:
            feature, runs.two, runs.one = runs.feature, runs.full.parent / "two", runs.full
            steps = list(feature.parity)
            if steps:
                runs.one = runs.full.parent / "one"
                _run(feature, [*_argv(feature, runs.one, self.data), *steps], self.monkeypatch)
            argv = [*_argv(feature, runs.two, self.data), "--per_device_train_batch_size", "2", *steps]
            if "--gradient_accumulation_steps" not in feature.flags:
                argv += ["--gradient_accumulation_steps", "1"]
            fault = {"ACCEL_TRAIN_FAULT": feature.fault} if feature.fault else None
            self.ranks.run(_forked_run, feature.script, argv, env=fault)
        return runs


def _forked_run(script: str, argv: list[str]) -> None:
    """One rank of a 2-process run (conftest's Ranks calls it on each)."""
    try:
        run_cli(toy_train.main if script == "toy" else token_train.main, argv)
    except SystemExit as stop:
        assert stop.code == 0


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ranks):
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield RunCache(tmp_path_factory.mktemp("matrix"), monkeypatch, ranks)


def records(out: Path, script: str) -> list[dict]:
    """The run records of rank 0, oldest first (tests/scripts: toy_rank0_<pid>.json or token_rank0_<pid>.json)."""
    paths = sorted(out.glob(f"{script}_rank0_*.json"), key=lambda p: p.stat().st_mtime_ns)
    return [json.loads(p.read_text()) for p in paths]


def fed(record: dict) -> list:
    return record["indices"] if "indices" in record else record["fed"]


def weights(out: Path) -> dict:
    return load_file(out / "model.safetensors")


# ----------------------------------------------------------------------------------------------- the cells


def proven_cells() -> list[tuple[str, str]]:
    """The cells this module proves (the others are proven elsewhere, or refused, said, n/a: the table)."""
    return [(f, i) for f in FEATURES for i in INVARIANTS
            if cell_status(f, i)[0] == "proven" and cell_status(f, i)[1].startswith("here")]


@pytest.mark.parametrize("feature,invariant", proven_cells(), ids=[f"{f}-{i}" for f, i in proven_cells()])
def test_cell(runs, feature, invariant):
    CHECKS[invariant](runs, feature)


def check_resume(runs: RunCache, name: str) -> None:
    r = runs.get(name)
    a, b = weights(r.full), weights(r.cut)
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst == 0.0, f"{name}: the resumed run's weights differ by {worst}"
    if r.feature.record.get("ema_decay"):  # the average too: it is what eval_ema_* measured
        full = json.loads((r.full / "all_results.json").read_text())
        cut = json.loads((r.cut / "all_results.json").read_text())
        assert full["eval_ema_loss"] == cut["eval_ema_loss"]


def check_data(runs: RunCache, name: str) -> None:
    r = runs.get(name)
    script = r.feature.script
    full = fed(records(r.full, script)[-1])
    cut = records(r.cut, script)  # a run stopped by SIGTERM writes no record: only the resumed one is there
    resumed = fed(cut[-1])
    assert resumed == full[len(full) - len(resumed):], f"{name}: the resumed run fed other batches"
    if len(cut) == 2:  # the cut run's batches, then the resumed run's: the uninterrupted run's, none twice
        assert fed(cut[0]) + resumed == full, f"{name}: cut + resumed != the uninterrupted run's batches"
    if r.feature.record.get("padding_free") and not r.feature.record.get("on_spike"):  # examples, not rows, counted
        state = json.loads((r.cut / "checkpoints" / f"step-{r.checkpoint_step:08d}" / "train_state.json").read_text())
        assert state["samples_seen"] == 4 * r.checkpoint_step, f"{name}: samples counted as rows"
    if script == "toy" and not r.feature.record.get("on_spike"):  # each point once in every whole epoch
        flat = [i for batch in full for i in batch]
        assert len(flat) >= 48
        for epoch in range(len(flat) // 48):
            assert sorted(flat[epoch * 48:(epoch + 1) * 48]) == list(range(48)), f"{name}: epoch {epoch} not once"


def check_history(runs: RunCache, name: str) -> None:
    r = runs.get(name)
    for out in (r.full, r.cut):
        steps = [rec["step"] for rec in read_jsonl(out / "metrics.jsonl") if not rec.get("final")]
        assert steps == sorted(steps), f"{name}: metrics.jsonl's steps go back in {out.name}: {steps}"
    if r.feature.record.get("on_spike") == "rollback":
        marks = [rec for rec in read_jsonl(r.full / "metrics.jsonl") if "spike_rollback_step" in rec]
        assert marks and all(m["step"] < m["spike_rollback_step"] for m in marks)


def check_two_processes(runs: RunCache, name: str) -> None:
    r = runs.two_processes(name)
    tolerance = TOLERANCE["bf16" if "bf16" in name else r.feature.script]
    a, b = weights(r.one), weights(r.two)
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= tolerance, f"{name}: 2 processes differ from 1 by {worst}"
    one = json.loads((r.one / "all_results.json").read_text())
    two = json.loads((r.two / "all_results.json").read_text())
    for key in (k for k in one if k.startswith("eval_") and isinstance(one[k], float)):
        assert two[key] == pytest.approx(one[key], abs=tolerance, rel=tolerance), key
    if r.feature.script == "toy":  # the two ranks' halves of every micro-batch are the 1-process micro-batch
        halves = [fed(json.loads(p.read_text())) for p in sorted(r.two.glob("toy_rank[01]_*.json"))]
        merged = [sorted(a + b) for a, b in zip(*halves, strict=True)]
        assert merged == [sorted(b) for b in fed(records(r.one, "toy")[-1])], f"{name}: the ranks fed other data"


def check_model_flops(runs: RunCache, name: str) -> None:
    r = runs.get(name)
    key = "per_sample" if r.feature.script == "toy" else "per_token"
    reference = _flops(runs.get(BASELINES[r.feature.script]).full)[key]
    assert _flops(r.full)[key] == pytest.approx(reference, rel=1e-6), f"{name}: other FLOPs than the model's"


def _flops(out: Path) -> dict:
    newest = sorted((out / "checkpoints").glob("step-*"))[-1]
    return json.loads((newest / "train_state.json").read_text())["flop_count"]


def check_run_record(runs: RunCache, name: str) -> None:
    import yaml

    r = runs.get(name)
    saved = yaml.safe_load((r.cut / "config.yaml").read_text())
    for key, value in r.feature.record.items():
        assert saved.get(key) == value, f"{name}: config.yaml has {key}={saved.get(key)!r}, ran with {value!r}"


CHECKS = {"resume": check_resume, "data": check_data, "history": check_history, "2 processes": check_two_processes,
          "model FLOPs": check_model_flops, "run record": check_run_record}


def test_every_rank_rolls_back_to_the_main_processes_checkpoint_whatever_its_own_view(runs, tmp_path):
    """On a shared file system a rank may not see the newest checkpoint yet: each rank picking its own "latest" would
    restore different steps (and hang in the next collective). Rank 1 here sees one checkpoint fewer."""
    one = runs.get("rollback").full
    argv = [*_argv(FEATURES["rollback"], tmp_path / "two", runs.data), "--per_device_train_batch_size", "2",
            "--ddp_timeout", "60"]
    runs.ranks.run(_forked_stale_view, argv)
    a, b = weights(one), weights(tmp_path / "two")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= TOLERANCE["toy"]
    marks = [r["rolled_back_to"] for r in read_jsonl(tmp_path / "two" / "metrics.jsonl") if "rolled_back_to" in r]
    assert marks == [r["rolled_back_to"] for r in read_jsonl(one / "metrics.jsonl") if "rolled_back_to" in r]


def _forked_stale_view(argv: list[str]) -> None:
    import torch

    from accel_train.core import guard

    listed = guard.list_checkpoints
    guard.list_checkpoints = lambda out: listed(out)[:-1] if torch.distributed.get_rank() == 1 else listed(out)
    try:
        _forked_run("toy", argv)
    finally:
        guard.list_checkpoints = listed


# ------------------------------------------------------------------------------- said before training, and the table


def test_augmentation_from_the_global_generator_is_said_before_training(tmp_path, capsys, monkeypatch):
    feature = Feature("toy", ("--augment", "0.3", "--max_steps", "2"), 1)
    _run(feature, _argv(feature, tmp_path, tmp_path), monkeypatch)
    assert SAID["augmentation (global RNG)"] in capsys.readouterr().out


def table() -> str:
    head = "| feature | " + " | ".join(INVARIANTS) + " |"
    rows = [head, "|" + "---|" * (len(INVARIANTS) + 1)]
    for name in FEATURES:
        cells = []
        for invariant in INVARIANTS:
            status, where = cell_status(name, invariant)
            cells.append(status if where == "here" else f"{status}: {where}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    rows.append("| augmentation (global RNG) | said: " + SAID["augmentation (global RNG)"] + " ... |" +
                " said |" * (len(INVARIANTS) - 1))
    return "\n".join(rows)


def test_every_cell_is_accounted_for_and_the_docs_hold_the_table():
    statuses = {cell_status(f, i)[0] for f in FEATURES for i in INVARIANTS}
    assert statuses <= {"proven", "refused", "said", "n/a"}
    for (feature, invariant), (_, where) in SPECIAL.items():
        assert feature in FEATURES and invariant in INVARIANTS, (feature, invariant)
        for path, name in re.findall(r"(tests/\S+\.py)::(\w+)", where):
            text = (ROOT / path).read_text()
            assert f"def {name}(" in text, f"{where}: no such test"
            # "(slow)" after a reference says the test is behind the slow marker: it must be, and only then
            marked = re.search(r"@pytest\.mark\.slow\n(@[^\n]*\n)*def " + name + r"\(", text) is not None
            said = re.search(re.escape(name) + r" \(slow\)", where) is not None
            assert marked == said, f"{where}: the slow marker is {'set' if marked else 'not set'} on {name}"
    print("\n" + table())
    docs = (ROOT / "docs" / "matrix.md").read_text()
    assert table() in docs, "docs/matrix.md does not hold the current table: paste the printed one"
