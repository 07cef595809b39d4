"""The feature x invariant matrix (docs/matrix.md): every feature of the loop against every promise it keeps.

A cell is *proven* (a test checks it: here, or the named test elsewhere), *refused* by name before training (a test
sees the refusal), *said* before training (the run goes ahead and its start-up report names what does not hold: a
test sees the line), or *n/a* (the reason is in the table). Every cell of FEATURES x INVARIANTS has an entry, and
`test_every_cell_is_accounted_for` fails on a new feature or invariant until its cells are filled in; it prints the
table, which docs/matrix.md holds (a test keeps the two equal).

The table (rows, their flags, each cell's status and reason) is accel_train/verify/matrix.py's: `accel-train verify`
reads it too, to say what this module proves for the combination a user's run makes. The cells are judged with
verify's evidence functions (accel_train/verify/evidence.py, checks.bitwise_comparison, accounting's coverage,
evaluation's metrics): the code that judges a user's run judges the project's own cells.

The runs are tiny and in-process (`main(argv)`); each feature's three runs — uninterrupted, cut (stopped by a hook or
by SIGTERM, which checkpoints), resumed with `latest` — are made once and shared by that feature's cells
(tests/scripts/matrix_runs.py makes them, as HOW here says). The 2-process cells run on the session's two gloo ranks
(conftest's `ranks`, spawned once): the launcher is not what they test, `tests/launch/` launches for real.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from matrix_runs import Feature, Run, RunCache, Runs, argv_of, fed, forked_run, records, run_main, weights

from accel_train.verify import matrix
from accel_train.verify.accounting import coverage_findings
from accel_train.verify.checks import bitwise_comparison
from accel_train.verify.evaluation import compare_metrics, read_metrics
from accel_train.verify.evidence import (
    feed_across_resume,
    flop_count,
    history,
    largest_difference,
    merged_micro_batches,
    run_config,
    steps_going_back,
)
from accel_train.verify.matrix import INVARIANTS, SAID, SPECIAL, cell_status, table

pytestmark = pytest.mark.usefixtures("one_thread")

HOW: dict[str, Run] = {
    "map-style data": Run("toy", 7),
    "accumulation": Run("toy", 4),
    "bf16": Run("toy", 7, parity=("--max_steps", "3", "--optim", "sgd")),
    "packing": Run("token", 2),
    "padding-free": Run("token", 4),
    "chunked CE": Run("token", 4),
    "length buckets": Run("token", 4),
    "token budget": Run("token", 4),
    "token budget + accumulation + bf16 + weight averaging": Run("token", 3, sigterm=True),
    "stream": Run("toy", 7, stream=True),
    "stream + 2 workers": Run("toy", 7, stream=True),
    "shuffled stream": Run("toy", 7, sigterm=True, stream=True),
    "augmentation (SeededItems)": Run("toy", 7),
    "rollback": Run("toy", 9),
    "rollback + padding-free": Run("token", 8),
    "rollback + token budget": Run("token", 8),
    "spike skip": Run("toy", 7),
    # SIGTERM: toy_train's stop acts on a logged step; this one, after step 6, checkpoints step 7 (inside 5-8)
    "logging interval across the cut": Run("toy", 6, sigterm=True),
    "non-finite skip + logging interval across the cut": Run("toy", 6, sigterm=True),
    "sum loss + accumulation + logging interval across the cut": Run("token", 4),
    "dropout": Run("toy", 7),
    "weight averaging": Run("toy", 7),
    "gradient checkpointing": Run("token", 4),
    "automatic batch size": Run("toy", 4, fault="oom_above:4"),
    "best model + early stopping": Run("toy", 7),
    "SIGTERM": Run("toy", 7, sigterm=True),
    "Muon": Run("toy", 7),
    "Muon + accumulation": Run("toy", 4),
    "Muon + bf16": Run("toy", 7),
    "Muon + weight averaging + SIGTERM": Run("toy", 7, sigterm=True),
    "torch.compile + accumulation": Run("toy", 4),
    "async save": Run("toy", 7),
    "async save + stream": Run("toy", 7, stream=True),
    "async save + weight averaging + SIGTERM": Run("toy", 7, sigterm=True),
    "token budget + Muon + async save + SIGTERM": Run("token", 3, sigterm=True),
}
FEATURES: dict[str, Feature] = {name: Feature(**asdict(HOW[name]), flags=row.flags, record=row.record)
                                for name, row in matrix.FEATURES.items() if name in HOW}
BASELINES = {"toy": "map-style data", "token": "token baseline"}  # model FLOPs are compared with these
RUNS = {**FEATURES, "token baseline": Feature("token", 4)}  # what RunCache can make

# 2 processes against 1: the largest weight difference allowed (measured: toy fp32 < 1e-6 after 24 AdamW steps, the
# token model 2.2e-5 after 12, bf16 SGD 3 steps ~1e-4)
TOLERANCE = {"toy": 1e-5, "token": 1e-4, "bf16": 2e-3}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ranks):
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield RunCache(tmp_path_factory.mktemp("matrix"), monkeypatch, ranks, RUNS)


# ----------------------------------------------------------------------------------------------- the cells


def proven_cells() -> list[tuple[str, str]]:
    """The cells this module proves (the others are proven elsewhere, or refused, said, n/a: the table)."""
    return [(f, i) for f in FEATURES for i in INVARIANTS
            if cell_status(f, i)[0] == "proven" and cell_status(f, i)[1].startswith("here")]


@pytest.mark.parametrize("feature,invariant", proven_cells(), ids=[f"{f}-{i}" for f, i in proven_cells()])
def test_cell(runs, feature, invariant):
    CHECKS[invariant](runs, feature)


def check_resume(runs: RunCache, name: str) -> None:
    """verify's resume comparison: the weights bitwise, and the losses logged after the checkpoint bitwise; and the
    run's train_loss."""
    r = runs.get(name)
    weights(r.full), weights(r.cut)  # both wrote their final weights
    compared = bitwise_comparison(r.full, r.cut, after=r.checkpoint_step)
    assert compared["weights_compared"] and compared["tensors_differing"] == 0, \
        f"{name}: the resumed run's weights differ: {compared['largest_differences']}"
    assert compared["first_loss_difference"] is None, f"{name}: {compared['first_loss_difference']}"
    # the whole run's mean loss too: the interval the checkpoint left unlogged is in it (TrainState.pending_loss)
    train = [read_metrics(out, "train").get("loss") for out in (r.full, r.cut)]
    assert train[0] is not None and train[0] == train[1], f"{name}: train_loss {train[0]} resumed {train[1]}"
    check_compiled(r.feature, name, r.full, r.cut)
    if r.feature.record.get("logging_steps", 1) > 1:  # the cut fell inside an interval: the checkpoint carries it
        check_unlogged_interval(r, name)
    if r.feature.record.get("ema_decay"):  # the average too: it is what eval_ema_* measured
        assert read_metrics(r.full, "eval_ema")["loss"] == read_metrics(r.cut, "eval_ema")["loss"]


def check_compiled(feature: Feature, name: str, *runs: Path) -> None:
    """A compiled row's runs ran compiled graphs (the resumed run and each process its own): dynamo falls back to the
    uncompiled model without a word, and the row would prove the eager loop."""
    if feature.record.get("torch_compile"):
        graphs = [read_metrics(out, "train").get("compiled_graphs", 0) for out in runs]
        assert all(graphs), f"{name}: graphs compiled {graphs} in {[out.name for out in runs]}"


def check_unlogged_interval(r: Runs, name: str) -> None:
    """The checkpoint holds the micro-batches of the steps since the last log, less those of a skipped step (their
    losses left the interval, as the update left the weights)."""
    state = json.loads((r.cut / "checkpoints" / f"step-{r.checkpoint_step:08d}" / "train_state.json").read_text())
    last = state["last_log_step"]
    skipped = [rec["nonfinite_skipped_step"] for rec in history(r.full) if "nonfinite_skipped_step" in rec]
    steps = r.checkpoint_step - last - len([s for s in skipped if last < s <= r.checkpoint_step])
    held = sum(part["micro_batches"] for part in state["pending_loss"])
    accumulation = r.feature.record.get("gradient_accumulation_steps", 1)
    assert steps > 0 and held == steps * accumulation, f"{name}: {held} micro-batches held after step {last}"


def check_data(runs: RunCache, name: str) -> None:
    r = runs.get(name)
    script = r.feature.script
    full = fed(records(r.full, script)[-1])
    cut = records(r.cut, script)  # a run stopped by SIGTERM writes no record: only the resumed one is there
    differ = feed_across_resume(full, fed(cut[0]) if len(cut) == 2 else None, fed(cut[-1]))
    assert differ == [], f"{name}: {differ}"
    if r.feature.record.get("padding_free") and not r.feature.record.get("on_spike"):  # examples, not rows, counted
        state = json.loads((r.cut / "checkpoints" / f"step-{r.checkpoint_step:08d}" / "train_state.json").read_text())
        assert state["samples_seen"] == 4 * r.checkpoint_step, f"{name}: samples counted as rows"
    if script == "toy" and not r.feature.record.get("on_spike"):  # each point once in every whole epoch
        flat = [i for batch in full for i in batch]
        assert len(flat) >= 48
        for epoch in range(len(flat) // 48):  # one process, no fill: each index exactly once
            found = coverage_findings(name, epoch, [[flat[epoch * 48:(epoch + 1) * 48]]], {"dataset_length": 48})
            assert found == [], f"{name}: epoch {epoch} not once: {found}"


def check_history(runs: RunCache, name: str) -> None:
    r = runs.get(name)
    for out in (r.full, r.cut):
        assert steps_going_back(out) == [], f"{name}: metrics.jsonl's steps go back in {out.name}"
    if r.feature.record.get("on_spike") == "rollback":
        marks = [rec for rec in history(r.full) if "spike_rollback_step" in rec]
        assert marks and all(m["step"] < m["spike_rollback_step"] for m in marks)
    if r.feature.record.get("on_nonfinite") == "skip":  # the resumed run skips the steps, counted on from the cut
        marks = [[rec for rec in history(out) if "nonfinite_skipped_step" in rec] for out in (r.full, r.cut)]
        steps = [m["step"] for m in marks[0]]
        assert marks[0] == marks[1] and min(steps) <= r.checkpoint_step < max(steps), f"{name}: {marks}"


def check_two_processes(runs: RunCache, name: str) -> None:
    r = runs.two_processes(name)
    tolerance = TOLERANCE["bf16" if "bf16" in name else r.feature.script]
    worst = largest_difference(weights(r.one), weights(r.two))
    assert worst <= tolerance, f"{name}: 2 processes differ from 1 by {worst}"
    check_compiled(r.feature, name, r.one, r.two)
    one, two = read_metrics(r.one), read_metrics(r.two)
    compared = compare_metrics(one, two)
    assert compared["missing"] == [] and compared["metrics"], f"{name}: {compared['missing']}"
    for key, row in compared["metrics"].items():  # within the tolerance absolute or relative (pytest.approx's)
        a, b = row["values"]
        assert abs(a - b) <= max(tolerance, tolerance * abs(a)), f"{name}: eval_{key} {a} against {b}"
    if r.feature.script == "toy":  # the two ranks' halves of every micro-batch are the 1-process micro-batch
        halves = [fed(json.loads(p.read_text())) for p in sorted(r.two.glob("toy_rank[01]_*.json"))]
        merged = merged_micro_batches(halves)
        assert merged == [sorted(b) for b in fed(records(r.one, "toy")[-1])], f"{name}: the ranks fed other data"


def check_model_flops(runs: RunCache, name: str) -> None:
    r = runs.get(name)
    key = "per_sample" if r.feature.script == "toy" else "per_token"
    reference = flop_count(runs.get(BASELINES[r.feature.script]).full)[key]
    assert flop_count(r.full)[key] == pytest.approx(reference, rel=1e-6), f"{name}: other FLOPs than the model's"


def check_run_record(runs: RunCache, name: str) -> None:
    r = runs.get(name)
    saved = run_config(r.cut)
    for key, value in r.feature.record.items():
        assert saved.get(key) == value, f"{name}: config.yaml has {key}={saved.get(key)!r}, ran with {value!r}"


CHECKS = {"resume": check_resume, "data": check_data, "history": check_history, "2 processes": check_two_processes,
          "model FLOPs": check_model_flops, "run record": check_run_record}


def test_every_rank_rolls_back_to_the_main_processes_checkpoint_whatever_its_own_view(runs, tmp_path):
    """On a shared file system a rank may not see the newest checkpoint yet: each rank picking its own "latest" would
    restore different steps (and hang in the next collective). Rank 1 here sees one checkpoint fewer."""
    one = runs.get("rollback").full
    argv = [*argv_of(FEATURES["rollback"], tmp_path / "two", runs.data), "--per_device_train_batch_size", "2",
            "--ddp_timeout", "60"]
    runs.ranks.run(_forked_stale_view, argv)
    assert largest_difference(weights(one), weights(tmp_path / "two")) <= TOLERANCE["toy"]
    marks = [r["rolled_back_to"] for r in history(tmp_path / "two") if "rolled_back_to" in r]
    assert marks == [r["rolled_back_to"] for r in history(one) if "rolled_back_to" in r]


def _forked_stale_view(argv: list[str]) -> None:
    import torch

    from accel_train.core import guard

    listed = guard.list_checkpoints
    guard.list_checkpoints = lambda out: listed(out)[:-1] if torch.distributed.get_rank() == 1 else listed(out)
    try:
        forked_run("toy", argv)
    finally:
        guard.list_checkpoints = listed


def test_the_evidence_the_cells_are_judged_with_sees_each_difference(tmp_path):
    """verify's evidence functions, on what a broken feature would leave (no run): a resumed run that replays a
    micro-batch, a history that goes back, a rank that fed another half, weights of another shape."""
    full = [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert feed_across_resume(full, full[:2], full[2:]) == [] and feed_across_resume(full, None, full[2:]) == []
    assert len(feed_across_resume(full, full[:2], [full[1], full[3]])) == 2  # one replayed, one skipped
    assert len(feed_across_resume(full, full[:1], full[2:])) == 1  # the cut run's last batch lost
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.9}, {"step": 1, "loss": 1.0}, {"step": 3, "final": True})))
    assert steps_going_back(tmp_path) == [(2, 1)] and [r["step"] for r in history(tmp_path)] == [1, 2, 1]
    assert merged_micro_batches([[[0], [3]], [[1], [2]]]) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError):
        merged_micro_batches([[[0], [3]], [[1]]])
    a = {"w": torch.zeros(2)}
    assert largest_difference(a, {"w": torch.tensor([0.0, 0.5])}) == 0.5 and largest_difference(a, a) == 0.0
    assert largest_difference(a, {"w": torch.zeros(3)}) == float("inf") and largest_difference(a, {}) == float("inf")
    assert coverage_findings("x", 0, [[[0, 1, 1]]], {"dataset_length": 3})[0]["kind"] == "coverage"


# ------------------------------------------------------------------------------- said before training, and the table


def test_augmentation_from_the_global_generator_is_said_before_training(tmp_path, capsys, monkeypatch):
    feature = Feature("toy", 1, flags=("--augment", "0.3", "--max_steps", "2"))
    run_main(feature, argv_of(feature, tmp_path, tmp_path), monkeypatch)
    assert SAID["augmentation (global RNG)"] in capsys.readouterr().out


def test_every_cell_is_accounted_for_and_the_docs_hold_the_table():
    """The table is accel_train/verify/matrix.py's; each of its rows is run here (HOW), and its every cell has a
    status."""
    assert HOW.keys() == matrix.FEATURES.keys() == FEATURES.keys(), "a row of the table is not run here (HOW)"
    assert set(matrix.INVARIANT_TEXT) == set(INVARIANTS) == set(CHECKS)
    statuses = {cell_status(f, i)[0] for f in FEATURES for i in INVARIANTS}
    assert statuses <= set(matrix.STATUSES)
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
