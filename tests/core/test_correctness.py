"""Silent failures an audit found, each pinned: checkpoint timelines and rotation, best-model selection,
resume with a changed config, streams of the wrong length, fp16 with skipped steps, schedules, smaller traps."""

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import toy_train
from conftest import points_run, printed_per_rank, printing_to_a_file, read_jsonl, reset_accelerate, toy_main
from safetensors.torch import load_file
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from accel_train import ConfigError, EarlyStopping, ModelError, TrainConfig, make_plan, run_cli, train
from accel_train.core.accelerator import duplicated_samples
from accel_train.core.hooks import hook_keys, saved_hook_state
from accel_train.core.loss import as_loss_output
from accel_train.errors import CheckpointError
from accel_train.observe.preflight.model_checks import check_schedule
from accel_train.rundir.checkpoint import list_checkpoints, resolve_checkpoint, rotate_checkpoints, verify_checkpoint
from accel_train.rundir.weights import load_weights

pytestmark = pytest.mark.usefixtures("one_thread")
QUIET = ["--report_to", "none", "--disable_tqdm", "--logging_steps", "1"]


def run_toy(capsys, out, *args):
    reset_accelerate()
    run_cli(toy_train.main, ["--output_dir", str(out), *QUIET, *args])
    return capsys.readouterr()


def steps(out):
    return [int(p.name.split("-")[1]) for p in list_checkpoints(out)]


# ----------------------------------------------------------------------------------------- 1. checkpoint timelines


def test_a_corrupt_newest_checkpoint_never_costs_the_good_ones(tmp_path, capsys):
    common = ["--save_strategy", "steps", "--save_steps", "2", "--save_total_limit", "2", "--max_steps", "12",
              "--eval_strategy", "no"]
    run_toy(capsys, tmp_path, *common, "--stop_at_step", "8")
    assert steps(tmp_path) == [6, 8]
    weights = tmp_path / "checkpoints" / "step-00000008" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated: step 8 no longer verifies
    io = run_toy(capsys, tmp_path, *common, "--stop_at_step", "10", "--resume_from_checkpoint", "latest")
    assert "resumed from" in io.out and "step-00000006" in io.out
    assert steps(tmp_path) == [8, 10]  # the new timeline's, both good; before: the corrupt 8 survived alone
    for path in list_checkpoints(tmp_path):
        verify_checkpoint(path)
    assert (tmp_path / "checkpoints" / "superseded" / "step-00000008").is_dir()  # moved aside, not deleted
    assert resolve_checkpoint(tmp_path, "latest").name == "step-00000010"


def test_resuming_an_older_checkpoint_starts_a_new_timeline(tmp_path, capsys):
    common = ["--save_strategy", "steps", "--save_steps", "3", "--max_steps", "12", "--eval_strategy", "no"]
    run_toy(capsys, tmp_path, *common, "--stop_at_step", "9")
    assert steps(tmp_path) == [3, 6, 9]
    older = tmp_path / "checkpoints" / "step-00000003"
    io = run_toy(capsys, tmp_path, *common, "--stop_at_step", "4", "--resume_from_checkpoint", str(older))
    assert "2 checkpoint(s) newer than step 3 belong to the abandoned timeline" in io.out
    assert steps(tmp_path) == [3, 4]
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "superseded").iterdir()) == ["step-00000006",
                                                                                            "step-00000009"]
    assert resolve_checkpoint(tmp_path, "latest").name == "step-00000004", \
        "latest is the newest checkpoint of the live timeline, never a superseded one"


def test_a_directory_that_only_looks_like_a_checkpoint_is_left_alone(tmp_path, capsys):
    run_toy(capsys, tmp_path, "--save_strategy", "steps", "--save_steps", "4", "--max_steps", "8",
            "--eval_strategy", "no")
    backup = tmp_path / "checkpoints" / "step-00000012.bak"
    shutil.copytree(tmp_path / "checkpoints" / "step-00000008", backup)
    assert steps(tmp_path) == [4, 8], "a folder that only looks like a checkpoint (step-N.bak) is not listed"
    assert [p.name for p in rotate_checkpoints(tmp_path, 1, None)] == ["step-00000004"]
    assert backup.is_dir()


def test_a_resume_in_another_precision_says_so_and_records_the_new_one(tmp_path, capsys):
    """A run cut at step 4 in fp32 and resumed in bf16 (a legitimate choice: an fp16 run that overflows goes on in
    bf16) is not the uninterrupted run bitwise: the start-up report says so, and the checkpoints it writes record
    bf16; resumed in the same precision, nothing is said."""
    common = ["--save_strategy", "steps", "--save_steps", "4", "--max_steps", "8", "--eval_strategy", "no"]
    run_toy(capsys, tmp_path, *common, "--stop_at_step", "4")
    state = json.loads((tmp_path / "checkpoints" / "step-00000004" / "train_state.json").read_text())
    assert state["precision"] == "fp32"
    io = run_toy(capsys, tmp_path, *common, "--mixed_precision", "bf16", "--resume_from_checkpoint", "latest")
    assert "precision: the checkpoint was trained in fp32, this run goes on in bf16 autocast on cpu" in io.out
    assert "not bitwise" in io.out
    state = json.loads((tmp_path / "checkpoints" / "step-00000008" / "train_state.json").read_text())
    assert state["precision"] == "bf16 autocast on cpu"
    io = run_toy(capsys, tmp_path / "same", *common, "--stop_at_step", "4")
    io = run_toy(capsys, tmp_path / "same", *common, "--resume_from_checkpoint", "latest")
    assert "resumed from" in io.out and "precision:" not in io.out


def test_rotation_counts_only_checkpoints_that_verify(tmp_path, capsys):
    run_toy(capsys, tmp_path, "--save_strategy", "steps", "--save_steps", "2", "--max_steps", "8",
            "--eval_strategy", "no")
    newest = tmp_path / "checkpoints" / "step-00000008" / "optimizer.bin"
    newest.write_bytes(newest.read_bytes()[:-3] + b"xyz")
    rotate_checkpoints(tmp_path, 1, None)
    assert steps(tmp_path) == [6, 8]  # 6 is the newest good one: kept; 8 does not count toward the limit


# ------------------------------------------------------------------------------------------ 2. best model


def test_a_nan_evaluation_is_never_the_best(tmp_path, capsys):
    result = points_run(tmp_path, [math.nan, 0.5, 0.7, 0.6, 0.7])
    assert result.state.best_metric == 0.7 and result.state.best_checkpoint == "step-00000006"
    restored = [line for line in capsys.readouterr().out.splitlines() if "restored the best checkpoint" in line]
    assert len(restored) == 1 and restored[0].endswith("step-00000006 (eval_score = 0.7)")


def test_resuming_with_another_metric_does_not_compare_across_metrics(tmp_path, capsys):
    # run 1 keeps the lowest score (a stale 1.0 of a lower-is-better metric); run 2 chooses by eval_accuracy, and
    # its early stopping (patience 1) starts afresh too: against the stale 1.0 it stopped at step 6
    points_run(tmp_path, [1.0, 2.0, 3.0, 4.0, 5.0], greater_is_better=False, max_steps=4, early_stopping_patience=1)
    capsys.readouterr()
    result = points_run(tmp_path, [0.9, 0.95, 0.8], resume_from_checkpoint="latest", metric_for_best_model="score",
                        greater_is_better=True, early_stopping_patience=1)
    out = capsys.readouterr().out
    assert "this run chooses by eval_score: the best is tracked afresh" in out
    assert result.state.best_metric == 0.95 and result.state.best_checkpoint == "step-00000008"
    assert result.state.step == 8 and "early stopping" not in out


# ---------------------------------------------------------------------------------- 3. resume with a changed config


def test_a_changed_learning_rate_is_applied_on_resume_and_said(tmp_path, capsys):
    common = ["--optim", "sgd", "--lr_scheduler_type", "constant", "--save_strategy", "steps", "--save_steps", "2",
              "--max_steps", "8", "--eval_strategy", "no"]
    run_toy(capsys, tmp_path, *common, "--learning_rate", "0.05", "--stop_at_step", "4")
    io = run_toy(capsys, tmp_path, *common, "--learning_rate", "0.5", "--resume_from_checkpoint", "latest")
    assert "learning_rate 0.05 -> 0.5: applied to the loaded optimizer and schedule" in io.out
    rates = {r["step"]: r["learning_rate"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "learning_rate" in r}
    assert rates[4] == pytest.approx(0.05) and rates[5] == pytest.approx(0.5) and rates[8] == pytest.approx(0.5)


def refused_resume(capsys, out, first: list[str], then: list[str]) -> str:
    """A toy run with `first` stopped at step 4 (checkpoints every 2 of 8), resumed from latest with `then`
    instead: the resume must exit with a message and no traceback, which is returned."""
    common = ["--save_strategy", "steps", "--save_steps", "2", "--max_steps", "8", "--eval_strategy", "no"]
    run_toy(capsys, out, *common, *first, "--stop_at_step", "4")
    reset_accelerate()
    with pytest.raises(SystemExit):
        run_cli(toy_train.main, ["--output_dir", str(out), *QUIET, *common, *then, "--resume_from_checkpoint",
                                 "latest"])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-2000:]
    return err


def test_a_resume_over_another_training_set_is_refused_by_name(tmp_path, capsys, tiny_bert):
    """A checkpoint's data position (epoch, batch) counts batches of the set it was trained on: before, a resume over
    more examples, or over examples of other lengths where batches are grouped by length, went on at that position
    of another order, silently. Refused, naming both; the same data resumes."""
    err = refused_resume(capsys, tmp_path / "toy", [], ["--num_samples", "120"])
    assert "was trained on 96 training examples, this run has 120: the data changed" in err
    assert "(epoch 0, batch 4)" in err and "Resume with the data it was trained with" in err
    state = json.loads((list_checkpoints(tmp_path / "toy")[-1] / "train_state.json").read_text())
    assert state["data"] == [96, 0]  # no lengths: the points are not grouped
    run_toy(capsys, tmp_path / "toy", "--save_strategy", "steps", "--save_steps", "2", "--max_steps", "8",
            "--eval_strategy", "no", "--resume_from_checkpoint", "latest")  # the same data resumes
    # the NLP recipe groups batches of examples by length: the same 64 sentences cut at 8 tokens are other lengths
    import random

    from conftest import FILLER, nlp_main

    rng = random.Random(5)
    (tmp_path / "train.txt").write_text("".join(f"{i % 2} {' '.join(rng.choices(FILLER, k=rng.randint(2, 20)))}\n"
                                                for i in range(64)))
    args = ["--model_name_or_path", str(tiny_bert), "--train_file", str(tmp_path / "train.txt"), "--output_dir",
            str(tmp_path / "nlp"), "--report_to", "none", "--disable_tqdm", "--max_tokens_per_batch", "0",
            "--per_device_train_batch_size", "8", "--max_steps", "4", "--save_strategy", "steps", "--save_steps", "2",
            "--eval_strategy", "no", "--load_best_model_at_end", "false", "--max_seq_length", "32"]
    nlp_main([*args, "--max_steps", "2"])
    with pytest.raises(CheckpointError, match="was trained on 57 training examples of other lengths than this run's "
                                              r"\(its batches are grouped by length\)"):  # 7 held out to evaluate
        nlp_main([*args, "--max_seq_length", "8", "--resume_from_checkpoint", "latest"])
    nlp_main([*args, "--resume_from_checkpoint", "latest"])


def test_the_data_check_names_a_changed_batching_and_takes_only_a_samplers_list_of_lengths(tmp_path):
    from accel_train.core.data import LengthGroupedSampler, data_fingerprint
    from accel_train.core.restore import check_data
    from accel_train.core.state import TrainState

    grouped = DataLoader(list(range(10)), batch_size=2, sampler=LengthGroupedSampler(list(range(3, 13)), 2))
    plain = DataLoader(list(range(10)), batch_size=2)
    assert data_fingerprint(grouped)[0] == 10 and data_fingerprint(grouped)[1] != 0
    assert data_fingerprint(plain) == [10, 0]
    with pytest.raises(CheckpointError, match="was trained without batches grouped by length, this run batches with "
                                              r"\(--group_by_length"):
        check_data(TrainState(data=data_fingerprint(plain), epoch=0, batch_in_epoch=3), grouped, tmp_path)

    class Named(LengthGroupedSampler):
        def lengths(self):  # a method of that name is no list of lengths
            return []

    named = DataLoader(list(range(10)), batch_size=2)
    named.batch_sampler.sampler = Named.__new__(Named)
    assert data_fingerprint(named) == [10, 0]


def test_a_same_step_checkpoint_is_replaced_only_once_the_new_one_is_in_place(tmp_path, monkeypatch):
    """publish() moves a checkpoint of the same step aside and deletes it only once the new one is in its place: a
    rename that fails leaves the old one where it was (before, it was deleted first, and the new one with it)."""
    import os

    from accel_train.rundir import checkpoint as ckpt

    final, tmp = tmp_path / "step-00000004", tmp_path / ".tmp-step-00000004"
    for folder, text in ((final, "old"), (tmp, "new")):
        folder.mkdir()
        (folder / "model.safetensors").write_text(text)
    real = os.replace

    def failing(src, dst):
        if Path(src) == tmp:
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", failing)
    assert isinstance(ckpt.publish(tmp, final), OSError)
    assert (final / "model.safetensors").read_text() == "old" and not tmp.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]
    monkeypatch.undo()
    tmp.mkdir()
    (tmp / "model.safetensors").write_text("new")
    assert ckpt.publish(tmp, final) is None
    assert (final / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]
    # a crash between the two renames leaves the old one aside: the next rotation puts it back (or, where the new
    # one took its place, removes it)
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / ".old-step-00000006").mkdir(parents=True)
    (checkpoints / ".old-step-00000004").mkdir()
    (checkpoints / "step-00000004").mkdir()
    ckpt.rotate_checkpoints(tmp_path / "run", None, None)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000004", "step-00000006"]


def test_a_checkpoints_train_state_is_amended_as_safely_as_it_was_written(tmp_path, monkeypatch):
    """amend_train_state (an evaluation a hook asked for at a SIGTERM's step, after the step's checkpoint was
    written): the checkpoint verifies with the new train state, its other files hard links of the old ones (not
    copied, not hashed again); a failure on the way (the manifest's write) raises a CheckpointError and leaves the old
    checkpoint as it was, and nothing beside it."""
    from accel_train.rundir import checkpoint as ckpt

    accelerator = SimpleNamespace(is_main_process=True, num_processes=1)
    path = tmp_path / "step-00000003"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"weights")
    (path / "train_state.json").write_text(json.dumps({"step": 3, "evaluation_pending": False}))
    ckpt.write_manifest(path, 3, {"w": [2]}, 1)
    weights = (path / "model.safetensors").stat().st_ino

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "write_manifest", full_disk)
    with pytest.raises(CheckpointError, match="No space left on device. The previous checkpoints are untouched"):
        ckpt.amend_train_state(accelerator, path, {"evaluation_pending": True})
    assert ckpt.load_train_state(path)["evaluation_pending"] is False and ckpt.verify_checkpoint(path)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000003"]
    monkeypatch.undo()
    ckpt.amend_train_state(accelerator, path, {"evaluation_pending": True})
    assert ckpt.load_train_state(path) == {"step": 3, "evaluation_pending": True}
    assert ckpt.verify_checkpoint(path)["shapes"] == {"w": [2]}
    assert (path / "model.safetensors").stat().st_ino == weights  # linked, not copied
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000003"]


def test_latest_resumes_from_a_checkpoint_a_crash_left_aside(tmp_path, capsys):
    """A crash between publish()'s two renames leaves the same-step checkpoint as .old-step-*, its replacement not in
    place: `latest` resumes from it (before, from the checkpoint before it, training those steps again) and ends
    bitwise as the uninterrupted run; the resume puts the folder back under its name first."""
    import os

    flags = ["--report_to", "none", "--disable_tqdm", "--run_report", "false", "--eval_strategy", "no",
             "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "4", "--max_steps", "12"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    toy_main(["--output_dir", str(full), *flags])
    toy_main(["--output_dir", str(cut), *flags, "--stop_at_step", "8"])
    checkpoints = cut / "checkpoints"
    os.replace(checkpoints / "step-00000008", checkpoints / ".old-step-00000008")
    assert [p.name for p in list_checkpoints(cut)] == ["step-00000004", ".old-step-00000008"]
    assert resolve_checkpoint(cut, "latest") == checkpoints / ".old-step-00000008"
    capsys.readouterr()
    toy_main(["--output_dir", str(cut), *flags, "--resume_from_checkpoint", "latest"])
    # put back under its own name first (a step read from the name, the best checkpoint named by it)
    assert f"resumed from {checkpoints / 'step-00000008'} at step 8" in capsys.readouterr().out
    steps = [r["step"] for r in read_jsonl(cut / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 13)), steps  # resumed at 8: no step trained twice
    assert [p.name for p in list_checkpoints(cut)] == [f"step-{s:08d}" for s in (4, 8, 12)]
    full_weights, cut_weights = load_file(full / "model.safetensors"), load_file(cut / "model.safetensors")
    assert all(torch.equal(full_weights[k], cut_weights[k]) for k in full_weights)


def test_a_change_the_loaded_schedule_cannot_follow_is_refused_by_name(tmp_path, capsys):
    err = refused_resume(capsys, tmp_path, ["--lr_scheduler_type", "linear"], ["--lr_scheduler_type", "cosine"])
    assert "resuming with changed lr_scheduler_type ('linear' -> 'cosine')" in err


def test_another_optimizer_or_other_param_groups_are_refused_by_name_not_by_torchs_load(tmp_path, capsys):
    """--optim muon splits the groups AdamW had: the checkpoint's optimizer state has another number of groups, which
    torch's load_state_dict would meet with its ValueError; the changed --optim is named before anything is loaded.
    Groups of the same number with other parameters in them (a layer frozen) are a CheckpointError naming the cause."""
    err = refused_resume(capsys, tmp_path, [], ["--optim", "muon"])
    assert "resuming with changed optim ('adamw' -> 'muon')" in err

    def two_layers(frozen: bool):
        reset_accelerate()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        model[0].requires_grad_(not frozen)  # decay {w0, w1} and no-decay {b0, b1}, or {w1} and {b1}
        config = TrainConfig(output_dir=str(tmp_path / "frozen"), report_to=["none"], disable_tqdm=True,
                             run_report=False, per_device_train_batch_size=4, max_steps=4, save_strategy="steps",
                             save_steps=2, weight_decay=0.1, resume_from_checkpoint="latest" if frozen else None)
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
        train(model, DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4), config=config,
              loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))

    two_layers(frozen=False)
    with pytest.raises(CheckpointError, match=r"its optimizer state does not fit this run's optimizer \(.*parameter "
                                              r"group.*\): which parameters train, or how they are grouped, changed"):
        two_layers(frozen=True)


def test_an_evaluation_stream_on_several_processes_is_refused():
    """Each process would read its own part of a stream of unknown length: a hang in the gather, or items counted
    twice. Refused before training; on one process it is evaluated as it comes."""
    from accel_train.core.evaluation import prepare_for_evaluation

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(37))

    with pytest.raises(ConfigError, match="the evaluation set is a stream .* on 2 processes"):
        prepare_for_evaluation(SimpleNamespace(num_processes=2), DataLoader(Stream(), batch_size=8))
    assert prepare_for_evaluation(SimpleNamespace(num_processes=1, prepare=lambda loader: loader),
                                  DataLoader(Stream(), batch_size=8)) is not None


def test_a_failing_final_evaluation_without_checkpoints_writes_the_model_first(tmp_path):
    """--save_strategy no: a metric that fails on the test split after training had nothing but memory to lose
    the trained weights from. The final model is written, then the error raised."""
    from accel_train.errors import MetricsError

    torch.manual_seed(0)
    x = torch.randn(32, 6)
    data = TensorDataset(x, (x[:, 0] > 0).long())

    def broken(outputs):
        raise ZeroDivisionError("a metric that fails on the test split")

    config = TrainConfig(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=8, save_strategy="no",
                         eval_strategy="no", report_to=["none"], disable_tqdm=True, run_report=False, preflight=False)
    reset_accelerate()
    model = torch.nn.Linear(6, 2)
    with pytest.raises(MetricsError):
        train(model, DataLoader(data, batch_size=8), config=config, metrics_fn=broken,
              final_eval_loaders={"test": DataLoader(data, batch_size=8)},
              loss_fn=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    saved = load_file(tmp_path / "model.safetensors")
    assert torch.equal(saved["weight"], model.weight.detach()) and torch.equal(saved["bias"], model.bias.detach())


def test_hook_state_follows_its_name_not_its_position():
    class Counter:
        def state_dict(self):
            return {"n": 1}

        def load_state_dict(self, state):
            raise AssertionError("not this hook's state")

    stopping = EarlyStopping("eval_loss", "min", patience=3)
    stopping.load_state_dict({"best": 0.25, "bad_evaluations": 2, "stopped_at": None})
    saved = {key: hook.state_dict() for key, hook in zip(hook_keys([stopping]), [stopping], strict=True)}
    hooks = [Counter(), EarlyStopping("eval_loss", "min", patience=3)]  # one more hook, in front
    for key, hook in zip(hook_keys(hooks), hooks, strict=True):
        if saved_hook_state(saved, key) is not None:
            hook.load_state_dict(saved_hook_state(saved, key))
    assert hooks[1].bad_evaluations == 2 and hooks[1].best == 0.25
    # checkpoints written before: keyed by position ("1:EarlyStopping"), still found by class
    assert saved_hook_state({"1:EarlyStopping": {"best": 1.0}}, "EarlyStopping") == {"best": 1.0}
    assert hook_keys([stopping, EarlyStopping()]) == ["EarlyStopping", "EarlyStopping#2"]


# -------------------------------------------------------------------------------------- 4. streams


class Stream(IterableDataset):
    """Yields `real` points but claims `claimed` as its length (None: no __len__ at all)."""

    def __init__(self, real: int, claimed=None):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(real, 6, generator=g)
        self.claimed = claimed

    def __iter__(self):
        for i, x in enumerate(self.x):
            yield {"x": x, "labels": (x[0] > 0).long(), "index": i}

    def __len__(self):
        if self.claimed is None:
            raise TypeError("no length")
        return self.claimed


def stream_run(tmp_path, dataset, accumulation=1, **overrides):
    settings = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=accumulation,
                    optim="sgd", sgd_momentum=0.0, learning_rate=0.1, lr_scheduler_type="constant", report_to=["none"],
                    disable_tqdm=True, run_report=False, eval_strategy="no", save_strategy="no", max_grad_norm=0.0,
                    logging_steps=1)
    config = TrainConfig(**{**settings, **overrides})
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2)

    def loss_fn(model, batch):
        return torch.nn.functional.cross_entropy(model(batch["x"]), batch["labels"])

    reset_accelerate()
    return train(model, DataLoader(dataset, batch_size=4), config=config, loss_fn=loss_fn)


@pytest.mark.timeout(120)
def test_a_stream_shorter_than_its_length_ends_its_epochs_where_it_runs_out(tmp_path):
    result = stream_run(tmp_path, Stream(12, claimed=20), max_steps=9)  # the timeout fails a loop that never ends
    assert result.state.step == 9 and result.state.epoch == 3  # 3 real batches an epoch


def test_a_stream_longer_than_its_length_trains_like_its_real_length(tmp_path):
    # accumulation 3 over 5 real batches: windows of 3 and 2; before: scales 1, 3, -1.5, ... (gradient ascent)
    stream = stream_run(tmp_path / "stream", Stream(20, claimed=8), accumulation=3, max_steps=4)
    reference = stream_run(tmp_path / "map", [{"x": x, "labels": (x[0] > 0).long()} for x in Stream(20).x],
                           accumulation=3, max_steps=4)
    assert stream.state.step == 4 and stream.state.epoch == 2  # 2 epochs x (3 + 2 micro-batches)
    a, b = stream.model.weight, reference.model.weight
    assert torch.allclose(a, b, atol=1e-6)


def test_a_stream_without_a_length_trains_with_max_steps(tmp_path):
    with pytest.raises(ConfigError, match="give --max_steps"):
        stream_run(tmp_path / "a", Stream(12))
    result = stream_run(tmp_path / "b", Stream(12), max_steps=7)
    assert result.state.step == 7 and result.state.epoch == 2


def read_a_stream(argv: list[str]) -> None:
    """One rank of a run on a stream of 4 generated shards of 6 rows: writes seen_rank<R>.json (the rows its loss saw,
    its last step) into the output directory."""
    import datasets

    from accel_train import build_accelerator, make_loader, parse_config

    reset_accelerate()
    (config,) = parse_config(argv=argv)
    accelerator = build_accelerator(config)

    def rows(shards):
        for shard in shards:
            for i in range(6):
                yield {"x": [float(shard), float(i)] * 3, "index": shard * 100 + i}

    stream = datasets.IterableDataset.from_generator(rows, gen_kwargs={"shards": [0, 1, 2, 3]}).with_format("torch")
    seen = []

    def loss_fn(model, batch):
        seen.extend(batch["index"].tolist())
        return model(batch["x"].float()).pow(2).mean()

    result = train(torch.nn.Linear(6, 1), make_loader(stream, config, train=True), config=config, loss_fn=loss_fn,
                   accelerator=accelerator)
    record = {"rank": accelerator.process_index, "seen": seen, "step": result.state.step}
    Path(config.output_dir, f"seen_rank{accelerator.process_index}.json").write_text(json.dumps(record))


def test_each_process_reads_its_own_shard_of_a_stream(tmp_path, ranks):
    """On the session's two gloo ranks."""
    out = tmp_path / "o"
    ranks.run(read_a_stream, ["--output_dir", str(out), "--max_steps", "6", "--report_to", "none",
                              "--per_device_train_batch_size", "3", "--disable_tqdm", "--eval_strategy", "no",
                              "--save_strategy", "no", "--run_report", "false", "--learning_rate", "0.01"])
    ranks_seen = [json.loads((out / f"seen_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["rank"] for r in ranks_seen] == [0, 1] and all(r["step"] == 6 for r in ranks_seen)
    first, second = (set(r["seen"]) for r in ranks_seen)
    assert first and second and not first & second  # disjoint shards: no sample read by both processes
    assert {i // 100 for i in first}.isdisjoint({i // 100 for i in second})


# -------------------------------------------------------------------------------- 5. fp16 with skipped steps


def test_skipping_a_nonfinite_step_under_fp16_keeps_the_loss_scaler_working(tmp_path):
    from accelerate import Accelerator

    reset_accelerate()
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    # on a GPU Accelerate makes these; on a CPU it trains fp32 without them, so hand it the same scaler calls
    accelerator.native_amp, accelerator.scaler = True, torch.amp.GradScaler("cpu")
    data = toy_train.Points(64, 0, poison=5)
    config = TrainConfig(output_dir=str(tmp_path), num_train_epochs=1, per_device_train_batch_size=8,
                         on_nonfinite="skip", report_to=["none"], disable_tqdm=True, run_report=False,
                         eval_strategy="no", save_strategy="no", logging_steps=1, preflight=False)
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2)

    def loss_fn(model, batch):
        return torch.nn.functional.cross_entropy(model(batch["x"]).float(), batch["labels"])

    result = train(model, DataLoader(data, batch_size=8), config=config, loss_fn=loss_fn, accelerator=accelerator)
    assert result.state.step == 8 and result.state.nonfinite_skips == 1, \
        "a skipped non-finite step leaves the scaler ready for the next one"
    assert torch.isfinite(model.weight).all()


@pytest.mark.parametrize("optim", ["adamw", "adamw_torch"])
def test_an_fp16_overflow_is_counted_and_holds_the_schedule_with_the_fused_kernel_too(tmp_path, optim):
    """A finite loss that overflows once scaled: the scaler skips the update. torch's fused AdamW (the default)
    is called by the scaler anyway and skips inside its kernel, so Accelerate's optimizer_step_was_skipped stays
    False (huggingface/accelerate#4242); the loop reads the scaler's scale, so both kernels count the overflow in
    skipped_steps and leave the schedule where it was for that step."""
    from accelerate import Accelerator

    reset_accelerate()
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    accelerator.native_amp, accelerator.scaler = True, torch.amp.GradScaler("cpu")  # as GPU fp16 has them
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(0))

    def loss_fn(model, batch):  # the first batch's loss x 1e36: finite, and inf once the scaler multiplies it by 65536
        inputs, labels, index = batch
        loss = torch.nn.functional.cross_entropy(model(inputs).float(), labels)
        return loss * 1e36 if 5 in index.tolist() else loss

    config = TrainConfig(output_dir=str(tmp_path / optim), num_train_epochs=1, per_device_train_batch_size=8,
                         optim=optim, report_to=["none"], disable_tqdm=True, run_report=False, eval_strategy="no",
                         save_strategy="no", logging_steps=1, preflight=False, max_grad_norm=0)
    torch.manual_seed(0)
    data = TensorDataset(x, (x[:, 0] > 0).long(), torch.arange(64))
    result = train(torch.nn.Linear(6, 2), DataLoader(data, batch_size=8), config=config, accelerator=accelerator,
                   loss_fn=loss_fn)
    assert result.state.step == 8 and result.state.skipped_steps == 1
    rates = [r["learning_rate"] for r in read_jsonl(tmp_path / optim / "metrics.jsonl") if "learning_rate" in r]
    # the rate after each step of a linear decay over 8: the skipped first step left it at its peak
    assert rates == pytest.approx([5e-5 * (8 - k) / 8 for k in range(8)])


# ------------------------------------------------------------------------------------------------ 6. schedules


def test_reduce_on_plateau_without_evaluations_is_refused(tmp_path, capsys):
    reset_accelerate()
    with pytest.raises(SystemExit):
        run_cli(toy_train.main, ["--output_dir", str(tmp_path), *QUIET, "--lr_scheduler_type", "reduce_on_plateau",
                                 "--eval_strategy", "no"])
    err = capsys.readouterr().err
    assert "reduce_on_plateau changes the learning rate on evaluations, and this run has none" in err


def test_a_step_size_that_looks_like_epochs_is_warned_about_and_epochs_are_accepted(tmp_path, capsys):
    run_toy(capsys, tmp_path / "steps", "--lr_scheduler_type", "step", "--lr_scheduler_kwargs",
            '{"step_size": 3, "gamma": 0.5}', "--num_train_epochs", "4", "--per_device_train_batch_size", "8",
            "--run_report", "true")
    findings = json.loads((tmp_path / "steps" / "report" / "preflight.json").read_text())["findings"]
    [warning] = [f for f in findings if f["level"] == "warning" and "step_size=3" in f["message"]]
    assert "one epoch is 12 steps" in warning["message"] and '{"step_size_epochs": 3}' in warning["fix"]
    run_toy(capsys, tmp_path / "epochs", "--lr_scheduler_type", "step", "--lr_scheduler_kwargs",
            '{"step_size_epochs": 1, "gamma": 0.5}', "--num_train_epochs", "3", "--per_device_train_batch_size", "8",
            "--learning_rate", "0.01")
    rates = {r["step"]: r["learning_rate"] for r in read_jsonl(tmp_path / "epochs" / "metrics.jsonl")
             if "learning_rate" in r}
    assert rates[11] == pytest.approx(0.01) and rates[12] == pytest.approx(0.005) and rates[24] == pytest.approx(0.0025)


def test_the_preflight_does_not_advise_building_what_accel_train_built():
    config = TrainConfig(max_steps=20, learning_rate=1e-2, report_to=["none"])
    plan = make_plan(config, batches_per_epoch=10, num_processes=2)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    from accelerate.scheduler import AcceleratedScheduler

    from accel_train import build_scheduler

    scheduler = AcceleratedScheduler(build_scheduler(optimizer, config, plan), optimizer, step_with_optimizer=True)
    accelerator = SimpleNamespace(num_processes=2, distributed_type=SimpleNamespace(value="MULTI_CPU"))
    session = SimpleNamespace(accelerator=accelerator, config=config, plan=plan, optimizer=optimizer,
                              scheduler=scheduler, scheduler_built_here=True)
    [finding] = check_schedule(session)
    assert finding.level == "error" and "build_accelerator" in finding.fix
    assert "let accel_train build it" not in finding.fix


# ------------------------------------------------------------------------------------------------ 7. --scale_lr


@pytest.mark.parametrize("rule, factor", [("linear", 0.125), ("sqrt", 0.125 ** 0.5)])
def test_scale_lr_follows_the_global_batch_and_is_reported(tmp_path, capsys, rule, factor):
    io = run_toy(capsys, tmp_path, "--scale_lr", rule, "--scale_lr_reference_batch", "64", "--learning_rate", "0.08",
                 "--lr_scheduler_type", "constant", "--per_device_train_batch_size", "8", "--max_steps", "2",
                 "--eval_strategy", "no")
    assert f"peak lr {0.08 * factor:g} (--learning_rate 0.08 x {factor:.4g}: {rule} scaling for a global batch of 8" \
           in io.out
    rates = [r["learning_rate"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "learning_rate" in r]
    assert rates and all(r == pytest.approx(0.08 * factor) for r in rates)


# ------------------------------------------------------------------------------------------------ 8. smaller


def test_a_float_loss_is_refused_naming_the_loss_function():
    def my_loss(model, batch):
        return {"loss": 0.3}

    with pytest.raises(TypeError, match=r"the loss function .*my_loss returned 'loss' as float \(0.3\)"):
        as_loss_output(my_loss(None, None), my_loss)


def test_duplicated_samples_under_even_batches_are_counted():
    # 37 samples, 4 per device, 2 processes: 5 batches each = 40 samples trained, 3 of them twice
    config = TrainConfig(per_device_train_batch_size=4, report_to=["none"])
    plan = make_plan(config, batches_per_epoch=5, num_processes=2)
    assert duplicated_samples(plan, config, 2, 37) == 3
    assert duplicated_samples(plan, config, 1, 37) == 0
    dropped = TrainConfig(per_device_train_batch_size=4, dataloader_drop_last=True, report_to=["none"])
    assert duplicated_samples(plan, dropped, 2, 37) == 0


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.out = torch.nn.Linear(4, 10, bias=False)
        self.out.weight = self.embed.weight  # tied, as a language model's output layer often is

    def forward(self, ids):
        return self.out(self.embed(ids))


def test_a_tied_plain_module_exports_and_loads_back(tmp_path):
    config = TrainConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, report_to=["none"],
                         disable_tqdm=True, run_report=False, eval_strategy="no", save_strategy="no")
    ids = torch.randint(0, 10, (8,))

    def loss_fn(model, batch):
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[0])

    reset_accelerate()
    torch.manual_seed(0)
    trained = train(Tied(), DataLoader(TensorDataset(ids), batch_size=4), config=config, loss_fn=loss_fn).model
    with pytest.raises(RuntimeError, match="Missing key"):  # why the README points to load_weights
        Tied().load_state_dict(load_file(tmp_path / "model.safetensors"))
    loaded = Tied()
    load_weights(loaded, tmp_path)
    assert torch.equal(loaded.out.weight, trained.out.weight) and loaded.out.weight is loaded.embed.weight


def test_load_weights_reads_shards_drops_excluded_names_and_names_what_does_not_fit(tmp_path):
    from safetensors.torch import save_file

    source = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    state = {k: v.clone() for k, v in source.state_dict().items()}
    save_file({k: v for k, v in state.items() if k.startswith("0.")}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({k: v for k, v in state.items() if k.startswith("1.")}, tmp_path / "model-00002-of-00002.safetensors")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        k: f"model-0000{1 if k.startswith('0.') else 2}-of-00002.safetensors" for k in state}}))
    whole = load_weights(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)), tmp_path)
    assert all(torch.equal(whole.state_dict()[k], v) for k, v in state.items()), "sharded weights loaded whole"
    backbone = load_weights(torch.nn.Sequential(torch.nn.Linear(3, 4)), tmp_path, exclude=lambda k: k.startswith("1."))
    assert torch.equal(backbone[0].weight, state["0.weight"]), "the excluded head is left behind, the rest loads"
    with pytest.raises(ModelError, match=r"do not fit the Sequential \(2 unexpected"):
        load_weights(torch.nn.Sequential(torch.nn.Linear(3, 4)), tmp_path)
    with pytest.raises(ModelError, match="size mismatch for 0.weight"):
        load_weights(torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2)), tmp_path)
    with pytest.raises(ModelError, match="no model.safetensors"):
        load_weights(source, tmp_path / "elsewhere")


def test_a_two_process_run_reports_its_duplicated_samples(tmp_path, ranks):
    """On the session's two gloo ranks: the start-up report says it, once (the main process prints it)."""
    ranks.run(printing_to_a_file, toy_main, ["--output_dir", str(tmp_path), "--num_samples", "37",
                                             "--per_device_train_batch_size", "4", "--max_steps", "1", *QUIET])
    printed = printed_per_rank(tmp_path)
    note = "3 sample(s) per epoch are trained twice"
    assert note in printed[0] and note not in printed[1], printed
