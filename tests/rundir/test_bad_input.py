"""Bad input to the core and above all to the run directory (output_dir, checkpoints, resume): a message naming
what and where and what to do, exit status 2, nothing lost."""

import pytest
import toy_train
from conftest import SCRIPTS, launch, reset_accelerate

from accel_train import run_cli
from accel_train.rundir.checkpoint import list_checkpoints

QUIET = ["--report_to", "none", "--disable_tqdm", "--num_train_epochs", "1"]


def fails(capsys, argv, *fragments):
    reset_accelerate()
    with pytest.raises(SystemExit) as exit_info:
        run_cli(toy_train.main, argv)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in message, message
    assert "Traceback" not in message
    return message


def ok(argv):
    reset_accelerate()
    run_cli(toy_train.main, argv)


def test_config_errors(tmp_path, capsys):
    out = ["--output_dir", str(tmp_path / "r")]
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rate: 0.1\nwarmup_stepz: 3\n")
    fails(capsys, [*out, "--config", str(bad)], "bad.yaml: unknown key 'warmup_stepz'", "warmup_steps")
    fails(capsys, [*out, "--learning_rate", "high"], "--learning_rate", "invalid float value: 'high'")
    fails(capsys, [*out, "--per_device_train_batch_size", "0"], "per_device_train_batch_size=0", ">= 1")
    fails(capsys, [*out, *QUIET, "--warmup_steps", "500"], "warmup (500 steps) is longer than training")
    fails(capsys, [*out, *QUIET, "--expected_world_size", "2"], "2 processes were requested", "1 joined")
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_empty_loaders(tmp_path, capsys):
    fails(capsys, ["--output_dir", str(tmp_path / "b"), *QUIET, "--num_samples", "5", "--per_device_train_batch_size",
                   "8", "--dataloader_drop_last"], "fewer samples than per_device_train_batch_size (8)",
          "--dataloader_drop_last")


def test_output_dir_with_another_run_is_refused_and_untouched(tmp_path, capsys):
    out = tmp_path / "run"
    ok(["--output_dir", str(out), *QUIET])
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    fails(capsys, ["--output_dir", str(out), *QUIET, "--learning_rate", "0.3"], "already holds a run",
          "--resume_from_checkpoint latest", "--overwrite_output_dir")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    ok(["--output_dir", str(out), *QUIET, "--learning_rate", "0.3", "--overwrite_output_dir"])
    assert "learning_rate: 0.3" in (out / "config.yaml").read_text()


def test_overwrite_output_dir_leaves_nothing_of_the_replaced_run(tmp_path, capsys):
    out = tmp_path / "run"
    ok(["--output_dir", str(out), *QUIET])
    left_by_others = ("predictions.jsonl", "predict_results.jsonl", "model_factory.json",
                      "export/torchscript/model.pt", "adapter/x.json", "report.md")
    for name in left_by_others:
        (out / name).parent.mkdir(parents=True, exist_ok=True)  # what other recipes and exports leave there
        (out / name).write_text("{}")
    assert (out / "model.safetensors").is_file() and (out / "all_results.json").is_file()
    poisoned = ["--output_dir", str(out), *QUIET, "--overwrite_output_dir", "--poison_index", "0",
                "--per_device_train_batch_size", "96"]
    # refused by the pre-flight (the loss is nan on the first batch) before anything is replaced: the old run stays
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    fails(capsys, poisoned, "the pre-flight check refused to start this run", "returned nan on the first training")
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    # a replacing run that starts and stops before it writes a model: nothing of the old run may pass for its output
    fails(capsys, [*poisoned, "--no_preflight"], "non-finite")
    left = sorted(p.name for p in out.iterdir())
    assert not {"model.safetensors", "export", "adapter", "predictions.jsonl", "predict_results.jsonl",
                "model_factory.json", "all_results.json", "report.md"} & set(left), left


def test_unwritable_output_dir(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    fails(capsys, ["--output_dir", str(blocker / "run"), *QUIET], f"--output_dir {blocker / 'run'}", "not writable")


def test_resume_errors(tmp_path, capsys):
    out = tmp_path / "run"
    fails(capsys, ["--output_dir", str(out), *QUIET, "--resume_from_checkpoint", "latest"], "no complete checkpoint")
    fails(capsys, ["--output_dir", str(out), *QUIET, "--resume_from_checkpoint", str(tmp_path / "nope")],
          "no such directory")
    ok(["--output_dir", str(out), *QUIET, "--save_strategy", "steps", "--save_steps", "4"])
    fails(capsys, ["--output_dir", str(out), *QUIET, "--resume_from_checkpoint", "latest", "--hidden", "16"],
          "written by a different model", "0.bias: checkpoint [32] vs model [16]")
    fails(capsys, ["--output_dir", str(out), *QUIET, "--resume_from_checkpoint", "latest",
                   "--per_device_train_batch_size", "4"], "global batch of 8", "this run has 4")
    incomplete = out / "checkpoints" / "step-00000099"
    incomplete.mkdir()
    fails(capsys, ["--output_dir", str(out), *QUIET, "--resume_from_checkpoint", str(incomplete)], "not a complete")


def test_tampered_checkpoint_is_detected_and_latest_falls_back(tmp_path, capsys):
    out = tmp_path / "run"
    ok(["--output_dir", str(out), *QUIET, "--save_strategy", "steps", "--save_steps", "4"])
    newest, previous = list_checkpoints(out)[-1], list_checkpoints(out)[-2]
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])  # truncated
    fails(capsys, ["--output_dir", str(out), *QUIET, "--resume_from_checkpoint", str(newest)],
          "model.safetensors does not match its manifest")
    reset_accelerate()
    run_cli(toy_train.main, ["--output_dir", str(out), *QUIET, "--resume_from_checkpoint", "latest",
                             "--num_train_epochs", "2"])
    assert f"resumed from {previous}" in capsys.readouterr().out


@pytest.mark.slow
def test_cpu_launch_that_runs_fewer_processes_than_asked_fails_loudly(tmp_path):
    # `accelerate launch --cpu --num_processes 2` starts ONE process: the run must say so and stop.
    proc = launch(SCRIPTS / "toy_train.py", ["--output_dir", str(tmp_path), *QUIET], 1, check=False,
                  launcher_args=["--cpu", "--num_processes", "2"])
    assert proc.returncode != 0  # the script exits 2; `accelerate launch` reports that as its own failure
    assert "2 processes were requested (the `accelerate launch` command line) but 1 joined" in proc.stderr
