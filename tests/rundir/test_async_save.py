"""--async_save (rundir/async_checkpoint.py): interval checkpoints written in the background, proven with what it
meets. Each run with it is compared with the same run without it, bitwise: the checkpoints (weights, optimizer,
scheduler, random states, train state), the final weights, and a resume from a background-written checkpoint. A kill
inside a background write is a real SIGKILL of its own process (the one process start here); the rest runs in this
process or on the session's two gloo ranks."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from accelerate.utils import DistributedType
from conftest import SCRIPTS, points_run, reset_accelerate, stop_then_resume, subprocess_env, token_main, toy_main
from safetensors.torch import load_file

from accel_train import ConfigError, run_cli
from accel_train.rundir.async_checkpoint import refuse_async
from accel_train.rundir.checkpoint import list_checkpoints, verify_checkpoint

QUIET = ["--report_to", "none", "--disable_tqdm", "--run_report", "false", "--logging_steps", "1",
         "--eval_strategy", "no"]
SAVES = ["--save_strategy", "steps", "--save_steps", "4", "--num_train_epochs", "2"]  # 24 steps on 1 process


def toy(out, *args):
    import toy_train

    reset_accelerate()
    run_cli(toy_train.main, ["--output_dir", str(out), *QUIET, *args])


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def nested_equal(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(nested_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(nested_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def assert_same_checkpoints(sync, background):
    """Every checkpoint of the two runs: the same steps, files and contents (pickles compared loaded)."""
    a, b = list_checkpoints(sync), list_checkpoints(background)
    assert [p.name for p in a] == [p.name for p in b] and a
    for x, y in zip(a, b, strict=True):
        verify_checkpoint(y)
        names = sorted(f.name for f in x.iterdir() if f.name != "manifest.json")
        assert names == sorted(f.name for f in y.iterdir() if f.name != "manifest.json")
        for name in names:
            if name.endswith(".safetensors"):
                assert same_tensors(load_file(x / name), load_file(y / name)), (x.name, name)
            elif name.endswith((".bin", ".pkl")):
                assert nested_equal(torch.load(x / name, weights_only=False),
                                    torch.load(y / name, weights_only=False)), (x.name, name)
            elif name == "train_state.json":  # train_seconds is a clock: the training time each run took
                states = [json.loads((path / name).read_text()) for path in (x, y)]
                assert [state.pop("train_seconds") > 0 for state in states] == [True, True]
                assert states[0] == states[1], (x.name, name)
            else:
                assert (x / name).read_bytes() == (y / name).read_bytes(), (x.name, name)


@pytest.fixture
def slow_disk(monkeypatch):
    """Each background write waits 0.3 s first: the toy trains on for many steps during it (it takes milliseconds
    per step), so a state copied late, or read live by the writer, would show."""
    monkeypatch.setenv("ACCEL_TRAIN_FAULT", "slow_background_write:0.3")


def test_background_checkpoints_equal_synchronous_ones_and_a_resume_from_one_is_bitwise(tmp_path, slow_disk):
    """With a weight average and dropout (its random states matter), rotation to 2: the same checkpoints as the
    synchronous run; then cut after step 10 and resumed from step 8's background-written checkpoint."""
    flags = [*SAVES, "--ema_decay", "0.9", "--dropout", "0.2", "--save_total_limit", "2"]
    toy(tmp_path / "sync", *flags)
    toy(tmp_path / "async", *flags, "--async_save")
    assert [p.name for p in list_checkpoints(tmp_path / "async")] == ["step-00000020", "step-00000024"]
    assert_same_checkpoints(tmp_path / "sync", tmp_path / "async")
    assert not list((tmp_path / "async" / "checkpoints").glob(".tmp-*"))
    assert same_tensors(load_file(tmp_path / "sync" / "model.safetensors"),
                        load_file(tmp_path / "async" / "model.safetensors"))
    full, cut = tmp_path / "full", tmp_path / "cut"
    stop_then_resume(lambda out, *more: toy(out, *flags[:-2], "--async_save", *more), full, cut, 10, 8)
    assert same_tensors(load_file(full / "model.safetensors"), load_file(cut / "model.safetensors"))


def test_tied_weights_are_written_once_in_the_background_as_in_a_synchronous_save(tmp_path):
    """A language model's embedding and head are one tensor, of which Accelerate's writer keeps one name. The copy
    taken for the background write made them two tensors, both written, and load_state refused every such checkpoint
    ("Unexpected key(s) in state_dict"): no checkpoint of a tied model could be resumed. Now the same files as a
    synchronous save (the resume: test_matrix.py's row "token budget + Muon + async save + SIGTERM"). The background
    checkpoints of a transformers model also lacked its config.json (written before the weights were there, it was
    skipped): they did not load with from_pretrained."""
    flags = ["--num_sequences", "24", "--per_device_train_batch_size", "4", "--num_train_epochs", "1",
             "--save_strategy", "steps", "--save_steps", "2", *QUIET]
    for name, extra in (("sync", []), ("async", ["--async_save", "true"])):
        token_main(["--output_dir", str(tmp_path / name), *flags, *extra])
    assert_same_checkpoints(tmp_path / "sync", tmp_path / "async")
    written = load_file(list_checkpoints(tmp_path / "async")[0] / "model.safetensors")
    assert len({"transformer.wte.weight", "lm_head.weight"} & written.keys()) == 1
    assert (list_checkpoints(tmp_path / "async")[0] / "config.json").is_file()  # it loads with from_pretrained


def test_two_processes_and_a_spike_rollback_write_the_same_checkpoints_in_the_background(tmp_path, ranks,
                                                                                          slow_disk):
    """On the session's two gloo ranks (the main one writes in the background, the other its own random states at
    the step), and in this process a --on_spike rollback to a checkpoint that may still be being written."""
    flags = ["--output_dir", None, *QUIET, *SAVES, "--per_device_train_batch_size", "4", "--dropout", "0.2"]
    for name, extra in (("sync", []), ("async", ["--async_save"])):
        flags[1] = str(tmp_path / name)
        ranks.run(toy_main, [*flags, *extra], env={"ACCEL_TRAIN_FAULT": "slow_background_write:0.3"})
    assert_same_checkpoints(tmp_path / "sync", tmp_path / "async")
    # test_spike_guard's rollback: the spiked batch comes back each epoch (index order), each time the run returns to
    # its last checkpoint, here written in the background; it ends bitwise as the run whose data never held it
    rollback = ["--spike_window", "5", "--spike_threshold", "10", "--shuffle", "false", "--dropout", "0.2",
                "--max_steps", "33", "--save_strategy", "steps", "--save_steps", "4", "--on_spike", "rollback"]
    toy(tmp_path / "rolled", *rollback, "--async_save", "--spike_index", "40", "--spike_scale", "1e4")
    toy(tmp_path / "never", *rollback, "--without", "40-47")
    rows = [json.loads(line) for line in (tmp_path / "rolled" / "metrics.jsonl").read_text().splitlines()]
    assert [r["spike_rollback_step"] for r in rows if "spike_rollback_step" in r] == [6, 17, 28]
    assert same_tensors(load_file(tmp_path / "rolled" / "model.safetensors"),
                        load_file(tmp_path / "never" / "model.safetensors"))


@pytest.mark.slow
def test_a_kill_inside_a_background_write_keeps_the_previous_checkpoint_and_resumes_bitwise(tmp_path):
    """SIGKILL (the fault seam, in the writing thread) after Accelerate's files of step 8 are written, before its
    manifest: step 4's checkpoint stays the latest, the partial one is never taken, and the resume from step 4
    ends bitwise where the uninterrupted run does."""
    out = tmp_path / "killed"
    argv = [sys.executable, str(SCRIPTS / "toy_train.py"), "--output_dir", str(out), *QUIET, *SAVES, "--async_save"]
    env = {**subprocess_env(), "ACCEL_TRAIN_FAULT": "kill_during_save:8"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert [p.name for p in list_checkpoints(out)] == ["step-00000004"]
    partial = out / "checkpoints" / ".tmp-step-00000008"
    assert (partial / "model.safetensors").is_file() and not (partial / "manifest.json").exists()
    toy(out, *SAVES, "--async_save", "--resume_from_checkpoint", "latest")
    toy(tmp_path / "whole", *SAVES)
    assert same_tensors(load_file(out / "model.safetensors"), load_file(tmp_path / "whole" / "model.safetensors"))
    assert not partial.exists(), "the partial write is removed by the next rotation"


def full_disk_at(monkeypatch, step: int) -> None:
    """The background write of checkpoint `step` fails as a full disk does (in Accelerate's writer)."""
    import accelerate.checkpointing as writer

    real = writer.save_accelerator_state

    def full_disk(output_dir, *args, **kwargs):
        if args[4] == "background" and output_dir.endswith(f"step-{step:08d}"):
            raise OSError(28, "No space left on device")
        return real(output_dir, *args, **kwargs)

    monkeypatch.setattr(writer, "save_accelerator_state", full_disk)


def test_a_failed_background_write_is_an_error_at_the_next_save_and_loses_nothing(tmp_path, monkeypatch, capsys):
    full_disk_at(monkeypatch, 8)
    with pytest.raises(SystemExit) as exit_info:
        toy(tmp_path / "run", *SAVES, "--async_save")
    assert exit_info.value.code != 0
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step-00000004"]
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))
    err = capsys.readouterr().err
    assert "could not write checkpoint" in err and "(in the background, --async_save)" in err, err[-3000:]
    assert "No space left on device" in err and "step-00000008" in err


def test_the_best_checkpoint_survives_a_failed_background_write_of_a_new_best(tmp_path, monkeypatch, capsys):
    """--save_total_limit 1 with a best model: step 6 is a new best while step 4's write is still to land. The
    rotation when step 4 lands keeps step 2, the best the run and step 4 name, until step 6 has landed; step 6's
    write fails, so step 4 stays `latest` and the best it names is still there (before, the best was marked step 6
    first and step 2 was deleted for it: a resume found its best gone)."""
    full_disk_at(monkeypatch, 6)
    with pytest.raises(Exception, match="could not write checkpoint"):  # noqa: PT011 - the project's CheckpointError
        points_run(tmp_path, [0.9, 0.5, 0.95, 0.4, 0.3, 0.2], async_save=True, save_total_limit=1)
    latest = list_checkpoints(tmp_path)[-1]
    state = json.loads((latest / "train_state.json").read_text())
    assert latest.name == "step-00000004" and state["best_checkpoint"] == "step-00000002"
    assert (tmp_path / "checkpoints" / "step-00000002" / "manifest.json").is_file()
    # a best deleted by hand: the resume says so and tracks the best afresh, and the run ends on its own best
    import shutil

    monkeypatch.undo()
    shutil.rmtree(tmp_path / "checkpoints" / "step-00000002")
    result = points_run(tmp_path, [0.7, 0.6, 0.5, 0.4], async_save=True, save_total_limit=1,
                        resume_from_checkpoint="latest")
    assert "best model (step-00000002) is no longer in" in capsys.readouterr().out
    assert result.state.best_checkpoint == "step-00000006" and result.state.best_metric == 0.7


def test_an_error_after_a_background_save_leaves_that_checkpoint_written(tmp_path, slow_disk, monkeypatch):
    """An error while step 4's checkpoint is still being written (a slow disk): train() raised at once and the write
    went on in a thread nobody waited for (a launcher's SIGTERM to the rest of a failed job killed it half written,
    and a failure of it was never said). Now the error waits for it: step 4 is on disk when the error arrives."""
    from torch.utils.data import DataLoader, TensorDataset

    from accel_train import TrainConfig, train

    calls = []

    def loss_fn(model, batch):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("a bad batch")
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    reset_accelerate()
    x = torch.randn(32, 2)
    config = TrainConfig(output_dir=str(tmp_path / "run"), report_to=["none"], disable_tqdm=True, run_report=False,
                         per_device_train_batch_size=4, max_steps=8, save_strategy="steps", save_steps=4,
                         async_save=True, eval_strategy="no")
    with pytest.raises(RuntimeError, match="a bad batch"):
        train(torch.nn.Linear(2, 1), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4),
              config=config, loss_fn=loss_fn)
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step-00000004"]
    verify_checkpoint(list_checkpoints(tmp_path / "run")[0])
    # where that write fails, the error says so (it was dropped)
    full_disk_at(monkeypatch, 4)
    calls.clear()
    reset_accelerate()
    config = dataclasses.replace(config, output_dir=str(tmp_path / "full"))
    with pytest.raises(RuntimeError, match="a bad batch") as raised:
        train(torch.nn.Linear(2, 1), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4),
              config=config, loss_fn=loss_fn)
    notes = "".join(raised.value.__notes__)
    assert "step-00000004, written in the background (--async_save), was not written: [Errno 28] No space" in notes
    assert not any("saved first" in note for note in raised.value.__notes__)  # it was not
    assert not list_checkpoints(tmp_path / "full")


def test_a_pre_hook_registered_as_a_hook_attaches_is_refused_too(tmp_path):
    """Hooks attach after the writer is built: a save_state pre-hook registered there went unseen, and the background
    writer never ran it (its checkpoints differed from synchronous ones without a word)."""
    from torch.utils.data import DataLoader, TensorDataset

    from accel_train import TrainConfig, train

    class Registers:
        def attach(self, run):
            run.accelerator.register_save_state_pre_hook(lambda models, weights, folder: None)

    reset_accelerate()
    x = torch.randn(8, 2)
    config = TrainConfig(output_dir=str(tmp_path / "run"), report_to=["none"], disable_tqdm=True, run_report=False,
                         per_device_train_batch_size=4, max_steps=2, save_strategy="steps", save_steps=1,
                         async_save=True)
    with pytest.raises(ConfigError, match="pre-hook"):
        train(torch.nn.Linear(2, 1), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4),
              config=config, loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), hooks=[Registers()])
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_sharded_engines_save_on_each_node_and_pre_hooks_are_refused_with_the_reason():
    for engine in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        fake = SimpleNamespace(distributed_type=engine, project_configuration=SimpleNamespace(save_on_each_node=False))
        with pytest.raises(ConfigError, match=f"--async_save under {engine.value}: the engine writes its sharded"):
            refuse_async(fake)
    fake = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU,
                           project_configuration=SimpleNamespace(save_on_each_node=True))
    with pytest.raises(ConfigError, match="save_on_each_node"):
        refuse_async(fake)
    fake.project_configuration.save_on_each_node, fake._save_model_state_pre_hook = False, {0: print}
    with pytest.raises(ConfigError, match="pre-hook"):  # it would run on the copies, later
        refuse_async(fake)


@dataclasses.dataclass
class Step:
    step: int


@dataclasses.dataclass
class Unwritable:
    step: int
    hooks: set  # a hook's state JSON cannot hold


def write_over_a_blocked_path(out: str, asynchronous: bool) -> None:
    """[on each rank] Checkpoint step 1 and then step 2 of a one-layer model into `out`, where the parent put a
    file at the checkpoints folder's path (step 1) and at step 2's (step 2): the main process cannot make the
    folder, nor rename the written checkpoint into place; then step 3 with a state JSON cannot hold."""
    from pathlib import Path

    from accelerate import Accelerator

    from accel_train.errors import CheckpointError
    from accel_train.rundir.async_checkpoint import CheckpointWriter

    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 2))
    writer = CheckpointWriter(accelerator, asynchronous)
    state = Step(1)
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*step-00000001: .*untouched"):
        writer.write(out, 1, state, {})
        writer.settle()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:  # the folder can be made now; step 2's place is taken by a file
        Path(out, "checkpoints").unlink()
        Path(out, "checkpoints").mkdir()
        Path(out, "checkpoints", "step-00000002").write_text("")
    accelerator.wait_for_everyone()
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*step-00000002"):
        writer.write(out, 2, state, {})
        writer.settle()
    # a training state JSON cannot hold: the main process raised a bare TypeError alone in the background path
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*step-00000003"):
        writer.write(out, 3, Unwritable(3, {1}), {})
        writer.settle()
    if not asynchronous and accelerator.is_main_process:  # a full disk as torch.save reports it: not an OSError
        def full(*args, **kwargs):
            raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file")

        accelerator.save_state = full
    if not asynchronous:  # the main process raised it alone, the other waited at the barrier for ever
        with pytest.raises(CheckpointError, match=r"could not write checkpoint .*step-00000004"):
            writer.write(out, 4, state, {})


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_folder_the_main_process_cannot_make_is_an_error_on_every_process(tmp_path, ranks, asynchronous):
    # before: the main process raised a bare OSError while the other waited at the barrier for ever (a hang)
    (tmp_path / "checkpoints").write_text("")
    ranks.run(write_over_a_blocked_path, str(tmp_path), asynchronous, timeout=120)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
