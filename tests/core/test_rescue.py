"""An error in a metric no longer costs the run's steps: the training state of the step is saved first (before the
evaluation: its random states put back), the MetricsError says where, and the run resumed from it (the metric fixed)
runs that evaluation first and ends bitwise where the run that never failed ends: the same weights, the same logged
evaluations. 1 process in-process (with and without accumulation, a dropout model so that the random states matter),
and 2 processes on the session's ranks (a metric that fails on one rank only: every rank raises and saves once)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import yaml
from conftest import Clock, StopOnSave, read_jsonl, reset_accelerate
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from accel_train import ConfigError, MetricsError, Preempted, RunFinished, TrainConfig, train
from accel_train.rundir.layout import checkpoint_name

pytestmark = pytest.mark.usefixtures("one_thread")


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(48, 4, generator=g), torch.randint(0, 3, (48,), generator=g))


def cross_entropy(model, batch):
    x, y = batch
    logits = model(x)
    return {"loss": torch.nn.functional.cross_entropy(logits, y), "logits": logits}


class Accuracy:
    """Accuracy over the evaluation set; raises at its `fail_at`-th evaluation (counting whole-set calls only: the
    pre-flight's one-batch call is not one), on the ranks in `ranks` (all when None)."""

    def __init__(self, fail_at: int | None = None, ranks: tuple[int, ...] | None = None):
        self.fail_at, self.ranks, self.calls = fail_at, ranks, 0

    def __call__(self, outputs):
        if len(outputs["labels"]) == len(data()):
            self.calls += 1
            rank = int(os.environ.get("RANK", "0"))
            if self.calls == self.fail_at and (self.ranks is None or rank in self.ranks):
                raise ZeroDivisionError("a metric that divides by the count of a class")
        return {"accuracy": (outputs["logits"].argmax(-1) == outputs["labels"]).float().mean()}


def run(out, metrics_fn, accumulation: int = 1, resume: bool = False, loss_fn=cross_entropy, hooks=(), **changes):
    """8 optimizer steps on (x, y) tuples, evaluated every 2 steps, checkpointed every 3 (TrainConfig `changes`)."""
    reset_accelerate()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3))
    config = TrainConfig(output_dir=str(out), max_steps=8, report_to=["none"], disable_tqdm=True, run_report=False,
                         per_device_train_batch_size=4 // accumulation, gradient_accumulation_steps=accumulation,
                         mixed_precision="no", eval_strategy="steps", eval_steps=2, logging_steps=1,
                         save_strategy="steps", save_steps=3, seed=0,
                         resume_from_checkpoint="latest" if resume else None).replace(**changes)
    loader = DataLoader(data(), batch_size=4 // accumulation, shuffle=True, generator=torch.Generator().manual_seed(1))
    return train(model, loader, config=config, loss_fn=loss_fn, eval_loader=DataLoader(data(), batch_size=8),
                 metrics_fn=metrics_fn, hooks=list(hooks))


def evaluations(out) -> list[tuple]:
    return [(r["step"], r["eval_loss"], r["eval_accuracy"]) for r in read_jsonl(out / "metrics.jsonl")
            if "eval_accuracy" in r and not r.get("final")]


def fail_then_resume(out, accumulation: int = 1, ranks: tuple[int, ...] | None = None) -> str:
    """The run whose 2nd evaluation (step 4) fails, then the same run resumed with the metric fixed; the error."""
    with pytest.raises(MetricsError) as failed:
        run(out, Accuracy(fail_at=2, ranks=ranks), accumulation)
    saved = json.loads((out / "checkpoints" / checkpoint_name(4) / "train_state.json").read_text())
    assert saved["step"] == 4 and saved["evaluation_pending"] is True
    run(out, Accuracy(), accumulation, resume=True)
    return str(failed.value)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_metric_that_fails_once_costs_nothing_after_a_resume(tmp_path, accumulation):
    run(tmp_path / "whole", Accuracy(), accumulation)
    message = fail_then_resume(tmp_path / "cut", accumulation)
    assert "the metrics function Accuracy failed in the eval evaluation (ZeroDivisionError: a metric that divides" \
        in message
    assert (f"The training state of step 4 was saved first, before this evaluation, in "
            f"{tmp_path / 'cut' / 'checkpoints' / checkpoint_name(4)}: fix the metrics function and resume with "
            "--resume_from_checkpoint latest") in message
    whole, cut = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)  # bitwise: dropout's random states came back
    assert evaluations(tmp_path / "cut") == evaluations(tmp_path / "whole")  # step 4's evaluation ran on resume
    assert [s for s, *_ in evaluations(tmp_path / "whole")] == [2, 4, 6, 8]
    done = [json.loads((tmp_path / d / "all_results.json").read_text()) for d in ("whole", "cut")]
    assert done[0]["eval_loss"] == done[1]["eval_loss"] and done[0]["train_loss"] == done[1]["train_loss"]


class EvaluateAt:
    """Asks for an evaluation at step `step`, from on_log."""

    def __init__(self, step: int):
        self.step = step

    def attach(self, run):
        self.run = run

    def on_log(self, state, logs):
        if state.step == self.step:
            self.run.request_evaluate()


class CrashAt:
    """A crash at step `step` (from on_log), before anything of it is saved: a cut that leaves no checkpoint, as a
    SIGKILL does."""

    def __init__(self, step: int):
        self.step = step

    def on_log(self, state, logs):
        if state.step == self.step:
            raise RuntimeError(f"cut at step {self.step}")


@pytest.mark.parametrize("asked, at, async_save", [(False, 4, False), (True, 4, False), (True, 3, False),
                                                   (True, 3, True)],
                         ids=["due", "asked_by_a_hook", "asked_after_the_steps_checkpoint", "asked_after_async_save"])
def test_a_sigterm_at_an_evaluation_step_saves_first_and_the_resumed_run_evaluates_it(tmp_path, monkeypatch, asked,
                                                                                     at, async_save):
    """A SIGTERM agreed at a step that is to be evaluated (due, or asked by a hook): the checkpoint is written at
    once, the evaluation marked pending (an evaluation first can outlast the grace period a scheduler gives, SLURM's
    KillWait, and the steps since the last checkpoint were lost), and the resumed run evaluates that step first:
    bitwise the uninterrupted run's weights and evaluations. At step 3 the step's checkpoint (every 3 steps; with
    --async_save, in the background) was written before the hook's request was agreed: it lacked the pending
    evaluation, which the resumed run never ran; its train state is amended. The resumed run, cut before its next
    checkpoint (a crash at step 5) and resumed again from the same one, evaluates that step again: metrics.jsonl
    holds the evaluation once (twice before)."""
    changes = {"eval_strategy": "no", "async_save": async_save} if asked else {}

    def hooks():
        return [EvaluateAt(at)] if asked else []

    run(tmp_path / "whole", Accuracy(), hooks=hooks(), **changes)
    # received after step at - 1, agreed at step at's verdict
    monkeypatch.setenv("ACCEL_TRAIN_FAULT", f"sigterm_after_step:{at - 1}")
    metric = Accuracy()
    with pytest.raises(Preempted, match=f"stopped at step {at}"):
        run(tmp_path / "cut", metric, hooks=hooks(), **changes)
    monkeypatch.delenv("ACCEL_TRAIN_FAULT")
    assert metric.calls == (0 if asked else 1)  # step 2's only: step 4's was not run before its checkpoint
    saved = json.loads((tmp_path / "cut" / "checkpoints" / checkpoint_name(at) / "train_state.json").read_text())
    assert saved["step"] == at and saved["evaluation_pending"] is True
    with pytest.raises(RuntimeError, match="cut at step 5"):
        run(tmp_path / "cut", Accuracy(), resume=True, hooks=[*hooks(), CrashAt(5)], **changes)
    assert [s for s, *_ in evaluations(tmp_path / "cut")].count(at) == 1  # the resumed run ran it
    run(tmp_path / "cut", Accuracy(), resume=True, hooks=hooks(), **changes)
    whole, cut = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    assert evaluations(tmp_path / "cut") == evaluations(tmp_path / "whole")
    assert at in [s for s, *_ in evaluations(tmp_path / "whole")]


class EvaluateOnSave:
    """Asks for an evaluation when the checkpoint of step `step` lands (its on_save)."""

    def __init__(self, step: int):
        self.step = step

    def attach(self, run):
        self.run = run

    def on_save(self, state, checkpoint_dir):
        if state.step == self.step:
            self.run.request_evaluate()


@pytest.mark.parametrize("at, async_save", [(3, True), (4, False)], ids=["landed", "the_preemptions_own"])
def test_what_on_save_asks_at_a_sigterm_is_carried_out_where_the_uninterrupted_run_asks_it(tmp_path, monkeypatch, at,
                                                                                           async_save):
    """Hooks whose on_save asks for an evaluation (request_evaluate) and a stop (returns True) when the checkpoint of
    step `at` lands; checkpoints every 3 steps, a SIGTERM agreed at step `at`, and the reference, the uninterrupted
    run, saves synchronously (its on_save comes as the checkpoint is written). `landed`: step 3's checkpoint, written
    in the background (--async_save), lands in the preemption's save, and what its on_save asked was dropped (the loop
    was over): the resumed run trained on to step 8 where the reference evaluates step 3 and stops there. It is
    carried out at that step now: the stop saved, the evaluation pending; the resumed run evaluates step 3 and
    finishes, bitwise the reference. `the_preemptions_own`: step 4's checkpoint is the preemption's own, one the
    uninterrupted run does not write: what its on_save asks is dropped, and the resumed run is the uninterrupted run
    (no evaluation, 8 steps)."""
    changes = {"eval_strategy": "no"}

    def hooks():
        return [EvaluateOnSave(at), StopOnSave(at)]

    run(tmp_path / "whole", Accuracy(), hooks=hooks(), **changes)
    monkeypatch.setenv("ACCEL_TRAIN_FAULT", f"sigterm_after_step:{at - 1}")
    with pytest.raises(Preempted, match=f"stopped at step {at}"):
        run(tmp_path / "cut", Accuracy(), hooks=hooks(), async_save=async_save, **changes)
    monkeypatch.delenv("ACCEL_TRAIN_FAULT")
    saved = json.loads((tmp_path / "cut" / "checkpoints" / checkpoint_name(at) / "train_state.json").read_text())
    assert saved["stopped"] is saved["evaluation_pending"] is async_save
    run(tmp_path / "cut", Accuracy(), resume=True, hooks=hooks(), async_save=async_save, **changes)
    whole, cut = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    steps = [step for step, *_ in evaluations(tmp_path / "whole")]
    assert evaluations(tmp_path / "cut") == evaluations(tmp_path / "whole") and steps == ([3] if async_save else [])
    done = [json.loads((tmp_path / d / "all_results.json").read_text()) for d in ("whole", "cut")]
    assert done[0]["train_steps"] == done[1]["train_steps"] == (3 if async_save else 8)


def test_a_sigterm_after_the_last_steps_verdict_saves_and_the_resumed_run_finishes(tmp_path, monkeypatch):
    """A SIGTERM received while the last step is logged, evaluated and saved (after its verdict, the last the loop
    agrees) was dropped: the run went on into the final evaluation and the finish, which a scheduler's SIGKILL cuts
    short. It stops there with the last step saved; the resumed run has no step left and finishes as the
    uninterrupted run does."""
    run(tmp_path / "whole", Accuracy())
    monkeypatch.setenv("ACCEL_TRAIN_FAULT", "sigterm_after_step:8")
    with pytest.raises(Preempted, match="stopped at step 8"):
        run(tmp_path / "cut", Accuracy())
    monkeypatch.delenv("ACCEL_TRAIN_FAULT")
    assert not (tmp_path / "cut" / "all_results.json").exists()
    run(tmp_path / "cut", Accuracy(), resume=True)
    whole, cut = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    done = [json.loads((tmp_path / d / "all_results.json").read_text()) for d in ("whole", "cut")]
    assert done[0]["eval_loss"] == done[1]["eval_loss"] and done[0]["train_loss"] == done[1]["train_loss"]
    assert evaluations(tmp_path / "cut") == evaluations(tmp_path / "whole")
    # step 8's evaluation ran before its checkpoint (which records it): the resumed finish reuses it, not logs it again
    finals = [[r for r in read_jsonl(tmp_path / d / "metrics.jsonl") if r.get("final")] for d in ("whole", "cut")]
    assert finals == [[], []]


def results(out) -> dict:
    """all_results.json without the timings (runtime, samples and steps per second, peak memory, FLOP/s)."""
    timing = ("runtime", "per_second", "seconds", "memory", "rss", "flops", "mfu")
    return {k: v for k, v in json.loads((out / "all_results.json").read_text()).items()
            if not any(t in k for t in timing)}


@pytest.mark.parametrize("changes", [{"save_strategy": "no"}, {"save_strategy": "steps"},
                                     {"load_best_model_at_end": True, "metric_for_best_model": "loss"},
                                     {"early_stopping_patience": 1, "early_stopping_threshold": 100.0,
                                      "metric_for_best_model": "loss"}],
                         ids=["save_no", "save_steps", "best_model_restored", "stopped_early"])
def test_a_sigterm_during_the_final_evaluation_saves_the_last_step_and_the_resumed_run_finishes(
        tmp_path, monkeypatch, changes):
    """A SIGTERM during the finish's final evaluation (step 8 is not evaluated in training: the finish evaluates)
    killed the process with SIGTERM's default action: the loop's handler was gone, and under --save_strategy no
    nothing kept the trained weights. It is agreed after the final evaluation, before the final model is written:
    the last step is saved (under --save_strategy no too), Preempted; the resumed run finishes as the uninterrupted
    one: with the best checkpoint restored for the final evaluation (the step's checkpoint, written before it, is
    kept), and after early stopping at step 6 (the stop saved: the resumed run trains no step)."""
    changes = {"eval_steps": 3} | changes
    last = 6 if "early_stopping_patience" in changes else 8
    run(tmp_path / "whole", Accuracy(), **changes)
    monkeypatch.setenv("ACCEL_TRAIN_FAULT", "sigterm_in_finish:evaluation")
    with pytest.raises(Preempted, match=f"stopped at step {last}"):
        run(tmp_path / "cut", Accuracy(), **changes)
    monkeypatch.delenv("ACCEL_TRAIN_FAULT")
    assert (tmp_path / "cut" / "checkpoints" / checkpoint_name(last)).is_dir()
    assert not any((tmp_path / "cut" / name).exists() for name in ("all_results.json", "model.safetensors"))
    run(tmp_path / "cut", Accuracy(), resume=True, **changes)
    whole, cut = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    assert results(tmp_path / "cut") == results(tmp_path / "whole") and "eval_accuracy" in results(tmp_path / "cut")
    assert evaluations(tmp_path / "cut") == evaluations(tmp_path / "whole")
    finals = [[{k: v for k, v in r.items() if k != "time"} for r in read_jsonl(tmp_path / d / "metrics.jsonl")
               if r.get("final")] for d in ("whole", "cut")]
    # the final evaluation logged once, by the resumed run (after early stopping at 6 it reuses step 6's)
    assert finals[0] == finals[1] and len(finals[0]) == (last == 8)


def test_a_sigterm_once_the_final_model_is_written_lets_the_finish_end(tmp_path, monkeypatch):
    """After the final model is written a SIGTERM is held and the finish goes on (the seam, all_results.json): the
    model is on disk, and no checkpoint could stand for weights that may be the average or the best. Neither the
    default action (the test process would die) nor the process's previous handler (it raises) runs; that handler is
    back once the finish ends."""
    import signal

    def before(signum, frame):
        raise AssertionError("the previous handler ran")

    previous = signal.signal(signal.SIGTERM, before)
    try:
        monkeypatch.setenv("ACCEL_TRAIN_FAULT", "sigterm_in_finish:seam")
        run(tmp_path / "cut", Accuracy(), save_strategy="no")
        assert signal.getsignal(signal.SIGTERM) is before
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert (tmp_path / "cut" / "all_results.json").exists() and (tmp_path / "cut" / "model.safetensors").exists()
    assert not (tmp_path / "cut" / "checkpoints").exists() or not list((tmp_path / "cut" / "checkpoints").iterdir())


@pytest.mark.parametrize("asked", [False, True], ids=["due", "asked_after_the_steps_checkpoint"])
def test_a_sigterm_at_the_step_early_stopping_ends_saves_it_and_the_resumed_run_finishes(tmp_path, monkeypatch, asked):
    """Early stopping ends the run at step 6 (no evaluation improves by 100: patience 2 of the evaluations every 2
    steps; or patience 1, at the evaluation a hook asks for at step 6, after the step's checkpoint), as a SIGTERM
    arrives after that step's verdict: the run went into its finish (final evaluation, model, export) regardless,
    which SLURM's KillWait cuts, and a run resumed from step 6 trained on past the stop. It is preempted there with
    the stop saved in the step's checkpoint (written before the evaluation's hooks stopped the run: amended); the
    resumed run trains no step and finishes: bitwise the uninterrupted run, its finish then clears the stop (a later
    `latest` continues it, as any stopped run; `auto` leaves it finished, as the uninterrupted run). Where the
    evaluation came after the checkpoint, the amendment once held the stop alone: the resumed run's early stopping
    (its saved state) had not stopped, so run_files.json recorded no `ended_by` and `auto` trained on to step 8, and
    --load_best_model_at_end restored step 4, the best the checkpoint knew (step 6 in the uninterrupted run). The
    checkpoint now gets the state the step ended with."""
    changes = {"metric_for_best_model": "loss", "early_stopping_threshold": 100.0, "load_best_model_at_end": True,
               "early_stopping_patience": 1 if asked else 2} | ({"eval_steps": 4} if asked else {})

    def hooks():
        return [EvaluateAt(6)] if asked else []

    run(tmp_path / "whole", Accuracy(), hooks=hooks(), **changes)
    monkeypatch.setenv("ACCEL_TRAIN_FAULT", "sigterm_after_step:6")
    with pytest.raises(Preempted, match="stopped at step 6"):
        run(tmp_path / "cut", Accuracy(), hooks=hooks(), **changes)
    monkeypatch.delenv("ACCEL_TRAIN_FAULT")
    saved = tmp_path / "cut" / "checkpoints" / checkpoint_name(6) / "train_state.json"
    assert json.loads(saved.read_text())["stopped"] is True and not (tmp_path / "cut" / "all_results.json").exists()
    run(tmp_path / "cut", Accuracy(), resume=True, hooks=hooks(), **changes)
    whole, cut = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    assert evaluations(tmp_path / "cut") == evaluations(tmp_path / "whole") and evaluations(tmp_path / "whole")[-1][
        0] == 6
    finals = [[r for r in read_jsonl(tmp_path / d / "metrics.jsonl") if r.get("final")] for d in ("whole", "cut")]
    assert finals[0] == finals[1]  # the best model restored (step 6), evaluated once
    done = [json.loads((tmp_path / d / "all_results.json").read_text()) for d in ("whole", "cut")]
    assert done[0]["train_steps"] == done[1]["train_steps"] == 6 and done[0]["eval_loss"] == done[1]["eval_loss"]
    assert json.loads(saved.read_text())["stopped"] is False
    for d in ("whole", "cut"):
        assert json.loads((tmp_path / d / "run_files.json").read_text())["finished"]["ended_by"] == "EarlyStopping"
        with pytest.raises(RunFinished, match="stopped early by EarlyStopping"):
            run(tmp_path / d, Accuracy(), hooks=hooks(), resume_from_checkpoint="auto", **changes)


class CutInTheFinish:
    def on_train_end(self, state, metrics):  # after the final records: the report, an export (SLURM's KillWait)
        raise RuntimeError("cut in the finish")


def test_a_finish_cut_after_its_records_and_resumed_logs_them_once(tmp_path):
    """The finish at the last step logs the interval the last checkpoint fell inside (logged every 3 steps, saved at
    step 8) and the final evaluation (step 8 is no evaluation step), then is cut: the run resumed from step 8 logs
    both again, and metrics.jsonl held each twice. The resumed run drops the earlier attempt's: the history is the
    uninterrupted run's."""
    changes = {"eval_steps": 3, "logging_steps": 3, "save_steps": 4}
    run(tmp_path / "whole", Accuracy(), **changes)
    with pytest.raises(RuntimeError, match="cut in the finish"):
        run(tmp_path / "cut", Accuracy(), hooks=[CutInTheFinish()], **changes)
    run(tmp_path / "cut", Accuracy(), resume=True, **changes)
    whole, cut = ([(r["step"], r.get("final", False), r.get("loss"), r.get("eval_loss"))
                   for r in read_jsonl(tmp_path / d / "metrics.jsonl") if "loss" in r or "eval_loss" in r]
                  for d in ("whole", "cut"))
    assert [record[:2] for record in whole] == [(3, False), (3, False), (6, False), (6, False), (8, False), (8, True)]
    assert cut == whole


class SlowSetUp:
    def __init__(self, clock):
        self.clock = clock

    def on_train_start(self, state):
        self.clock.now += 1000.0  # a hook's set-up (the observer's schedule plot, a user's)


def test_set_up_and_a_resumed_pending_evaluation_are_not_training_time(tmp_path, monkeypatch):
    """train_seconds (and the first interval's samples/s and MFU) counted the hooks' on_train_start (the meter's
    clock started before it) and, on a resume, the pending evaluation the run does first. 1000 s in each, on a clock
    that otherwise moves a second a reading: neither is in the logged training seconds."""
    clock = Clock(monkeypatch)
    run(tmp_path, Accuracy(), hooks=[SlowSetUp(clock)])
    assert read_jsonl(tmp_path / "metrics.jsonl")[0]["train_seconds"] < 1000

    class SlowAccuracy(Accuracy):
        def __call__(self, outputs):
            clock.now += 1000.0
            return super().__call__(outputs)

    monkeypatch.setenv("ACCEL_TRAIN_FAULT", "sigterm_after_step:3")  # step 4's evaluation is left pending
    with pytest.raises(Preempted):
        run(tmp_path / "cut", Accuracy())
    monkeypatch.delenv("ACCEL_TRAIN_FAULT")
    run(tmp_path / "cut", SlowAccuracy(), resume=True)
    seconds = {r["step"]: r["train_seconds"] for r in read_jsonl(tmp_path / "cut" / "metrics.jsonl")
               if "train_seconds" in r}
    assert seconds[5] - seconds[4] < 1000, seconds


def test_a_resumed_run_with_no_step_left_publishes_no_throughput_of_zero(tmp_path, monkeypatch):
    """Preempted at its last step inside a logging interval (every 3 steps: 7-8 unlogged), the resumed run trains
    nothing: its last record and all_results.json said samples/s 0.0 and MFU 0.0 (train_mfu 0.0), a throughput
    nobody measured. They are left out; train_seconds, the whole run's training clock, is the uninterrupted run's
    kind of number (within its seconds)."""
    monkeypatch.setenv("ACCEL_TRAIN_FAULT", "sigterm_after_step:8")
    with pytest.raises(Preempted):
        run(tmp_path, Accuracy(), logging_steps=3)
    monkeypatch.delenv("ACCEL_TRAIN_FAULT")
    run(tmp_path, Accuracy(), resume=True, logging_steps=3)
    last = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r][-1]
    assert last["step"] == 8 and "samples_per_second" not in last and "mfu" not in last
    done = json.loads((tmp_path / "all_results.json").read_text())
    assert "train_samples_per_second" not in done and done.get("train_mfu", 1) > 0 and done["train_seconds"] > 0


def resumed_on_two_ranks(out: str) -> None:
    """The run of 1 process (micro-batches of 4) resumed on 2 (of 2: the same global batch), logged every 3 steps."""
    run(Path(out), Accuracy(), accumulation=2, resume=True, logging_steps=3, gradient_accumulation_steps=1)


def test_a_run_resumed_on_more_processes_at_its_last_step_logs_its_last_interval_once(tmp_path, ranks, monkeypatch):
    """Preempted at its last step inside a logging interval (7-8 unlogged) on 1 process, resumed on 2: the interval
    the checkpoint kept is the main process's alone (StepMeter.resume_interval), and the finish logs it. Each rank
    decided by its own micro-batches whether it had an interval to log (before 119d2bf): the main process entered
    the reduce alone, the other went on into the finish's checkpoint, and the run hung. The decision every rank
    shares (the last logged step) logs the interval once, with the uninterrupted run's loss."""
    run(tmp_path / "whole", Accuracy(), logging_steps=3)
    monkeypatch.setenv("ACCEL_TRAIN_FAULT", "sigterm_after_step:8")
    with pytest.raises(Preempted, match="stopped at step 8"):
        run(tmp_path / "cut", Accuracy(), logging_steps=3)
    monkeypatch.delenv("ACCEL_TRAIN_FAULT")
    ranks.run(resumed_on_two_ranks, str(tmp_path / "cut"), timeout=180)
    whole, cut = ([r for r in read_jsonl(tmp_path / d / "metrics.jsonl") if "loss" in r] for d in ("whole", "cut"))
    assert [r["step"] for r in cut] == [r["step"] for r in whole] == [3, 6, 8]
    assert cut[-1]["loss"] == pytest.approx(whole[-1]["loss"], rel=1e-6)
    done = [json.loads((tmp_path / d / "all_results.json").read_text()) for d in ("whole", "cut")]
    assert done[1]["train_loss"] == pytest.approx(done[0]["train_loss"], rel=1e-6)


def test_no_logging_still_measures_train_loss(tmp_path):
    """--logging_strategy no published train_loss null (the loss was summed only where a record was written): the
    run's one interval is measured, not written."""
    run(tmp_path / "every", Accuracy(), eval_strategy="no")
    run(tmp_path / "none", Accuracy(), eval_strategy="no", logging_strategy="no")
    done = [json.loads((tmp_path / d / "all_results.json").read_text()) for d in ("every", "none")]
    assert done[1]["train_loss"] == pytest.approx(done[0]["train_loss"], rel=1e-6)
    assert not [r for r in read_jsonl(tmp_path / "none" / "metrics.jsonl") if "loss" in r]


def poisoned(steps: set[int]):
    """cross_entropy, NaN at the training steps in `steps`, counted from the run's start (a resumed run's first: 1)."""
    calls = []

    def loss(model, batch):
        calls.append(model.training)  # the pre-flight's call is in eval mode
        out = cross_entropy(model, batch)
        return {**out, "loss": out["loss"] * (math.nan if model.training and sum(calls) in steps else 1.0)}

    return loss


@pytest.mark.parametrize("skipped", [False, True], ids=["trained", "every_step_skipped"])
def test_the_training_clock_carries_the_seconds_a_checkpoint_fell_inside_of_a_logging_interval(tmp_path, monkeypatch,
                                                                                               skipped):
    """Logged every 4 steps, preempted at step 6: train_seconds (time to a quality) lost the seconds of steps 5-6,
    spent before the checkpoint but after the last log (every preemption at another step than a log's, every
    epoch-end checkpoint inside an interval). They are carried in the checkpoint's interval: on a clock that moves a
    second a reading, the resumed run ends with at least the uninterrupted run's seconds (and a few readings more:
    its start). Also where steps 5 and 6 were both skipped (--on_nonfinite skip, a NaN loss): the interval had no
    micro-batch left and the checkpoint kept none of it (5 s short before)."""
    Clock(monkeypatch)
    changes = {"logging_steps": 4, "eval_strategy": "no"} | ({"on_nonfinite": "skip"} if skipped else {})

    def loss():  # a resumed run counts its steps from 1: its steps 7 and 8 are not poisoned
        return poisoned({5, 6} if skipped else set())

    run(tmp_path / "whole", Accuracy(), loss_fn=loss(), **changes)
    monkeypatch.setenv("ACCEL_TRAIN_FAULT", "sigterm_after_step:5")
    with pytest.raises(Preempted, match="stopped at step 6"):
        run(tmp_path / "cut", Accuracy(), loss_fn=loss(), **changes)
    monkeypatch.delenv("ACCEL_TRAIN_FAULT")
    run(tmp_path / "cut", Accuracy(), resume=True, loss_fn=loss(), **changes)
    whole, cut = ([r for r in read_jsonl(tmp_path / d / "metrics.jsonl") if "train_seconds" in r][-1]
                  for d in ("whole", "cut"))
    assert whole["train_seconds"] <= cut["train_seconds"] <= whole["train_seconds"] + 5, (whole, cut)
    assert cut.get("nonfinite_skips") == whole.get("nonfinite_skips") == (2 if skipped else None)


def test_a_resume_with_changed_settings_keeps_the_config_that_trained_the_steps_before(tmp_path):
    """`latest` resumes with changed flags; config.yaml was rewritten with the new ones, and once the checkpoint that
    recorded the old ones rotated, nothing in the run directory said how steps 1-3 ran. The replaced config.yaml is
    kept beside it, a run's own file (replaced with the run), and the change is said."""
    from accel_train.rundir import run_files

    run(tmp_path, Accuracy(), hooks=[StopOnSave(3)], learning_rate=0.05)
    assert not list(tmp_path.glob("config.until-step-*"))
    run(tmp_path, Accuracy(), resume=True, learning_rate=0.1)
    earlier = yaml.safe_load((tmp_path / "config.until-step-00000003.yaml").read_text())
    assert earlier["learning_rate"] == 0.05 and yaml.safe_load((tmp_path / "config.yaml").read_text())[
        "learning_rate"] == 0.1
    assert "config.until-step-00000003.yaml" in run_files.survey(tmp_path).written
    run(tmp_path, Accuracy(), resume=True, learning_rate=0.1)  # the same settings again: nothing more kept
    assert [p.name for p in tmp_path.glob("config.until-step-*")] == ["config.until-step-00000003.yaml"]


class DiesAt:
    """Raises as step `step` is logged: an attempt killed before its next checkpoint."""

    def __init__(self, step: int):
        self.step = step

    def on_log(self, state, record):
        if state.step == self.step:
            raise RuntimeError("killed")


def test_a_second_resume_from_one_checkpoint_keeps_the_config_that_trained_the_steps_before_it(tmp_path):
    """Resumed from step 3 with changed settings, the attempt died before its next checkpoint and was resumed from
    step 3 again with other ones: the second resume wrote over config.until-step-3 with the first resumed attempt's
    config, which trained none of the steps kept, and the config that trained steps 1-3 was lost. The first one
    written stays. A resume from an earlier checkpoint than a resume before it (step 3, after one at step 6): the
    file of step 6 describes the abandoned timeline and goes with its checkpoints."""
    def rate(name):
        return yaml.safe_load((tmp_path / name).read_text())["learning_rate"]

    run(tmp_path, Accuracy(), hooks=[StopOnSave(3)], learning_rate=0.05, eval_strategy="no")
    with pytest.raises(RuntimeError, match="killed"):
        run(tmp_path, Accuracy(), resume=True, hooks=[DiesAt(4)], learning_rate=0.1, eval_strategy="no")
    run(tmp_path, Accuracy(), resume=True, hooks=[StopOnSave(6)], learning_rate=0.2, eval_strategy="no")
    assert rate("config.until-step-00000003.yaml") == 0.05 and rate("config.yaml") == 0.2
    with pytest.raises(RuntimeError, match="killed"):
        run(tmp_path, Accuracy(), resume=True, hooks=[DiesAt(7)], learning_rate=0.3, eval_strategy="no")
    assert rate("config.until-step-00000006.yaml") == 0.2
    with pytest.raises(RuntimeError, match="killed"):
        run(tmp_path, Accuracy(), hooks=[DiesAt(4)], learning_rate=0.4, eval_strategy="no",
            resume_from_checkpoint=str(tmp_path / "checkpoints" / checkpoint_name(3)))
    assert rate("config.until-step-00000003.yaml") == 0.05 and rate("config.yaml") == 0.4
    assert [p.name for p in tmp_path.glob("config.until-step-*")] == ["config.until-step-00000003.yaml"]
    assert rate("checkpoints/superseded/config.until-step-00000006.yaml") == 0.2


class EvaluateAfterFirstSave:
    """Asks for an evaluation at the step boundary of the first checkpoint, after it was written."""

    def attach(self, run):
        self.run, self.asked = run, False

    def on_save(self, state, path):
        if not self.asked:
            self.asked = True
            self.run.request_evaluate()


def test_a_step_that_became_best_after_its_checkpoint_stays_best_through_a_rollback_to_it(tmp_path):
    """A save at step 3, then an evaluation asked for at that boundary: step 3 is the best, in memory (its checkpoint
    was written before the evaluation). A spike at step 4 rolls back to step 3: the best is still step 3 (the
    checkpoint on disk knew none), so step 6's checkpoint, and --load_best_model_at_end, name it."""
    calls = []

    def spiking(model, batch):
        calls.append(model.training)  # the pre-flight's call is in eval mode
        out = cross_entropy(model, batch)
        return {**out, "loss": out["loss"] * (1e4 if model.training and sum(calls) == 4 else 1)}  # step 4's batch

    run(tmp_path, Accuracy(), loss_fn=spiking, hooks=[EvaluateAfterFirstSave()], eval_strategy="no",
        metric_for_best_model="loss", on_spike="rollback", spike_window=2)
    first = json.loads((tmp_path / "checkpoints" / checkpoint_name(3) / "train_state.json").read_text())
    later = json.loads((tmp_path / "checkpoints" / checkpoint_name(6) / "train_state.json").read_text())
    assert first["best_checkpoint"] is None and later["best_checkpoint"] == checkpoint_name(3)
    assert later["spike_rollbacks"] == 1  # step 4 was rolled back to step 3


@pytest.mark.parametrize("schedule", ["linear", "reduce_lr_on_plateau"])
def test_a_watched_metric_the_evaluation_never_returns_stops_the_run_with_its_step_saved(tmp_path, schedule):
    """--metric_for_best_model f1 with a metrics function that returns only accuracy (and names nothing, so the start
    cannot tell): the first evaluation raises a MetricsError naming the metric and what was returned, after the
    step's training state was saved (a plateau schedule stepping on the metric no longer fails first with a bare
    KeyError that saved nothing)."""
    with pytest.raises(MetricsError, match=r"--metric_for_best_model eval_f1: the evaluation returned only "
                                           r"\['eval_accuracy', 'eval_loss'.*saved first"):
        run(tmp_path, Accuracy(), metric_for_best_model="f1", lr_scheduler_type=schedule)
    saved = json.loads((tmp_path / "checkpoints" / checkpoint_name(2) / "train_state.json").read_text())
    assert saved["step"] == 2 and saved["evaluation_pending"] is True
    assert not [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "eval_loss" in r]  # the resume logs it, once
    findings = json.loads((tmp_path / "report" / "preflight.json").read_text())["findings"]
    assert any(f["level"] == "warning" and "--metric_for_best_model eval_f1 (best model, early stopping" in f["message"]
               and "eval_accuracy" in f["message"] for f in findings)  # said before training, from one batch


def failing_on_two_ranks(out: str, ranks: tuple[int, ...] | None) -> None:
    with pytest.raises(MetricsError):
        run(Path(out), Accuracy(fail_at=2, ranks=ranks))


def whole_on_two_ranks(out: str, resume: bool = False) -> None:
    run(Path(out), Accuracy(), resume=resume)


@pytest.mark.parametrize("failing", [None, (1,)], ids=["every_rank", "rank_1_only"])
def test_a_metric_error_on_two_processes_saves_once_on_every_rank_and_resumes(tmp_path, ranks, failing):
    ranks.run(whole_on_two_ranks, str(tmp_path / "whole"))
    ranks.run(failing_on_two_ranks, str(tmp_path / "cut"), failing)  # a rank left alone would hang: every one raises
    saved = sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir())
    assert saved == [checkpoint_name(3), checkpoint_name(4)]  # one checkpoint of step 4, written by both ranks
    state = json.loads((tmp_path / "cut" / "checkpoints" / checkpoint_name(4) / "train_state.json").read_text())
    assert state["evaluation_pending"] is True and state["world_size"] == 2
    for rank in (0, 1):
        crash = json.loads((tmp_path / "cut" / f"crash_rank{rank}.json").read_text())
        assert crash["error"] == "MetricsError" and "saved first" in crash["message"]
        assert ("failed on process(es) [1]" if failing else "failed on process(es) [0, 1]") in crash["message"]
    ranks.run(whole_on_two_ranks, str(tmp_path / "cut"), True)
    whole, cut = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    assert evaluations(tmp_path / "cut") == evaluations(tmp_path / "whole")


def squeezed(model, batch):  # a loss written for batches of several samples: squeeze() drops a batch of one's axis
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x).squeeze(), y)


def kept_axis(model, batch):  # the fix
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y)


def short_batch_run(out, loss_fn, accumulation: int, resume: bool = False):
    """2 epochs of 17 samples in batches of 4 (the epoch's last batch holds 1), evaluated every 2 steps, checkpointed
    every 3."""
    reset_accelerate()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3))
    config = TrainConfig(output_dir=str(out), num_train_epochs=2, report_to=["none"], disable_tqdm=True,
                         run_report=False, per_device_train_batch_size=4, gradient_accumulation_steps=accumulation,
                         mixed_precision="no", eval_strategy="steps", eval_steps=2, logging_steps=1,
                         save_strategy="steps", save_steps=3, seed=0,
                         resume_from_checkpoint="latest" if resume else None)
    g = torch.Generator().manual_seed(0)
    samples = TensorDataset(torch.randn(17, 4, generator=g), torch.randint(0, 3, (17,), generator=g))
    loader = DataLoader(samples, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))
    return train(model, loader, config=config, loss_fn=loss_fn, eval_loader=DataLoader(samples, batch_size=8))


@pytest.mark.parametrize("accumulation, boundary", [(1, 4), (2, 2)])
def test_a_loss_that_fails_on_the_last_short_batch_saves_the_step_before_it(tmp_path, accumulation, boundary):
    short_batch_run(tmp_path / "whole", kept_axis, accumulation)
    with pytest.raises(RuntimeError) as failed:  # the user's own error, as it was, with a note
        short_batch_run(tmp_path / "cut", squeezed, accumulation)
    path = tmp_path / "cut" / "checkpoints" / checkpoint_name(boundary)
    assert (f"the training state of step {boundary}, the last optimizer step before this error, was saved first in "
            f"{path}") in "\n".join(failed.value.__notes__)
    saved = json.loads((path / "train_state.json").read_text())
    assert (saved["epoch"], saved["batch_in_epoch"], saved["samples_seen"]) == (0, 4, 16)  # before the short batch
    short_batch_run(tmp_path / "cut", kept_axis, accumulation, resume=True)
    whole, cut = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    done = [json.loads((tmp_path / d / "all_results.json").read_text()) for d in ("whole", "cut")]
    assert done[0]["eval_loss"] == done[1]["eval_loss"] and done[0]["train_loss"] == done[1]["train_loss"]


def test_a_loss_without_label_smoothing_passed_to_train_refuses_the_flag(tmp_path):
    """The recipes check a loss's declared refuse_label_smoothing where they build it; a loss passed to train() by a
    user's own script was not checked (the flag was ignored). The session checks every loss, before anything is
    written."""
    def focal(model, batch):
        return cross_entropy(model, batch)

    focal.refuse_label_smoothing = lambda factor: f"--label_smoothing_factor {factor}: this loss has no smoothing"
    with pytest.raises(ConfigError, match="--label_smoothing_factor 0.1: this loss has no smoothing"):
        run(tmp_path / "run", Accuracy(), loss_fn=focal, label_smoothing_factor=0.1)
    assert not list((tmp_path / "run").iterdir())  # nothing written in it


class AddsToTheMetrics:
    def on_evaluate(self, state, metrics):
        metrics["confusion"] = torch.zeros(3, 3)  # a hook's own use of the dict: not a number a JSON holds


def test_what_a_hook_adds_to_an_evaluations_metrics_stays_out_of_the_checkpoints(tmp_path):
    """The last evaluation is saved with the checkpoints (TrainState.last_eval): a copy of what the evaluation
    returned, not the dict the hooks then get, to which one may add what a JSON cannot hold (the checkpoint of that
    step failed to write)."""
    run(tmp_path, Accuracy(), hooks=[AddsToTheMetrics()], save_steps=2)
    saved = json.loads((tmp_path / "checkpoints" / checkpoint_name(8) / "train_state.json").read_text())
    assert saved["last_eval"][0] == 8 and set(saved["last_eval"][1]) == {"eval_loss", "eval_samples", "eval_accuracy"}


def test_a_checkpoint_written_after_its_steps_evaluation_carries_no_evaluation_seconds(tmp_path, monkeypatch):
    """Evaluated and checkpointed at step 6, logged every 4: the interval the checkpoint keeps (its training
    seconds, carried into the resumed run) was measured before the evaluation's pause was taken out, so every resume
    from such a checkpoint (the recipes' epoch-end default) counted one evaluation as training. On a clock where an
    evaluation takes 1000 s, the resumed run ends with the uninterrupted run's seconds (and a few readings more)."""
    clock = Clock(monkeypatch)

    class SlowAccuracy(Accuracy):
        def __call__(self, outputs):
            clock.now += 1000.0
            return super().__call__(outputs)

    run(tmp_path / "whole", SlowAccuracy(), logging_steps=4)
    run(tmp_path / "cut", SlowAccuracy(), hooks=[StopOnSave(6)], logging_steps=4)
    run(tmp_path / "cut", SlowAccuracy(), resume=True, logging_steps=4)
    whole, cut = ([r["train_seconds"] for r in read_jsonl(tmp_path / d / "metrics.jsonl") if "train_seconds" in r][-1]
                  for d in ("whole", "cut"))
    assert whole <= cut <= whole + 10, (whole, cut)


def sigterm_in_finish_on_rank_one(out: str, phase: str) -> None:
    """Under --save_strategy no, the final evaluation computed (eval_steps 3): the run `whole`; `cut` by a SIGTERM on
    rank 1 only as the final evaluation starts; or `resumed`."""
    if phase != "cut":
        run(Path(out), Accuracy(), resume=phase == "resumed", save_strategy="no", eval_steps=3)
        return
    if os.environ.get("RANK") == "1":
        os.environ["ACCEL_TRAIN_FAULT"] = "sigterm_in_finish:evaluation"
    try:
        with pytest.raises(Preempted, match="stopped at step 8"):
            run(Path(out), Accuracy(), save_strategy="no", eval_steps=3)
    finally:
        os.environ.pop("ACCEL_TRAIN_FAULT", None)


def test_a_sigterm_in_the_finish_on_one_rank_preempts_every_rank(tmp_path, ranks):
    """A SIGTERM that reaches one rank in the finish is agreed (one all-reduce at each finish boundary): every rank
    saves step 8 and raises Preempted, none goes on alone into the final model's collectives; resumed on 2, the
    weights and results are the uninterrupted 2-process run's."""
    ranks.run(sigterm_in_finish_on_rank_one, str(tmp_path / "whole"), "whole")
    ranks.run(sigterm_in_finish_on_rank_one, str(tmp_path / "cut"), "cut", timeout=180)
    assert (tmp_path / "cut" / "checkpoints" / checkpoint_name(8)).is_dir()
    assert not (tmp_path / "cut" / "all_results.json").exists()
    ranks.run(sigterm_in_finish_on_rank_one, str(tmp_path / "cut"), "resumed", timeout=180)
    whole, cut = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.equal(whole[k], cut[k]) for k in whole)
    assert results(tmp_path / "cut") == results(tmp_path / "whole")
