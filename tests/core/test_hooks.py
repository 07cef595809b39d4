"""Hooks that steer (docs/hooks.md): `attach(run)` gives a hook the prepared objects and three requests (stop, save,
evaluate), carried out at the next optimizer-step boundary on every rank. Proven with what they meet: resume (a
requested checkpoint resumes bitwise, no request is replayed), gradient accumulation (a request made mid-window waits
for the window's step), 2 processes (a request on rank 1 alone is carried out on both), --on_spike rollback (back to a
requested checkpoint; each request carried out once), the weight average (a requested evaluation is a due one). The
three examples of docs/hooks.md run here as printed there.

What runs where: toy_train (tests/scripts) or a tiny regression in this process; the 2-process test on the session's
gloo `ranks`."""

from __future__ import annotations

import json
import os
import re

import pytest
import toy_train
from conftest import ROOT, StopOnSave, read_jsonl, reset_accelerate, toy_records
from safetensors.torch import load_file

from accel_train import ConfigError, FinishError, TrainConfig, train
from accel_train.rundir.checkpoint import list_checkpoints

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = ROOT / "docs" / "hooks.md"
# 96 points, 8 a micro-batch: 12 micro-batches an epoch; every step logged (on_log is where Requester asks)
BASE = ["--logging_steps", "1", "--max_steps", "8", "--eval_strategy", "no", "--save_strategy", "no",
        "--learning_rate", "0.05"]


def doc_example(name: str) -> dict:
    """The namespace of docs/hooks.md's code block that starts with `# example: <name>`, executed as printed."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    code = [block for block in blocks if block.startswith(f"# example: {name}\n")]
    assert len(code) == 1, f"docs/hooks.md has {len(code)} examples named {name!r}"
    namespace: dict = {}
    exec(compile(code[0], f"{DOCS}#{name}", "exec"), namespace)  # noqa: S102 - the documented code, run as printed
    return namespace


class Requester:
    """Asks for a save / an evaluation / a stop at the given steps (from on_log, which runs at every step here), or
    for a save from the model's forward at training micro-batch `save_at_forward` (1-based: as a loss function or a
    forward hook may, in the middle of an accumulation window). Records the steps it saw saved and evaluated."""

    def __init__(self, save=(), evaluate=(), stop=(), save_at_forward=None):
        self.save, self.evaluate, self.stop, self.save_at_forward = set(save), set(evaluate), set(stop), save_at_forward
        self.saved: list[int] = []
        self.evaluated: list[int] = []
        self.forwards = 0

    def attach(self, run):
        self.run = run
        if self.save_at_forward is not None:
            run.model.register_forward_pre_hook(self.count)

    def count(self, module, inputs):
        if module.training:
            self.forwards += 1
            if self.forwards == self.save_at_forward:
                self.run.request_save()

    def on_log(self, state, logs):
        for steps, ask in ((self.save, self.run.request_save), (self.evaluate, self.run.request_evaluate),
                           (self.stop, self.run.request_stop)):
            if state.step in steps:
                ask()

    def on_save(self, state, checkpoint_dir):
        self.saved.append(state.step)

    def on_evaluate(self, state, metrics):
        self.evaluated.append(state.step)


def toy(out, *flags, hooks=()):
    reset_accelerate()
    toy_train.main(["--output_dir", str(out), *BASE, *flags], hooks=hooks)


def toy_with_hook_on_rank(argv: list[str], hook, rank: int) -> None:
    """One rank of a 2-process toy run (conftest's Ranks calls it on each): `hook` is given on rank `rank` only."""
    reset_accelerate()
    toy_train.main(argv, hooks=[hook] if int(os.environ["RANK"]) == rank else [])


def same_weights(a, b) -> bool:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x)


def logged(out, key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in read_jsonl(out / "metrics.jsonl") if key in r and not r.get("final")]


def names(out) -> list[str]:
    return [path.name for path in list_checkpoints(out)]


# ------------------------------------------------------------------------------------------- requests × features
def test_a_requested_save_is_a_checkpoint_a_run_resumes_bitwise_and_no_request_is_replayed(tmp_path):
    """--save_strategy no and --eval_strategy no: every checkpoint and evaluation here is a request's."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    whole = Requester(save={3, 6}, evaluate={2})
    toy(full, hooks=[whole])
    assert names(full) == ["step-00000003", "step-00000006"] and whole.saved == [3, 6]
    assert whole.evaluated == [2] and [step for step, _ in logged(full, "eval_loss")] == [2]
    first, second = Requester(save={3, 6}, evaluate={2}), Requester(save={3, 6}, evaluate={2})
    toy(cut, "--stop_at_step", "4", hooks=[first])  # a stop saves nothing with --save_strategy no: back to step 3
    assert first.saved == [3] and names(cut) == ["step-00000003"]
    toy(cut, "--resume_from_checkpoint", "latest", hooks=[second])
    assert second.saved == [6] and second.evaluated == [], "the first run's requests are not carried out again"
    assert same_weights(full, cut)
    assert logged(cut, "loss") == logged(full, "loss") and logged(cut, "eval_loss") == logged(full, "eval_loss")


def test_under_accumulation_a_request_made_mid_window_waits_for_the_windows_step(tmp_path):
    """Accumulation 2: the 5th micro-batch opens step 3's window; the save it asks for comes after step 3, at the
    window boundary (6 micro-batches consumed), and a run resumed from it ends as the uninterrupted one, bitwise."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    hook = Requester(save_at_forward=5)
    toy(whole, "--gradient_accumulation_steps", "2", hooks=[hook])
    assert hook.saved == [3] and names(whole) == ["step-00000003"]
    saved = json.loads((whole / "checkpoints" / "step-00000003" / "train_state.json").read_text())
    assert (saved["step"], saved["batch_in_epoch"]) == (3, 6)
    toy(cut, "--gradient_accumulation_steps", "2", "--stop_at_step", "5", hooks=[Requester(save_at_forward=5)])
    toy(cut, "--gradient_accumulation_steps", "2", "--resume_from_checkpoint", "latest")
    assert same_weights(whole, cut) and logged(cut, "loss") == logged(whole, "loss")


def test_a_request_made_on_rank_1_alone_is_carried_out_on_both_ranks_at_the_same_step(tmp_path, ranks):
    """2 gloo ranks, accumulation 2; the hook exists on rank 1 only: rank 0 evaluates, saves and stops with it."""
    out = tmp_path / "two"
    argv = ["--output_dir", str(out), *BASE, "--per_device_train_batch_size", "4", "--gradient_accumulation_steps",
            "2"]
    ranks.run(toy_with_hook_on_rank, argv, Requester(save={3}, evaluate={2}, stop={5}), 1)
    assert names(out) == ["step-00000003"]
    files = {path.name for path in (out / "checkpoints" / "step-00000003").iterdir()}
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= files, files
    assert [step for step, _ in logged(out, "eval_loss")] == [2], "rank 0 wrote the evaluation rank 1 asked for"
    records = toy_records(out)
    assert [records[rank][-1]["step"] for rank in (0, 1)] == [5, 5]


class StopAtStart:
    def on_train_start(self, state):
        return True


def test_a_stop_asked_at_train_start_on_rank_1_alone_stops_both_ranks_before_the_first_step(tmp_path, ranks):
    """Before, rank 1 trained no step while rank 0 trained alone into its first collective: a hang."""
    out = tmp_path / "two"
    ranks.run(toy_with_hook_on_rank, ["--output_dir", str(out), *BASE, "--per_device_train_batch_size", "4"],
              StopAtStart(), 1, timeout=90)
    records = toy_records(out)
    assert [records[rank][-1]["step"] for rank in (0, 1)] == [0, 0]


def test_a_requested_evaluation_is_a_due_one_weight_average_included(tmp_path):
    due, asked, plain = tmp_path / "due", tmp_path / "asked", tmp_path / "plain"
    toy(due, "--ema_decay", "0.9", "--max_steps", "3", "--eval_strategy", "steps", "--eval_steps", "2")
    toy(asked, "--ema_decay", "0.9", "--max_steps", "3", hooks=[Requester(evaluate={2})])
    toy(plain, "--max_steps", "3", hooks=[Requester(evaluate={2})])

    def at_step_2(out):
        return [r for r in read_jsonl(out / "metrics.jsonl") if r["step"] == 2 and "eval_loss" in r]

    assert at_step_2(asked) == at_step_2(due) and len(at_step_2(due)) == 1
    assert at_step_2(asked)[0]["eval_ema_loss"] != at_step_2(asked)[0]["eval_loss"], "the average, beside the model"
    assert "eval_ema_loss" not in at_step_2(plain)[0]


def test_a_rollback_returns_to_a_requested_checkpoint_and_each_request_is_carried_out_once(tmp_path):
    """tests/core/test_spike_guard.py's rollback run (the spiked batch is step 6's, the 6th micro-batch, then once an
    epoch), with saves asked at steps 5 and 7: the rollback goes back to the requested step 5, step 7 is saved once,
    the save the spiked micro-batch's forward asked for goes with the dropped step, and the run equals, bitwise, the
    one whose data never held the batch, with the same saves."""
    flags = ["--spike_window", "5", "--spike_threshold", "10", "--shuffle", "false", "--dropout", "0.2",
             "--max_steps", "33", "--save_strategy", "steps", "--save_steps", "4", "--on_spike", "rollback",
             "--report_to", "none"]
    rolled, never = tmp_path / "rolled", tmp_path / "never"
    rolled_hook, never_hook = Requester(save={5, 7}, save_at_forward=6), Requester(save={5, 7})
    toy(rolled, *flags, "--spike_index", "40", "--spike_scale", "1e4", hooks=[rolled_hook])
    toy(never, *flags, "--without", "40-47", hooks=[never_hook])
    rows = [r for r in read_jsonl(rolled / "metrics.jsonl") if "spike_rollback_step" in r]
    assert [r["rolled_back_to"] for r in rows] == ["step-00000005", "step-00000016", "step-00000024"]
    assert rolled_hook.saved == never_hook.saved == [4, 5, 7, 8, 12, 16, 20, 24, 28, 32, 33]
    assert same_weights(rolled, never)


def test_request_evaluate_without_an_evaluation_loader_says_what_to_pass(tmp_path):
    class AskAtOnce:
        def attach(self, run):
            run.request_evaluate()

    with pytest.raises(ConfigError, match="no evaluation loader; pass eval_loader="):
        regression_run(tmp_path / "run", [], hooks=[AskAtOnce()], evaluate=False)


def test_a_request_after_the_last_step_is_refused_not_ignored(tmp_path):
    class AskAtTheEnd:
        def attach(self, run):
            self.run = run

        def on_finish(self, session, metrics):
            self.run.request_save()

    with pytest.raises(FinishError) as refused:
        toy(tmp_path / "run", "--max_steps", "2", hooks=[AskAtTheEnd()])
    assert "request_save() after the last step" in str(refused.value.__cause__)
    assert (tmp_path / "run" / "model.safetensors").exists(), "the trained model was written before the seam"


# ------------------------------------------------------------------------------------- docs/hooks.md's examples
def regression_run(out, lrs: list[float], *, hooks=(), native_plateau=None, evaluate=True, **overrides):
    """SGD with momentum on a tiny linear regression, an ExponentialLR stepped after every step (and, with
    `native_plateau`, a ReduceLROnPlateau of those arguments beside it, the loop's own way), evaluated every 2 steps;
    `lrs` gets the rate each training step ran with."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    reset_accelerate()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.5 * torch.randn(32, generator=g)

    def data():
        return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.97)
    if native_plateau is not None:
        schedule = [schedule, torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, **native_plateau)]

    def loss_fn(m, batch):
        if m.training:
            lrs.append(optimizer.param_groups[0]["lr"])
        inputs, targets = batch
        return torch.nn.functional.mse_loss(m(inputs).squeeze(-1), targets)

    settings = dict(output_dir=str(out), num_train_epochs=3, report_to=["none"], disable_tqdm=True, run_report=False,
                    logging_steps=1, per_device_train_batch_size=4, save_strategy="no", mixed_precision="no", seed=0,
                    eval_strategy="steps" if evaluate else "no", eval_steps=2)
    return train(model, data(), config=TrainConfig(**{**settings, **overrides}), loss_fn=loss_fn, optimizer=optimizer,
                 scheduler=schedule, hooks=list(hooks), eval_loader=data() if evaluate else None)


def test_docs_plateau_hook_beside_a_per_step_schedule_equals_the_native_pair_and_resumes(tmp_path):
    """The hook's ReduceLROnPlateau, stepped from on_evaluate, gives the rates and weights of the loop's own
    `scheduler=[exponential, plateau]`, bit for bit, also cut at step 8 and resumed (its state is checkpointed)."""
    plateau = doc_example("plateau")["PlateauOnEvaluation"]
    args = dict(mode="max", factor=0.5, patience=0)  # "max" on a falling loss: evaluations after the first cut the rate
    native, hooked, cut = [], [], []
    regression_run(tmp_path / "native", native, native_plateau=args)
    regression_run(tmp_path / "hooked", hooked, hooks=[plateau(**args)])
    assert hooked == native and len(native) == 24
    cuts = [round(b / a, 6) for a, b in zip(native, native[1:], strict=False) if b / a < 0.9]
    assert cuts and set(cuts) == {round(0.97 * 0.5, 6)}, f"the plateau halved the rate: {native}"
    assert same_weights(tmp_path / "native", tmp_path / "hooked")
    steps = dict(save_strategy="steps", save_steps=4)
    regression_run(tmp_path / "cut", cut, hooks=[plateau(**args), StopOnSave(8)], **steps)
    saved = json.loads((tmp_path / "cut" / "checkpoints" / "step-00000008" / "train_state.json").read_text())
    assert saved["hooks"]["PlateauOnEvaluation"]["num_bad_epochs"] >= 0
    regression_run(tmp_path / "cut", cut, hooks=[plateau(**args)], resume_from_checkpoint="latest", **steps)
    assert cut[-16:] == native[-16:] and same_weights(tmp_path / "native", tmp_path / "cut")


def test_docs_stop_rule_stops_every_rank_at_the_step_its_rule_names(tmp_path):
    stop_rule = doc_example("stop rule")["StopWhenLossBelow"](0.45, times=3)
    out = tmp_path / "run"
    toy(out, "--max_steps", "36", hooks=[stop_rule])
    losses = logged(out, "loss")
    expected = next(step for i, (step, _) in enumerate(losses)
                    if i >= 2 and all(value < 0.45 for _, value in losses[i - 2:i + 1]))
    assert stop_rule.stopped_at == expected < 36
    assert toy_records(out)[0][-1]["step"] == expected and losses[-1][0] == expected
    assert json.loads((out / "all_results.json").read_text())["train_steps"] == expected


def test_docs_tracker_names_reach_tensorboard_while_metrics_jsonl_and_the_report_keep_the_loops(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    renamed = {"loss": "Loss/train", "eval_loss": "Loss/eval", "learning_rate": "LR"}
    out = tmp_path / "run"
    toy(out, "--report_to", "tensorboard", "--eval_strategy", "steps", "--eval_steps", "4", "--run_report", "true",
        hooks=[doc_example("tracker names")["TrackerNames"](renamed)])
    files = sorted((out / "runs").rglob("events.out.tfevents.*"), key=lambda path: len(path.parts))
    events = EventAccumulator(str(files[0].parent))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"Loss/train", "Loss/eval", "LR", "train_loss"} <= tags and not tags & {"loss", "eval_loss", "learning_rate"}
    for name, tag in renamed.items():
        assert [(e.step, e.value) for e in events.Scalars(tag)] == \
            [(step, pytest.approx(value, rel=1e-6)) for step, value in logged(out, name)], tag
    assert len(logged(out, "loss")) == 8 and len(logged(out, "eval_loss")) == 2  # metrics.jsonl: the loop's names
    assert "loss" in (out / "report.md").read_text() and (out / "report" / "loss.png").exists()


def test_two_names_mapped_to_one_tracker_name_are_refused(tmp_path):
    clash = doc_example("tracker names")["TrackerNames"]({"loss": "learning_rate"})
    with pytest.raises(ConfigError, match="two logged names reach the trackers as 'learning_rate'"):
        toy(tmp_path / "run", hooks=[clash])
