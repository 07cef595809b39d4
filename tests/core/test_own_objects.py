"""A researcher's own optimizer and scheduler, run as they were built: the scheduler on the clock the user chose
(--scheduler_interval: each optimizer step, the stated default, or each epoch's end), and what the loop adds around
them (a built schedule, clipping) said in the start-up report and recorded in config.yaml's `what_ran`."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml
from conftest import StopOnSave, reset_accelerate, toy_main
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from accel_train import ConfigError, Preempted, TrainConfig, train

pytestmark = pytest.mark.usefixtures("one_thread")


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(32, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1))


def tutorial_run(out, used: list[float], *, hooks=(), step_size: int | None = 1, plateau: bool = False,
                 make_schedule=None, **overrides):
    """The PyTorch tutorial's objects: SGD at 0.1 and StepLR(step_size=1, gamma=0.1), meant per epoch (no scheduler
    for step_size None); `used` gets the learning rate each training step ran with (read in the loss, before the
    optimizer steps). `plateau`: a ReduceLROnPlateau beside it, on eval_loss at each epoch's evaluation (mode max:
    every evaluation after the first, whose loss went down, halves the rate). `make_schedule(optimizer)`: another
    scheduler in the StepLR's place."""
    reset_accelerate()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size, gamma=0.1) if step_size else None
    schedule = make_schedule(optimizer) if make_schedule else schedule
    if plateau:
        schedule = [schedule, torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5,
                                                                         patience=0)]
        overrides = {"eval_strategy": "epoch", **overrides}

    def loss_fn(m, batch):
        if m.training:
            used.append(optimizer.param_groups[0]["lr"])
        x, y = batch
        return torch.nn.functional.mse_loss(m(x).squeeze(-1), y)

    settings = dict(output_dir=str(out), num_train_epochs=2, report_to=["none"], disable_tqdm=True,
                    run_report=False, logging_steps=1, per_device_train_batch_size=4, save_strategy="steps",
                    save_steps=3, mixed_precision="no", seed=0)
    config = TrainConfig(**{**settings, **overrides})
    return train(model, data(), config=config, loss_fn=loss_fn, optimizer=optimizer, scheduler=schedule,
                 hooks=list(hooks), eval_loader=data() if plateau else None)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_steplr_declared_per_epoch_steps_at_epoch_ends_and_config_yaml_names_what_ran(tmp_path, capsys,
                                                                                         accumulation):
    used: list[float] = []
    tutorial_run(tmp_path / "run", used, scheduler_interval="epoch", gradient_accumulation_steps=accumulation)
    assert used == pytest.approx([0.1] * 8 + [0.01] * 8)  # 8 micro-batches an epoch: epoch 0 at 0.1, 1 at 0.01
    report = capsys.readouterr().out
    assert "schedule         yours, StepLR, stepped each epoch; --learning_rate and --warmup_steps do not apply" \
        in report
    assert "optimizer        SGD (yours): lr 0.1, weight decay 0" in report
    assert "clipping         global grad norm clipped to 1 (the default; --max_grad_norm 0 turns it off)" in report
    ran = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["what_ran"]
    assert ran == {"optimizer": {"class": "SGD", "given": "yours", "groups": [{"lr": 0.1, "weight_decay": 0.0}]},
                   "scheduler": {"class": "StepLR", "given": "yours", "stepped": "each epoch"},
                   "clipping": {"max_grad_norm": 1.0}}
    # config.yaml still reads back as a config (what_ran is a record, not a setting)
    from accel_train import parse_config

    (again,) = parse_config(argv=["--config", str(tmp_path / "run" / "config.yaml")])
    assert again.scheduler_interval == "epoch"


def test_undeclared_a_scheduler_steps_each_optimizer_step_and_the_report_says_it_is_the_default(tmp_path, capsys):
    # the tutorial's StepLR stepped per optimizer step would reach 0 after 10 of 16 steps: refused, the clock named
    with pytest.raises(ConfigError, match="the learning rate reaches 0 after step 10 of 16(.|\n)*set "
                                          "--scheduler_interval epoch"):
        tutorial_run(tmp_path / "tutorial", [])
    assert not (tmp_path / "tutorial" / "metrics.jsonl").exists()
    used: list[float] = []
    tutorial_run(tmp_path / "run", used, step_size=4, max_grad_norm=0)  # a per-step schedule: it runs, stated
    assert used == pytest.approx([0.1] * 4 + [0.01] * 4 + [0.001] * 4 + [0.0001] * 4)
    report = capsys.readouterr().out
    assert ("schedule         yours, StepLR, stepped each optimizer step (--scheduler_interval step, the default; "
            "epoch steps it at each epoch's end)") in report
    assert "clipping         none (--max_grad_norm 0)" in report


def test_a_built_schedule_for_your_optimizer_is_named_as_built(tmp_path, capsys):
    tutorial_run(tmp_path / "run", [], step_size=None, max_steps=2)
    report = capsys.readouterr().out
    assert "schedule         linear, peak lr" in report and "optimizer        SGD (yours)" in report
    ran = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["what_ran"]
    assert ran["scheduler"] == {"class": "LambdaLR", "given": "built: --lr_scheduler_type linear",
                                "stepped": "each optimizer step"}


def test_scale_lr_on_your_optimizer_is_named_with_its_factor(tmp_path, capsys):
    """--scale_lr multiplies your optimizer's rates before the built schedule takes them: the report says by what."""
    used: list[float] = []
    tutorial_run(tmp_path / "run", used, step_size=None, max_steps=2, scale_lr="linear", scale_lr_reference_batch=8,
                 lr_scheduler_type="constant")
    assert used == pytest.approx([0.05, 0.05])  # 0.1 x 4 / 8
    assert "optimizer        SGD (yours): lr 0.05, weight decay 0 (your rates x 0.5: --scale_lr linear)" in \
        capsys.readouterr().out


def test_an_epoch_schedule_resumes_mid_epoch_bitwise(tmp_path):
    whole: list[float] = []
    tutorial_run(tmp_path / "whole", whole, scheduler_interval="epoch")
    cut: list[float] = []
    tutorial_run(tmp_path / "cut", cut, scheduler_interval="epoch", hooks=[StopOnSave(9)])  # in epoch 1
    assert len(cut) == 9
    resumed: list[float] = []
    tutorial_run(tmp_path / "cut", resumed, scheduler_interval="epoch", resume_from_checkpoint="latest")
    assert cut + resumed == pytest.approx(whole)  # the epoch's rate comes back with the scheduler's state
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


class WarmupThenHalving:
    """A schedule of one's own that is no torch LRScheduler: a third of the rate, two thirds, the rate, then halved
    at every step."""

    def __init__(self, optimizer, stateful: bool = True):
        self.optimizer, self.count = optimizer, 0
        self.base = [group["lr"] for group in optimizer.param_groups]
        if stateful:
            self.state_dict = lambda: {"count": self.count}
            self.load_state_dict = self.load
        self.apply()

    def apply(self):
        factor = (self.count + 1) / 3 if self.count < 2 else 0.5 ** (self.count - 2)
        for group, base in zip(self.optimizer.param_groups, self.base, strict=True):
            group["lr"] = base * factor

    def step(self):
        self.count += 1
        self.apply()

    def load(self, state):
        self.count = state["count"]
        self.apply()


def test_a_scheduler_of_your_own_that_is_no_torch_scheduler_is_checkpointed_or_refused(tmp_path):
    """Accelerate's prepare takes in only torch LRSchedulers: such a scheduler was in no checkpoint, and a resume
    started its warmup again. Now registered for checkpointing (a resume continues it), or refused without a
    state_dict where checkpoints are written; scheduler=[] is refused (a built schedule was named yours)."""
    whole: list[float] = []
    tutorial_run(tmp_path / "whole", whole, make_schedule=WarmupThenHalving)
    assert whole[:4] == pytest.approx([0.1 / 3, 0.2 / 3, 0.1, 0.05])
    cut: list[float] = []
    tutorial_run(tmp_path / "cut", cut, make_schedule=WarmupThenHalving, hooks=[StopOnSave(6)])
    resumed: list[float] = []
    tutorial_run(tmp_path / "cut", resumed, make_schedule=WarmupThenHalving, resume_from_checkpoint="latest")
    assert len(cut) == 6 and cut + resumed == pytest.approx(whole)
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ConfigError, match="the WarmupThenHalving has no state_dict"):
        tutorial_run(tmp_path / "stateless", [], make_schedule=lambda o: WarmupThenHalving(o, stateful=False))
    tutorial_run(tmp_path / "unsaved", [], make_schedule=lambda o: WarmupThenHalving(o, stateful=False),
                 save_strategy="no")
    with pytest.raises(ConfigError, match=r"train\(scheduler=\[\]\): an empty list"):
        tutorial_run(tmp_path / "empty", [], make_schedule=lambda o: [])


def test_a_random_sampler_of_your_own_is_refused_where_the_seedable_sampler_would_replace_it(tmp_path):
    """Accelerate's seedable sampler replaces every RandomSampler, subclasses too: a sampler of one's own built on
    RandomSampler never sampled (its __iter__ never ran), without a word. Under an Accelerator of the user's without
    the seedable sampler the loader is taken as it is."""
    from accelerate import Accelerator

    drawn: list[int] = []

    class EvensFirst(torch.utils.data.RandomSampler):
        def __iter__(self):
            order = sorted(range(len(self.data_source)), key=lambda i: i % 2)
            drawn.extend(order)
            return iter(order)

    dataset = data().dataset

    def run(own_accelerator: bool = False):
        reset_accelerate()
        kwargs = {"accelerator": Accelerator(cpu=True)} if own_accelerator else {}
        model = torch.nn.Linear(4, 1)
        config = TrainConfig(output_dir=str(tmp_path / str(len(drawn))), max_steps=2, report_to=["none"],
                             disable_tqdm=True, run_report=False, per_device_train_batch_size=4, save_strategy="no")
        train(model, DataLoader(dataset, batch_size=4, sampler=EvensFirst(dataset)), config=config,
              loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]).squeeze(-1), b[1]), **kwargs)

    with pytest.raises(ConfigError, match="sampler, EvensFirst, subclasses torch's RandomSampler"):
        run()
    run(own_accelerator=True)
    assert drawn[:2] == [0, 2]  # its own order ran


def test_a_resume_says_which_settings_of_your_objects_the_checkpoint_put_back(tmp_path, capsys):
    """torch's load_state_dict restores a scheduler's settings and an optimizer's param groups as the checkpoint
    holds them: a CosineAnnealingLR rebuilt with another T_max (more epochs) ran the old one without a word."""
    cosine = {"make_schedule": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=16)}
    tutorial_run(tmp_path / "run", [], hooks=[StopOnSave(6)], **cosine)
    capsys.readouterr()
    tutorial_run(tmp_path / "run", [], resume_from_checkpoint="latest", num_train_epochs=4,
                 make_schedule=lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=32))
    out = capsys.readouterr().out
    assert "your scheduler's settings as the checkpoint holds them run, not as your code built them now: T_max 16 " \
           "(your code: 32)" in out, out[-3000:]
    lr = torch.optim.lr_scheduler  # nothing changed, nothing said: what a schedule steps is not a setting
    for name, make in (("same", cosine["make_schedule"]), ("restarts", lambda o: lr.CosineAnnealingWarmRestarts(o, 5)),
                       ("one_cycle", lambda o: lr.OneCycleLR(o, max_lr=0.1, total_steps=16))):  # cycles momentum
        tutorial_run(tmp_path / name, [], hooks=[StopOnSave(6)], make_schedule=make)
        capsys.readouterr()
        tutorial_run(tmp_path / name, [], resume_from_checkpoint="latest", make_schedule=make)
        assert "settings as the checkpoint holds them" not in capsys.readouterr().out, name


def test_a_resume_never_applies_the_flags_that_built_none_of_your_objects(tmp_path, capsys):
    """Your SGD and StepLR are not built from --learning_rate, --sgd_momentum or --lr_scheduler_type: a resume that
    changes them changes nothing in your objects (no rate scaled, no momentum written into your groups, no schedule
    refused) and says nothing of them; the resumed run is the uncut run, bitwise."""
    whole: list[float] = []
    tutorial_run(tmp_path / "whole", whole, scheduler_interval="epoch")
    cut: list[float] = []
    tutorial_run(tmp_path / "cut", cut, scheduler_interval="epoch", hooks=[StopOnSave(9)])
    capsys.readouterr()
    resumed: list[float] = []
    tutorial_run(tmp_path / "cut", resumed, scheduler_interval="epoch", resume_from_checkpoint="latest",
                 learning_rate=0.5, sgd_momentum=0.5, weight_decay=0.1, lr_scheduler_type="cosine")
    assert "applied to the loaded optimizer" not in capsys.readouterr().out
    assert cut + resumed == pytest.approx(whole)
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_into_other_objects_is_refused_by_name(tmp_path):
    """The checkpoint of your SGD and StepLR resumed with your Adam (the same one group: torch would load SGD's
    state into it and fail at its first step), or with what accel_train builds: refused before loading, naming the
    objects of both runs."""
    tutorial_run(tmp_path / "run", [], scheduler_interval="epoch", hooks=[StopOnSave(9)])
    config = TrainConfig(output_dir=str(tmp_path / "run"), num_train_epochs=2, report_to=["none"], disable_tqdm=True,
                         run_report=False, per_device_train_batch_size=4, save_strategy="steps", save_steps=3,
                         mixed_precision="no", seed=0, resume_from_checkpoint="latest", scheduler_interval="epoch")

    def resume(optimizer_cls):
        reset_accelerate()
        model = torch.nn.Linear(4, 1)
        optimizer = optimizer_cls(model.parameters(), lr=0.1) if optimizer_cls else None
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.1) if optimizer else None
        train(model, data(), config=config if optimizer else dataclasses.replace(config, scheduler_interval="step"),
              optimizer=optimizer, scheduler=schedule,
              loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]).squeeze(-1), b[1]))

    with pytest.raises(ConfigError, match=r"resuming with changed objects \(\['SGD \(yours\)', 'StepLR \(yours\)'\] -> "
                                          r"\['Adam \(yours\)', 'StepLR \(yours\)'\]\)"):
        resume(torch.optim.Adam)
    with pytest.raises(ConfigError, match=r"changed objects \(\['SGD \(yours\)', 'StepLR \(yours\)'\] -> "
                                          r"\['AdamW \(built\)', 'LambdaLR \(built\)'\]\)"):
        resume(None)


def test_a_scheduler_built_on_another_optimizer_than_the_one_that_trains_is_refused(tmp_path):
    """It would step the other optimizer's rates and leave the trained one's constant, while the pre-flight plotted
    its curve: refused before anything is written, whether the optimizer that trains is yours or built."""
    model = torch.nn.Linear(4, 1)
    schedule = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), 1)
    config = TrainConfig(output_dir=str(tmp_path / "run"), report_to=["none"], per_device_train_batch_size=4)
    for optimizer, trains in ((None, "the optimizer accel_train built"),
                              (torch.optim.SGD(model.parameters(), lr=0.1), "the optimizer you passed")):
        reset_accelerate()
        with pytest.raises(ConfigError, match=f"the StepLR was built on a SGD that does not train; {trains}"):
            train(model, data(), config=config, optimizer=optimizer, scheduler=schedule)
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
    from accelerate.utils import DummyOptim

    from accel_train.core.objects import drives

    trained = torch.optim.SGD(model.parameters(), lr=0.1)

    class Lookahead:  # a wrapper that shares the trained optimizer's param groups (timm's Lookahead does)
        def __init__(self, base):
            self.param_groups = base.param_groups

    assert drives(trained, trained) and drives(Lookahead(trained), trained)
    assert drives(DummyOptim(model.parameters()), trained)  # DeepSpeed's engine builds the optimizer later
    assert not drives(torch.optim.SGD(model.parameters(), lr=0.1), trained)


def test_wrong_clock_choices_are_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match="--scheduler_interval='hourly': choose one of step, epoch"):
        TrainConfig(scheduler_interval="hourly")
    with pytest.raises(ConfigError, match="--scheduler_interval epoch steps a scheduler object of your own"):
        tutorial_run(tmp_path / "built", [], step_size=None, scheduler_interval="epoch")
    assert not (tmp_path / "built" / "metrics.jsonl").exists()
    tutorial_run(tmp_path / "run", [], step_size=4, scheduler_interval="epoch", hooks=[StopOnSave(3)])
    with pytest.raises(ConfigError, match=r"resuming with changed scheduler_interval \('epoch' -> 'step'\)"):
        tutorial_run(tmp_path / "run", [], step_size=4, resume_from_checkpoint="latest")


def losses_and_train_loss(out):
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return ({r["step"]: r["loss"] for r in history if "loss" in r},
            json.loads((out / "all_results.json").read_text())["train_loss"])


@pytest.mark.parametrize(("accumulation", "cut"), [(1, "hook"), (2, "hook"), (1, "sigterm")])
def test_train_loss_and_the_logged_losses_after_a_resume_are_the_uninterrupted_runs(tmp_path, monkeypatch,
                                                                                    accumulation, cut):
    """Logged every 5 steps, checkpointed every 3: the checkpoint falls inside a logging interval, whose losses the
    resumed run logs with its own (TrainState.pending_loss), not only the steps after the checkpoint."""
    flags = dict(scheduler_interval="epoch", logging_steps=5, gradient_accumulation_steps=accumulation)
    steps = 16 // accumulation
    tutorial_run(tmp_path / "whole", [], **flags)
    if cut == "hook":
        tutorial_run(tmp_path / "cut", [], hooks=[StopOnSave(3 * (steps // 6) or 3)], **flags)
    else:  # SIGTERM after step 7: the loop checkpoints step 8 and stops
        monkeypatch.setenv("ACCEL_TRAIN_FAULT", "sigterm_after_step:7")
        with pytest.raises(Preempted):
            tutorial_run(tmp_path / "cut", [], **flags)
        monkeypatch.delenv("ACCEL_TRAIN_FAULT")
    checkpoint = max(int(p.name.split("-")[1]) for p in (tmp_path / "cut" / "checkpoints").glob("step-*"))
    assert checkpoint % 5, "the checkpoint must fall inside a logging interval"
    tutorial_run(tmp_path / "cut", [], resume_from_checkpoint="latest", **flags)
    (whole, whole_loss), (resumed, resumed_loss) = (losses_and_train_loss(tmp_path / o) for o in ("whole", "cut"))
    assert resumed_loss == whole_loss
    assert {s: v for s, v in resumed.items() if s > checkpoint} == {s: v for s, v in whole.items() if s > checkpoint}


def test_on_two_processes_a_resume_inside_a_logging_interval_logs_the_uninterrupted_runs_train_loss(ranks, tmp_path):
    """Each rank's unlogged losses are kept in the checkpoint and come back to that rank: the reduction of the
    resumed interval adds the same numbers in the same order."""
    flags = ["--report_to", "none", "--disable_tqdm", "--run_report", "false", "--num_samples", "48",
             "--per_device_train_batch_size", "4", "--num_train_epochs", "2", "--logging_steps", "5",
             "--save_strategy", "steps", "--save_steps", "3", "--save_total_limit", "10", "--eval_strategy", "no",
             "--mixed_precision", "no"]
    ranks.run(toy_main, ["--output_dir", str(tmp_path / "whole"), *flags])
    checkpoint = tmp_path / "whole" / "checkpoints" / "step-00000009"  # inside the interval 6..10
    state = json.loads((checkpoint / "train_state.json").read_text())
    assert len(state["pending_loss"]) == 2 and state["last_log_step"] == 5
    ranks.run(toy_main, ["--output_dir", str(tmp_path / "cut"), *flags, "--resume_from_checkpoint", str(checkpoint)])
    (whole, whole_loss), (resumed, resumed_loss) = (losses_and_train_loss(tmp_path / o) for o in ("whole", "cut"))
    assert resumed_loss == whole_loss
    assert {s: v for s, v in resumed.items() if s > 9} == {s: v for s, v in whole.items() if s > 9}


def test_a_steplr_beside_a_plateau_steps_each_on_its_own_clock_and_resumes_bitwise(tmp_path, capsys):
    """The tutorial's pair: StepLR at each epoch's end, then the plateau on that epoch's evaluation."""
    whole: list[float] = []
    tutorial_run(tmp_path / "whole", whole, plateau=True, scheduler_interval="epoch", num_train_epochs=3)
    # epoch 0 at 0.1; StepLR -> 0.01 (the first evaluation sets the plateau's best); StepLR -> 0.001, halved -> 5e-4
    assert whole == pytest.approx([0.1] * 8 + [0.01] * 8 + [0.0005] * 8)
    assert ("schedule         yours, StepLR, stepped each epoch; beside it ReduceLROnPlateau, stepped at each "
            "evaluation, on eval_loss") in capsys.readouterr().out
    ran = yaml.safe_load((tmp_path / "whole" / "config.yaml").read_text())["what_ran"]
    assert ran["plateau"] == {"class": "ReduceLROnPlateau", "given": "yours",
                              "stepped": "at each evaluation, on eval_loss"}
    cut: list[float] = []
    tutorial_run(tmp_path / "cut", cut, plateau=True, scheduler_interval="epoch", num_train_epochs=3,
                 hooks=[StopOnSave(18)])  # in epoch 2: both schedules' states are in the checkpoint
    resumed: list[float] = []
    tutorial_run(tmp_path / "cut", resumed, plateau=True, scheduler_interval="epoch", num_train_epochs=3,
                 resume_from_checkpoint="latest")
    assert cut + resumed == pytest.approx(whole)
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the plateau's own state (best, bad epochs) is checkpointed beside the StepLR's and came back
    plateaus = [torch.load(tmp_path / run / "checkpoints" / "step-00000024" / "scheduler_1.bin", weights_only=False)
                for run in ("whole", "cut")]
    assert plateaus[0]["last_epoch"] == 3 and plateaus[0] == plateaus[1]  # 3 evaluations, the same best and rate
    with pytest.raises(ConfigError, match="at most one schedule on the clock and one ReduceLROnPlateau"):
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = [torch.optim.lr_scheduler.StepLR(optimizer, 1), torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.9)]
        train(model, data(), config=TrainConfig(output_dir=str(tmp_path / "two"), report_to=["none"],
                                                per_device_train_batch_size=4), optimizer=optimizer, scheduler=steps)


# ------------------------------------------------------------------ errors that name the culprit (what a port met)


def own_accelerator_run(out: str) -> None:
    """[on each rank] SGD at 0.1 and a StepLR halving it at every optimizer step, under an Accelerator of the user's
    own with Accelerate's defaults, whose prepared schedulers step once per process at each call: the loop's one
    call per optimizer step stepped the schedule twice on 2 processes (0.1, 0.025, ...). Also a plateau scheduler
    beside it (mode max): stepped twice with step 2's evaluation, its second call saw no improvement and halved."""
    from accelerate import Accelerator

    reset_accelerate()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    used: list[float] = []

    def loss_fn(m, batch):
        if m.training:
            used.append(optimizer.param_groups[0]["lr"])
        return torch.nn.functional.mse_loss(m(batch[0]).squeeze(-1), batch[1])

    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=0)
    config = TrainConfig(output_dir=out, max_steps=4, report_to=["none"], disable_tqdm=True, run_report=False,
                         per_device_train_batch_size=4, save_strategy="no", mixed_precision="no", seed=0,
                         eval_strategy="steps", eval_steps=2)
    train(model, data(), config=config, loss_fn=loss_fn, optimizer=optimizer, accelerator=Accelerator(cpu=True),
          scheduler=[torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5), plateau], eval_loader=data())
    assert used == pytest.approx([0.1, 0.05, 0.025, 0.0125]), used  # the plateau's first evaluation sets its best


def test_an_accelerator_of_yours_steps_the_schedules_once_per_optimizer_step_on_two_processes(ranks, tmp_path):
    ranks.run(own_accelerator_run, str(tmp_path / "run"))


def tiny_train(tmp_path, loader, **kwargs):
    reset_accelerate()
    config = TrainConfig(output_dir=str(tmp_path / "run"), report_to=["none"], disable_tqdm=True, run_report=False,
                         per_device_train_batch_size=4, max_steps=2, mixed_precision="no",
                         eval_strategy="steps" if "eval_loader" in kwargs else "no", eval_steps=1)
    return train(torch.nn.Linear(4, 1), loader, config=config, **kwargs)


def mse(model, batch):
    x, y = batch
    per_sample = (model(x).squeeze(-1) - y) ** 2
    return {"loss": per_sample.mean(), "per_sample_loss": per_sample}


def test_the_default_loss_says_what_to_do_with_tuple_and_text_batches(tmp_path):
    with pytest.raises(ConfigError, match=r"loss_fn=None uses a transformers model's own loss.*this batch is a list "
                                          r"of 2. For \(inputs, targets\) batches pass your loss"):
        tiny_train(tmp_path, data())
    texts = DataLoader([{"text": "a b", "labels": 0}] * 8, batch_size=4)
    with pytest.raises(ConfigError, match="the batch holds text under 'text': a model takes tensors. Tokenize"):
        tiny_train(tmp_path / "text", texts)


def test_a_per_sample_loss_of_the_wrong_length_and_a_vector_metric_are_named(tmp_path):
    def short(model, batch):
        out = mse(model, batch)
        return {**out, "per_sample_loss": out["per_sample_loss"][:2]}

    with pytest.raises(ConfigError, match=r"per_sample_loss of shape \(2,\) for a batch of 4 samples: it must hold "
                                          r"one loss per sample, shape \(4,\)"):
        tiny_train(tmp_path / "short", data(), loss_fn=short, eval_loader=data())

    def per_class(outputs):
        return {"error": torch.zeros(3)}

    with pytest.raises(ConfigError, match=r"metrics_fn returned 'error' = Tensor of shape \(3,\): each metric must be "
                                          r"one number .* \(error_0, error_1, ...\)"):
        tiny_train(tmp_path / "vector", data(), loss_fn=mse, eval_loader=data(), metrics_fn=per_class)


def test_the_record_names_the_torch_optimizer_inside_deepspeeds_wrappers_and_its_fused_kernel():
    """Under DeepSpeed the prepared optimizer is Accelerate's DeepSpeedOptimizerWrapper around DeepSpeed's ZeRO
    optimizer around the torch optimizer that steps the partitions: the record and the report name the last, and say
    when it runs torch's fused kernel (--optim adamw_torch_fused, or a fused optimizer of the user's)."""
    from accel_train.core.objects import report_lines, what_ran

    def wrapped(name: str, inner):
        wrapper = type(name, (), {})()
        wrapper.optimizer = inner
        return wrapper

    config = TrainConfig(output_dir="unused")
    fused = torch.optim.AdamW(torch.nn.Linear(2, 1).parameters(), lr=0.1, fused=True)
    ran = what_ran(wrapped("DeepSpeedOptimizerWrapper", wrapped("DeepSpeedZeroOptimizer", fused)), None, config,
                   own_optimizer=False, own_scheduler=False)
    assert ran["optimizer"]["class"] == "AdamW" and ran["optimizer"]["fused"] is True
    line = report_lines(ran, config)[1][0]
    assert line == "  optimizer        AdamW (built from the config, fused kernel): lr 0.1, weight decay 0.01"
    plain = what_ran(torch.optim.AdamW(torch.nn.Linear(2, 1).parameters(), lr=0.1), None, config,
                     own_optimizer=True, own_scheduler=False)
    assert "fused" not in plain["optimizer"] and report_lines(plain, config)[1][0].startswith(
        "  optimizer        AdamW (yours): lr 0.1")
