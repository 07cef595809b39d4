"""The loss-spike guard (--spike_window / --spike_threshold / --on_spike): a seeded spike is caught at its step, `stop`
names the step and its samples, `skip` drops exactly that update, the guard changes nothing in a run without spikes,
and its window resumes with the run."""

from __future__ import annotations

import json

import pytest
import toy_train
from conftest import Clock, StopOnSave, read_jsonl, reset_accelerate, stop_then_resume, toy_on, toy_records
from safetensors.torch import load_file

from accel_train import run_cli
from accel_train.core.guard import SpikeWatch
from accel_train.rundir.async_checkpoint import CheckpointWriter
from accel_train.rundir.checkpoint import list_checkpoints

QUIET = ["--report_to", "none", "--disable_tqdm", "--run_report", "false", "--learning_rate", "0.05"]
GUARD = ["--spike_window", "5", "--spike_threshold", "3"]
SPIKE = 40  # the training sample whose batch's loss is multiplied by 100 (toy_train --spike_index)


def test_the_window_judges_by_its_mean_once_full_and_a_spike_never_enters_it():
    watch = SpikeWatch(3, 2.0, [])
    assert [watch.judge(x)[0] for x in (1.0, 9.0, 1.0)] == [False, False, False], "no verdict before the window fills"
    spike, reference = watch.judge(8.0)
    assert spike and reference == pytest.approx(11 / 3)
    assert watch.losses == [1.0, 9.0, 1.0], "a spike stays out of the window"
    assert watch.judge(7.0)[0] is False and watch.losses == [9.0, 1.0, 7.0]
    assert watch.judge(float("nan"))[0] is False and watch.losses == [9.0, 1.0, 7.0]


def run(argv):
    reset_accelerate()
    run_cli(toy_train.main, argv)


def spike_steps(out):
    """The optimizer steps after the window filled (5) whose batch held SPIKE, from the indices each step consumed."""
    indices = toy_records(out)[0][-1]["indices"]
    assert len(indices) == 36, "one entry per step: 3 epochs of 12 batches"
    return [step for step, batch_indices in enumerate(indices, start=1) if SPIKE in batch_indices and step > 5]


def test_stop_names_the_step_and_its_samples_and_keeps_the_last_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    reset_accelerate()
    with pytest.raises(SystemExit) as exit_info:
        run_cli(toy_train.main, ["--output_dir", str(out), *QUIET, *GUARD, "--spike_index", str(SPIKE),
                                 "--save_strategy", "steps", "--save_steps", "2"])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert "loss spike at step" in message and "Traceback" not in message, message
    step = int(message.split("loss spike at step ")[1].split()[0])
    # the same data order without the guard: the first step past the window's 5 that consumed the spiked sample
    run(["--output_dir", str(tmp_path / "plain"), *QUIET, "--num_train_epochs", "3"])
    assert step == spike_steps(tmp_path / "plain")[0]
    assert f"{SPIKE}" in message.split("its samples on rank 0: ")[1].split("]")[0]
    assert list_checkpoints(out)[-1].name == f"step-{(step - 1) // 2 * 2:08d}", "the last good checkpoint is kept"


def test_skip_drops_exactly_the_spiked_updates_and_the_guard_changes_nothing_else(tmp_path):
    skip, plain = tmp_path / "skip", tmp_path / "plain"
    run(["--output_dir", str(skip), *QUIET, *GUARD, "--on_spike", "skip", "--spike_index", str(SPIKE),
         "--num_train_epochs", "3"])
    run(["--output_dir", str(plain), *QUIET, "--num_train_epochs", "3"])
    skipped = [r["spike_skipped_step"] for r in read_jsonl(skip / "metrics.jsonl") if "spike_skipped_step" in r]
    expected = spike_steps(skip)  # each of the 3 epochs feeds the spiked sample once
    assert skipped == expected and len(expected) >= 2, (skipped, expected)
    assert json.loads((skip / "all_results.json").read_text())["train_spike_skips"] == len(expected)
    # with the guard on and no spike, training is the same run, bitwise
    guarded = tmp_path / "guarded"
    run(["--output_dir", str(guarded), *QUIET, *GUARD, "--num_train_epochs", "3"])
    a, b = load_file(plain / "model.safetensors"), load_file(guarded / "model.safetensors")
    assert all((a[k] == b[k]).all() for k in a)
    assert not any("spike_skipped_step" in r for r in read_jsonl(guarded / "metrics.jsonl"))


@pytest.mark.parametrize("skipped", ["nonfinite", "spike"])
def test_a_skipped_steps_loss_leaves_the_logged_interval_with_its_update(tmp_path, skipped):
    """Logged every 4 steps: a skipped step's micro-batch stayed in its interval's loss. A non-finite one made the
    whole interval's loss null and train_loss left its 4 steps out; a spike (100x) dominated the interval's mean while
    its update was dropped (a rollback drops it from the log too). Its loss leaves the log with its update: each
    interval logs the mean of its kept steps' losses (the same run logged every step: a skipped step logs none).
    train_loss weighed each interval by all its steps, a skipped one too (an interval of 4 with 1 skipped: the mean
    of 3 with the weight of 4): it is the mean of the kept steps' losses, the every-step run's train_loss."""
    flags = [*QUIET, "--num_train_epochs", "3", *(["--poison_index", "13", "--on_nonfinite", "skip"]
                                                  if skipped == "nonfinite" else
                                                  [*GUARD, "--on_spike", "skip", "--spike_index", str(SPIKE)])]
    run(["--output_dir", str(tmp_path / "every"), *flags, "--logging_steps", "1"])
    run(["--output_dir", str(tmp_path / "fourth"), *flags, "--logging_steps", "4"])
    every = read_jsonl(tmp_path / "every" / "metrics.jsonl")
    skips = {r["step"] for r in every if f"{skipped}_skipped_step" in r}
    kept = {r["step"]: r["loss"] for r in every if "loss" in r and r["step"] not in skips}
    assert len(skips) >= 2 and all(r["loss"] is None for r in every if "loss" in r and r["step"] in skips)
    logged = [r for r in read_jsonl(tmp_path / "fourth" / "metrics.jsonl") if "loss" in r]
    for before, record in zip([{"step": 0}, *logged], logged, strict=False):
        losses = [kept[s] for s in range(before["step"] + 1, record["step"] + 1) if s in kept]
        assert record["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5), record
    every_loss, fourth_loss = (json.loads((tmp_path / d / "all_results.json").read_text())["train_loss"]
                               for d in ("every", "fourth"))
    assert every_loss == pytest.approx(sum(kept.values()) / len(kept), rel=1e-6)
    assert fourth_loss == pytest.approx(every_loss, rel=1e-5)


def skipping(out, processes, *extra):
    """toy_train's flags: skipping spikes, checkpointing every 4 steps, logging every step (so that --stop_at_step can
    cut at any step), the same global batch of 8 on 1 process and on 2."""
    return ["--output_dir", str(out), *QUIET, *GUARD, "--on_spike", "skip", "--spike_index", str(SPIKE),
            "--num_train_epochs", "3", "--dropout", "0.2", "--save_strategy", "steps", "--save_steps", "4",
            "--logging_steps", "1", "--per_device_train_batch_size", str(8 // processes), *extra]


CUT = 14  # inside the second epoch of 12 steps, and a spike judged within 5 steps after it: by the restored window


@pytest.mark.parametrize("processes", [1, 2])
def test_the_guard_agrees_across_ranks_and_resumes_with_its_window_bitwise(tmp_path, ranks, processes):
    """In this process (1) or on the session's two gloo ranks (2): the whole run, and the run cut after step CUT then
    resumed with latest from step 12's checkpoint, as after a SIGKILL: steps 13 and 14 are trained again. A resume
    that forgot the window (or kept the one the cut run went on to fill) could judge nothing until 5 new losses
    filled it, and would take the spike after CUT. What is under test is the window's state; a SIGKILL itself is
    test_reliability's."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    stop_then_resume(lambda out, *more: toy_on(ranks, skipping(out, processes, *more), processes), full, cut, CUT, 12)
    a, b = load_file(full / "model.safetensors"), load_file(cut / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    steps = [[r["spike_skipped_step"] for r in read_jsonl(d / "metrics.jsonl") if "spike_skipped_step" in r]
             for d in (full, cut)]
    assert steps[0] == steps[1] and len(steps[0]) >= 2, steps
    assert any(CUT < step <= CUT + 5 for step in steps[0]), f"no spike for the restored window to judge: {steps}"


# In index order the spiked sample's batch (SPIKE..SPIKE+7 in a global batch of 8) comes back in every epoch: each
# time the run returns to its last checkpoint and replays without it. 33 steps: 3 epochs of the 88 other points. In
# index order the loss also varies 4x on its own, and the spiked batch's loss falls as the model learns: the threshold
# is 10, the spike 10^4x.
ROLLBACK = ["--spike_window", "5", "--spike_threshold", "10", "--shuffle", "false", "--dropout", "0.2",
            "--max_steps", "33", "--save_strategy", "steps", "--save_steps", "4", "--eval_strategy", "no"]


def rollback_then_reference(tmp_path, ranks=None, processes=1, per_device=8, accumulation=1, extra=()):
    """The guarded run with its spikes rolled back, and the run whose data never held the spiked batch: in this
    process, or on the session's gloo `ranks` for 2 processes."""
    batch = ["--per_device_train_batch_size", str(per_device), "--gradient_accumulation_steps", str(accumulation),
             *extra]
    rolled, never = tmp_path / "rolled", tmp_path / "never"
    for out, extra in ((rolled, ["--spike_index", str(SPIKE), "--spike_scale", "1e4"]),
                       (never, ["--without", f"{SPIKE}-{SPIKE + 7}"])):
        args = ["--output_dir", str(out), *QUIET, "--on_spike", "rollback", *ROLLBACK, *batch, *extra]
        if processes == 1:
            run(args)
        else:
            toy_on(ranks, args, processes)
    return rolled, never


def assert_rolled_back_to_the_run_without_the_batch(rolled, never, positions):
    """`positions`: the spiked step's micro-batches in each epoch, per process."""
    a, b = load_file(rolled / "model.safetensors"), load_file(never / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0, "rollback = the data without those batches"
    rows = [r for r in read_jsonl(rolled / "metrics.jsonl") if "spike_rollback_step" in r]
    # the spiked batch is the epoch's 6th: the first spike comes once the window of 5 is full, then once an epoch
    assert [r["spike_rollback_step"] for r in rows] == [6 + e * 11 for e in range(3)], rows
    assert [r["rolled_back_to"] for r in rows] == ["step-00000004", "step-00000016", "step-00000024"]
    assert json.loads((rolled / "all_results.json").read_text())["train_spike_rollbacks"] == 3
    assert not any("spike_rollback_step" in r for r in read_jsonl(never / "metrics.jsonl"))
    final = json.loads(sorted((rolled / "checkpoints").glob("step-*"))[-1].joinpath("train_state.json").read_text())
    assert final["excluded_batches"] == [[epoch, p] for epoch in range(3) for p in positions]
    # the trackers' steps count on past the abandoned ones, in the checkpoints too: a resumed run goes on from there
    assert final["tracker_offset"] == sum(r["rollback_replays_steps"] for r in rows)


def test_rollback_gives_bitwise_the_run_whose_data_never_held_the_spiked_batch(tmp_path):
    """With a weight average as the final model: the rollback returns the average to the checkpoint's too."""
    runs = rollback_then_reference(tmp_path, extra=["--ema_decay", "0.9", "--save_ema_as_final"])
    assert_rolled_back_to_the_run_without_the_batch(*runs, positions=[5])


def test_a_rollback_after_a_resume_with_another_learning_rate_keeps_the_new_rate(tmp_path):
    """A resume applies a changed --learning_rate to the loaded optimizer and schedule; the spike at step 6 then rolls
    back to step 4, which the first run wrote at the old rate: the new one is applied again, so every step from the
    resume on trains at the rate of a run begun at the new one (a linear schedule: a function of the step)."""
    flags = ["--on_spike", "rollback", *ROLLBACK, "--per_device_train_batch_size", "8", "--logging_steps", "1",
             "--spike_index", str(SPIKE), "--spike_scale", "1e4"]
    cut, new = tmp_path / "cut", tmp_path / "new"
    run(["--output_dir", str(cut), *QUIET, *flags, "--stop_at_step", "4"])
    run(["--output_dir", str(cut), *QUIET, *flags, "--learning_rate", "0.1", "--resume_from_checkpoint", "latest"])
    run(["--output_dir", str(new), *QUIET, *flags, "--learning_rate", "0.1"])
    rows = read_jsonl(cut / "metrics.jsonl")
    assert [(r["spike_rollback_step"], r["rolled_back_to"]) for r in rows if "spike_rollback_step" in r][0] == \
        (6, "step-00000004")
    rates = [{r["step"]: r["learning_rate"] for r in read_jsonl(d / "metrics.jsonl") if "learning_rate" in r}
             for d in (cut, new)]  # the last logged value of each step: after the rollbacks
    assert rates[0][4] == pytest.approx(rates[1][4] / 2)  # the first run's last step, at 0.05
    assert len(rates[1]) == 33 and all(rates[0][s] == rates[1][s] for s in range(5, 34))


def test_a_rollback_to_a_checkpoint_without_the_data_fingerprint_keeps_the_runs(tmp_path):
    """A run resumed from a checkpoint written before checkpoints recorded their data (TrainState.data) rolls back to
    it: the rolled-back state keeps this run's fingerprint, so the checkpoints after it still record what they were
    trained on (without it, every later checkpoint would have had none, and a resume over other data gone unchecked)."""
    from accel_train.rundir.checkpoint import TRAIN_STATE, read_manifest, write_manifest

    flags = ["--on_spike", "rollback", *ROLLBACK, "--per_device_train_batch_size", "8", "--spike_index", str(SPIKE),
             "--spike_scale", "1e4"]
    out = tmp_path / "run"
    run(["--output_dir", str(out), *QUIET, *flags, "--stop_at_step", "4", "--logging_steps", "1"])
    old = out / "checkpoints" / "step-00000004"
    state = json.loads((old / TRAIN_STATE).read_text())
    fingerprint = state.pop("data")
    (old / TRAIN_STATE).write_text(json.dumps(state))  # as a checkpoint of before 2026-12-05
    manifest = read_manifest(old)
    write_manifest(old, manifest["step"], manifest["shapes"], manifest["world_size"])
    run(["--output_dir", str(out), *QUIET, *flags, "--resume_from_checkpoint", "latest"])
    rows = [r for r in read_jsonl(out / "metrics.jsonl") if "spike_rollback_step" in r]
    assert rows[0]["rolled_back_to"] == "step-00000004"
    later = json.loads((list_checkpoints(out)[-1] / TRAIN_STATE).read_text())
    assert later["step"] > 4 and later["data"] == fingerprint


def test_the_training_clock_goes_on_through_a_rollback(tmp_path, monkeypatch):
    """train_seconds counts every step trained, the dropped ones too: time to a quality is paid in them. On a clock
    that reads one second later at each reading (Clock), the rolled-back run trained 7 steps more than the run that
    never held the batch (its rollbacks dropped steps 5, 25-27 and the three spiked steps; logged every step), each as
    many readings as a step of the other run, and its clock holds them (and two readings of each rollback's own: the
    seconds it takes of the interval, the start of its wait). With --async_save, on a disk where a pending checkpoint
    lands 1000 s after it is waited for: every save holds the clock while it waits, and the rollback's wait (for the
    checkpoint it may go back to) counted as training, 1000 s a rollback."""
    clock = Clock(monkeypatch)
    settle = CheckpointWriter.settle

    def slow_disk(writer):
        if writer.thread is not None:  # a background write is pending
            clock.now += 1000
        return settle(writer)

    monkeypatch.setattr(CheckpointWriter, "settle", slow_disk)
    rolled, never = rollback_then_reference(tmp_path, extra=["--logging_steps", "1", "--async_save"])
    seconds = [[r["train_seconds"] for r in read_jsonl(d / "metrics.jsonl") if "train_seconds" in r] for d in
               (rolled, never)]
    per_step = seconds[1][-1] / len(seconds[1])  # every step logged: one record a step
    last = json.loads(sorted((rolled / "checkpoints").glob("step-*"))[-1].joinpath("train_state.json").read_text())
    assert last["tracker_offset"] == 4  # logged every step: the trackers' steps count on past steps 5, 25-27
    assert seconds[0][-1] - seconds[1][-1] == pytest.approx(7 * per_step + 2 * 3, rel=0.15), (seconds, per_step)


class SeenOnSave:
    def __init__(self):
        self.seen = {}

    def on_save(self, state, path):
        self.seen[path.name] = list(state.spike_losses)


def test_a_background_checkpoints_on_save_sees_the_state_it_wrote(tmp_path):
    """--async_save: a checkpoint's on_save runs when its write lands, at the next save; the state it got was a
    shallow copy, so its lists (the spike guard's window) had moved on with the run by then. It sees what the
    checkpoint holds."""
    hook = SeenOnSave()
    reset_accelerate()
    toy_train.main(["--output_dir", str(tmp_path), *QUIET, *GUARD, "--on_spike", "skip", "--async_save",
                    "--save_strategy", "steps", "--save_steps", "4", "--max_steps", "16"], hooks=[hook])
    assert len(hook.seen) >= 3
    for name, window in hook.seen.items():
        saved = json.loads((tmp_path / "checkpoints" / name / "train_state.json").read_text())
        assert window == saved["spike_losses"], name


def test_rollback_agrees_across_ranks_with_accumulation(tmp_path, ranks):
    """2 processes x 2 micro-batches of 2 (the session's gloo ranks): a step's window is two positions per rank,
    taken out together."""
    rolled, never = rollback_then_reference(tmp_path, ranks, processes=2, per_device=2, accumulation=2)
    assert_rolled_back_to_the_run_without_the_batch(rolled, never, positions=[10, 11])


def test_rollback_without_a_checkpoint_to_return_to_stops_and_says_so(tmp_path, capsys):
    reset_accelerate()
    with pytest.raises(SystemExit) as exit_info:
        run_cli(toy_train.main, ["--output_dir", str(tmp_path / "r"), *QUIET, *GUARD, "--on_spike", "rollback",
                                 "--spike_index", str(SPIKE), "--shuffle", "false", "--save_strategy", "steps",
                                 "--save_steps", "50"])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert "no checkpoint to return to yet" in message and "Traceback" not in message, message


def test_bad_guard_settings_are_refused(tmp_path, capsys):
    for flags, fragment in ((["--spike_threshold", "1"], "--spike_threshold=1.0"),
                            (["--spike_window", "-2"], "--spike_window=-2"),
                            ([*GUARD, "--on_spike", "rollback", "--save_strategy", "no"], "saves none"),
                            (["--on_spike", "undo"], "--on_spike"),
                            (["--on_spike", "skip"], "--on_spike skip: the loss-spike guard is off"),
                            (["--max_spike_skips", "3"], "--max_spike_skips 3: the loss-spike guard is off")):
        reset_accelerate()
        with pytest.raises(SystemExit) as exit_info:
            run_cli(toy_train.main, ["--output_dir", str(tmp_path / "r"), *QUIET, *flags])
        assert exit_info.value.code == 2
        message = capsys.readouterr().err
        assert fragment in message and "Traceback" not in message, message


def test_a_stop_asked_as_a_background_checkpoint_lands_in_a_rollback_ends_the_run_there(tmp_path):
    """--async_save: step 4's checkpoint lands (and its on_save runs) only at the next settle, here the spike at step
    6's rollback, which dropped the stop a hook asked for then with the dropped step's requests: the run trained on to
    its end. A synchronous run stops at step 4; the background one now rolls back to step 4 and stops there too."""
    flags = [*QUIET, "--on_spike", "rollback", *ROLLBACK, "--per_device_train_batch_size", "8", "--spike_index",
             str(SPIKE), "--spike_scale", "1e4"]
    for name, extra in (("sync", []), ("async", ["--async_save"])):
        reset_accelerate()
        run_cli(lambda argv: toy_train.main(argv, hooks=[StopOnSave(4)]),
                ["--output_dir", str(tmp_path / name), *flags, *extra])
    a, b = load_file(tmp_path / "sync" / "model.safetensors"), load_file(tmp_path / "async" / "model.safetensors")
    assert all((a[k] == b[k]).all() for k in a)
    rolled = [r for r in read_jsonl(tmp_path / "async" / "metrics.jsonl") if "spike_rollback_step" in r]
    assert [(r["spike_rollback_step"], r["rolled_back_to"]) for r in rolled] == [(6, "step-00000004")]

