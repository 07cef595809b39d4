"""The loop in one process: accumulation equivalence (5a), bf16 on CPU (5e), schedules, run-directory contents."""

import json
from types import SimpleNamespace

import pytest
import torch
import toy_train
from conftest import read_jsonl, reset_accelerate
from safetensors.torch import load_file
from torch.utils.data import DataLoader, TensorDataset

from accel_train import ConfigError, TrainConfig, build_accelerator, build_scheduler, make_loader, make_plan, train
from accel_train.core import data as data_module
from accel_train.core.data import UNEQUAL_VARIABLE
from accel_train.core.loss import Window

QUIET = ["--report_to", "none", "--disable_tqdm"]


def run_toy(out, *args):
    reset_accelerate()
    toy_train.main(["--output_dir", str(out), *QUIET, *args])
    return load_file(out / "model.safetensors")


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("num_samples", [48, 40])  # 40: the last accumulation window of each epoch is short
def test_accumulation_equals_one_big_batch(tmp_path, num_samples):
    # SGD, not Adam: Adam normalises the gradient scale and would hide a loss divided twice.
    common = ["--num_samples", str(num_samples), "--optim", "sgd", "--sgd_momentum", "0", "--learning_rate", "0.5",
              "--num_train_epochs", "3", "--max_grad_norm", "0", "--save_strategy", "no", "--eval_strategy", "no"]
    small = run_toy(tmp_path / "acc", *common, "--per_device_train_batch_size", "4",
                    "--gradient_accumulation_steps", "3")
    big = run_toy(tmp_path / "big", *common, "--per_device_train_batch_size", "12",
                  "--gradient_accumulation_steps", "1")
    initial = torch.nn.Linear(6, 32)  # sanity: training moved the weights
    assert max_diff(small, big) < 1e-5
    assert small["0.weight"].shape == initial.weight.shape
    steps = [r for r in read_jsonl(tmp_path / "acc" / "metrics.jsonl") if "loss" in r]
    assert steps[-1]["step"] == 3 * -(-num_samples // 12)


def test_window_scale_rescales_only_the_short_last_window():
    # accumulation 4: Accelerate divided each micro-batch's mean by 4; a window of 2 micro-batches is rescaled
    # by 4 / 2 so its gradient is the mean over the 2 it had, a full window is left alone
    accelerator = SimpleNamespace(gradient_accumulation_steps=4, num_processes=1,
                                  distributed_type=SimpleNamespace(value="NO"))
    for micro_batches, factor in ((2, 2.0), (4, 1.0), (3, 4 / 3)):
        model = torch.nn.Linear(2, 1)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        window = Window(accelerator)
        for _ in range(micro_batches):
            window.add({"loss": torch.tensor(1.0), "objective": torch.tensor(1.0)})
        assert window.scale_gradients(model) is None
        assert all(torch.allclose(p.grad, torch.full_like(p, factor)) for p in model.parameters())


def test_bf16_on_cpu_really_runs_in_bf16(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(64, 6)
    y = (x[:, 0] > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    dtypes = set()
    model[0].register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))
    config = TrainConfig(output_dir=str(tmp_path), mixed_precision="bf16", num_train_epochs=8, learning_rate=0.02,
                         per_device_train_batch_size=16, report_to=["none"], disable_tqdm=True, logging_steps=1,
                         eval_strategy="no", save_strategy="no")
    result = train(model, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True),
                   loss_fn=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), config=config)
    assert dtypes == {torch.bfloat16}
    losses = [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert losses[-1] < 0.7 * losses[0]
    assert result.accelerator.mixed_precision == "bf16"


def test_fp16_on_cpu_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="fp16 was requested on a CPU.*bf16"):
        build_accelerator(TrainConfig(output_dir=str(tmp_path), mixed_precision="fp16", report_to=["none"]))


@pytest.mark.parametrize("name, kwargs", [
    ("linear", None), ("cosine", None), ("cosine_with_restarts", None), ("polynomial", None), ("constant", None),
    ("constant_with_warmup", None), ("inverse_sqrt", None), ("reduce_lr_on_plateau", None),
    ("cosine_with_min_lr", '{"min_lr_rate": 0.1}'),
    ("warmup_stable_decay", '{"num_decay_steps": 10}'), ("step", '{"step_size": 10, "gamma": 0.5}'),
    ("multistep", '{"milestones": [20, 30]}'), ("exponential", '{"gamma": 0.9}'), ("cosine_annealing", None),
])
def test_every_scheduler_warms_up_in_optimizer_steps(name, kwargs):
    config = TrainConfig(learning_rate=1.0, lr_scheduler_type=name, lr_scheduler_kwargs=kwargs, warmup_steps=4,
                         max_steps=40, report_to=["none"])
    plan = make_plan(config, batches_per_epoch=10, num_processes=1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    if name == "reduce_lr_on_plateau":  # steps on evaluations, takes no warmup: refused with a message
        with pytest.raises(ConfigError, match="takes no warmup"):
            build_scheduler(optimizer, config, plan)
        return
    scheduler = build_scheduler(optimizer, config, plan)
    lrs = []
    for _ in range(plan.total_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    if name in ("linear", "cosine", "polynomial", "cosine_annealing", "step", "multistep", "exponential"):
        assert lrs[-1] < 0.9


def test_reduce_on_plateau_steps_on_evaluations(tmp_path):
    run_toy(tmp_path / "p", "--lr_scheduler_type", "reduce_on_plateau", "--lr_scheduler_kwargs",
            '{"patience": 0, "factor": 0.5, "threshold": 0.01}', "--learning_rate", "1e-5", "--eval_strategy", "steps",
            "--eval_steps", "2",
            "--logging_steps", "2", "--max_steps", "8", "--save_strategy", "no")
    # lr ~0: the eval loss never improves, so every evaluation after the first halves the lr (and nothing else does)
    history = read_jsonl(tmp_path / "p" / "metrics.jsonl")
    assert [r["step"] for r in history if "eval_loss" in r] == [2, 4, 6, 8]
    assert [r["learning_rate"] for r in history if "loss" in r] == pytest.approx([1e-5, 1e-5, 5e-6, 2.5e-6])


def test_warmup_longer_than_training_is_refused():
    config = TrainConfig(warmup_steps=50, max_steps=10, report_to=["none"])
    with pytest.raises(ConfigError, match="warmup .50 steps. is longer than training .10"):
        make_plan(config, batches_per_epoch=5, num_processes=1)


def test_run_directory_holds_everything(tmp_path):
    out = tmp_path / "run"
    run_toy(out, "--num_train_epochs", "2", "--save_total_limit", "1", "--report_to", "tensorboard",
            "--metric_for_best_model", "accuracy", "--eval_strategy", "epoch")
    names = {p.name for p in out.iterdir()}
    assert {"config.yaml", "metrics.jsonl", "all_results.json", "checkpoints", "runs", "model.safetensors"} <= names
    results = json.loads((out / "all_results.json").read_text())
    assert {"eval_loss", "eval_accuracy", "train_loss", "train_runtime", "epoch"} <= set(results)
    assert results["eval_samples"] == 37
    ckpts = sorted((out / "checkpoints").iterdir())
    state = json.loads((ckpts[-1] / "train_state.json").read_text())
    assert (ckpts[-1] / "model.safetensors").is_file() and (ckpts[-1] / "manifest.json").is_file()
    # keep-last-1 never deletes the best checkpoint
    assert {p.name for p in ckpts} == {"step-00000024", state["best_checkpoint"]}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((out / "runs").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    assert "loss" in events.Tags()["scalars"] and "eval_accuracy" in events.Tags()["scalars"]
    exported = load_file(out / "model.safetensors")
    assert set(exported) == {"0.weight", "0.bias", "3.weight", "3.bias"}  # no wrapper prefixes leak


def test_build_accelerator_passes_kwargs_handlers_through(tmp_path):
    from accelerate.utils import DistributedDataParallelKwargs

    config = TrainConfig(output_dir=str(tmp_path), report_to=["none"])
    assert build_accelerator(config).ddp_handler is None
    reset_accelerate()
    handler = DistributedDataParallelKwargs(find_unused_parameters=True)
    assert build_accelerator(config, [handler]).ddp_handler is handler


def test_the_loop_draws_nothing_from_the_global_rng_before_the_first_forward(tmp_path):
    # A hand-written loop that seeds, builds its model and gives its DataLoader a generator sees the same dropout
    # masks as train() only if train() draws nothing from the global RNG on the way: not in prepare, not in the
    # pre-flight check, not when an epoch's DataLoader iterator starts (which draws its base seed from the
    # loader's generator, or from the global RNG when the loader has none).
    reset_accelerate()
    config = TrainConfig(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4,
                         warmup_steps=0, report_to=["none"], disable_tqdm=True, save_strategy="no", eval_strategy="no")
    accelerator = build_accelerator(config)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 1))
    expected = torch.get_rng_state()
    seen = []

    def loss_fn(model, batch):
        seen.append(torch.get_rng_state())
        return model(batch[0]).pow(2).mean()

    loader = DataLoader(TensorDataset(torch.randn(16, 3, generator=torch.Generator().manual_seed(0))), batch_size=4)
    train(model, loader, config=config, loss_fn=loss_fn, accelerator=accelerator)
    assert torch.equal(seen[0], expected)


def test_split_loaders_name_the_evaluation_and_the_final_test_split_and_workers_come_from_the_library(tmp_path):
    from accel_train import pad_multiple, split_loaders
    from accel_train.core.data import loader_workers

    splits = {name: TensorDataset(torch.arange(n)) for name, n in (("train", 8), ("validation", 4), ("test", 3))}
    config = TrainConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, per_device_eval_batch_size=3)
    accelerator = SimpleNamespace(num_processes=1, process_index=0, mixed_precision="bf16",
                                  device=torch.device("cpu"))
    loaders = split_loaders(splits, config, accelerator, "validation")
    assert loaders.eval is loaders.by_split["validation"] and loaders.final == {"test": loaders.by_split["test"]}
    assert loaders.train.batch_size == 2 and loaders.eval.batch_size == 3
    only_test = split_loaders({k: v for k, v in splits.items() if k != "validation"}, config, accelerator, "test")
    assert only_test.eval is only_test.by_split["test"] and only_test.final is None  # evaluated, not twice
    assert pad_multiple(accelerator) is None  # bf16 on a CPU: padding to 8 is only extra work
    assert loader_workers(config) == (0, False)  # no GPU here: no workers by default
    assert loader_workers(config.replace(dataloader_num_workers=2)) == (2, False)


def test_mixed_precision_auto_picks_native_bf16_and_yields_to_the_launcher(tmp_path, monkeypatch):
    from accel_train.core import accelerator as acc_module

    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    monkeypatch.setattr(acc_module, "native_bf16", lambda: True)
    assert acc_module.resolve_precision("auto") == "bf16"
    monkeypatch.setattr(acc_module, "native_bf16", lambda: False)  # emulated bf16 is slower than fp32: not picked
    assert acc_module.resolve_precision("auto") == "no"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # the launcher asked for a precision: it stands
    assert acc_module.resolve_precision("auto") == "fp16"
    assert acc_module.resolve_precision("no") == "no" and acc_module.resolve_precision(None) is None
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    monkeypatch.setattr(acc_module, "native_bf16", lambda: True)
    reset_accelerate()
    config = TrainConfig(output_dir=str(tmp_path), mixed_precision="auto", report_to=["none"])
    accelerator = build_accelerator(config)
    assert accelerator.mixed_precision == "bf16"
    from accel_train.core.accelerator import startup_report
    from accel_train.core.optim import make_plan

    report = startup_report(accelerator, config, make_plan(config, 4, 1), 32)
    assert "bf16 autocast on cpu (--mixed_precision auto: this cpu computes bf16 natively; --mixed_precision no" \
           in report
    monkeypatch.setattr(acc_module, "native_bf16", lambda: False)
    reset_accelerate()
    fp32 = build_accelerator(config)
    assert "fp32 (--mixed_precision auto: this cpu has no native bf16, so fp32" in \
        startup_report(fp32, config, make_plan(config, 4, 1), 32), "the report says why auto gave fp32"
    monkeypatch.setattr(acc_module, "native_bf16", lambda: True)
    reset_accelerate()
    accelerator = build_accelerator(config)
    # the pre-flight check compares the precision auto resolved to, not the word "auto", with the Accelerator's
    data = DataLoader(TensorDataset(torch.randn(16, 2), torch.randint(0, 2, (16,))), batch_size=8)
    result = train(torch.nn.Linear(2, 2), data, config=config.replace(max_steps=2, save_strategy="no",
                                                                      eval_strategy="no", disable_tqdm=True),
                   loss_fn=lambda model, batch: torch.nn.functional.cross_entropy(model(batch[0]), batch[1]),
                   accelerator=accelerator)
    assert result.state.step == 2, "a run with --mixed_precision auto starts and trains"


@pytest.mark.parametrize("processes", [1, 2])
def test_length_grouped_steps_hold_the_same_examples_with_or_without_accumulation(processes):
    """k accumulated micro-batches of B make one optimizer step from the examples one batch of kB holds: length
    grouping groups by the step's global batch (per-device batch x processes x accumulation), as the Trainer does.
    It grouped by the micro-batch: the main job at seed 3 (64 examples, 2 x 16 against 32) fed one other example in
    step 1, and with megabatches of 50 groups every step differed; `accel-train verify`'s accumulation check reported
    it as a loss defect (gradient norm 1.1e-2 relative in fp32)."""
    lengths = torch.randint(1, 200, (3000,), generator=torch.Generator().manual_seed(0)).tolist()

    def steps(batch: int, accumulation: int) -> list[list[int]]:
        config = TrainConfig(output_dir="unused", per_device_train_batch_size=batch, seed=3,
                             gradient_accumulation_steps=accumulation)
        loader = make_loader(list(range(len(lengths))), config, train=True, lengths=lengths,
                             num_processes=processes, process_index=0, collate_fn=lambda rows: rows)
        order = [i for i in loader.sampler]  # the global order, before the processes deal it out
        per_step = batch * processes * accumulation
        return [sorted(order[i:i + per_step]) for i in range(0, len(order), per_step)]

    assert steps(4, 4) == steps(16, 1) and steps(8, 2) == steps(16, 1)


def test_verify_chooses_step_one_of_the_shortest_and_longest_examples_and_the_epoch_stays_whole(monkeypatch):
    """ACCEL_TRAIN_UNEQUAL_FIRST_STEP=1 (accel-train verify's variants): the first optimizer step of epoch 0 holds the
    set's G/2 shortest and G/2 longest examples (G: per-device batch x processes x accumulation), ordered by length,
    so the first micro-batch holds the shortest rows and the last the longest; the same examples whatever the split
    (k micro-batches of B, one batch of kB, 2 processes); the rest of the epoch is the length-grouped order without
    them (every example once), and later epochs are untouched. A loader built without num_processes groups by the
    world the launcher started, as one built with it."""
    lengths = torch.randint(1, 200, (300,), generator=torch.Generator().manual_seed(1)).tolist()

    def order(batch: int, accumulation: int, processes: int | None = 1, epoch: int = 0) -> list[int]:
        config = TrainConfig(output_dir="unused", per_device_train_batch_size=batch, seed=3,
                             gradient_accumulation_steps=accumulation)
        more = {} if processes is None else {"num_processes": processes}
        loader = make_loader(list(range(len(lengths))), config, train=True, lengths=lengths, process_index=0,
                             collate_fn=lambda rows: rows, **more)
        loader.sampler.set_epoch(epoch)
        return list(loader.sampler)

    plain = {key: order(*key) for key in [(8, 2), (8, 1, 2, 1)]}
    monkeypatch.setenv(UNEQUAL_VARIABLE, "1")
    first = order(8, 2)
    by_length = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    assert sorted(first[:16]) == sorted(by_length[:8] + by_length[-8:])
    assert [lengths[i] for i in first[:16]] == sorted(lengths[i] for i in first[:16])  # ascending: unequal halves
    assert sum(lengths[i] for i in first[:8]) * 5 < sum(lengths[i] for i in first[8:16])
    assert sorted(first) == list(range(len(lengths)))  # a permutation: every example once in the epoch
    assert first[16:] == [i for i in plain[(8, 2)] if i not in set(first[:16])]
    assert order(16, 1)[:16] == first[:16] == order(8, 1, 2)[:16]  # one batch of kB; 2 processes of kB/2 each
    assert order(8, 1, 2, epoch=1) == plain[(8, 1, 2, 1)]  # later epochs: the length-grouped order
    monkeypatch.setattr(data_module, "_world", lambda: 2)  # a launch of 2 processes
    assert order(4, 1, None) == order(4, 1, 2)  # grouped by the step over both processes, though not told


def test_train_seconds_are_logged_with_each_record_and_go_on_counting_after_a_resume(tmp_path):
    """Every training record holds train_seconds, the run's training seconds so far (evaluations and checkpoint writes
    are the meter's pauses, excluded): rising record by record, saved in the checkpoint's state, and a run resumed
    from it goes on from there (time to a target quality counts the whole run)."""
    out = tmp_path / "run"
    common = ["--max_steps", "8", "--logging_strategy", "steps", "--logging_steps", "1", "--save_strategy", "steps",
              "--save_steps", "4", "--eval_strategy", "steps", "--eval_steps", "2"]
    run_toy(out, *common, "--stop_at_step", "4")
    first = [r["train_seconds"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert len(first) == 4 and first[0] > 0 and first == sorted(set(first))
    assert all("train_seconds" not in r for r in read_jsonl(out / "metrics.jsonl") if "eval_loss" in r)
    state = json.loads((out / "checkpoints" / "step-00000004" / "train_state.json").read_text())
    assert state["train_seconds"] == pytest.approx(first[-1], abs=1e-3)
    run_toy(out, *common, "--resume_from_checkpoint", "latest")
    after = [r["train_seconds"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r and r["step"] > 4]
    assert len(after) == 4 and after[0] > first[-1] and after == sorted(set(after))
