"""Jobs that are restarted: `--resume_from_checkpoint auto` (one command for the first start and every restart),
torchrun's elastic agent restarting workers killed at random steps, and a hung peer turned into an error."""

from __future__ import annotations

import datetime
import json
import os
import re

import pytest
import torch
from conftest import SCRIPTS, free_port, launch, run_toy, subprocess_env
from safetensors.torch import load_file

from accel_train import TrainConfig
from accel_train.core.accelerator import build_accelerator
from accel_train.core.session import Session
from accel_train.rundir.checkpoint import list_checkpoints

QUIET = ["--report_to", "none", "--disable_tqdm"]
AUTO = [*QUIET, "--save_strategy", "steps", "--save_steps", "4", "--resume_from_checkpoint", "auto"]


def same_weights(a, b) -> bool:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_auto_is_a_first_start_then_a_resume_and_refuses_another_runs_directory(tmp_path, capsys):
    full, cut = tmp_path / "full", tmp_path / "cut"
    first = run_toy(capsys, ["--output_dir", str(full), *AUTO])  # nothing there: a first start, no error
    assert "resumed from" not in first.out
    command = ["--output_dir", str(cut), *AUTO, "--logging_steps", "4", "--stop_at_step", "8"]
    run_toy(capsys, command)  # asks to stop at step 8 (a clean interruption, as a preempted job)
    assert list_checkpoints(cut)[-1].name == "step-00000008"
    again = run_toy(capsys, command)  # the same command: resumes at 8 (and never meets step 8 again)
    assert "at step 8" in again.out and same_weights(full, cut)
    changed = run_toy(capsys, [*command, "--learning_rate", "0.5"], code=2)
    assert "holds a run with another config (learning_rate:" in changed.err
    assert "--resume_from_checkpoint latest" in changed.err


def test_auto_starts_afresh_over_an_attempt_that_saved_no_checkpoint(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    argv = ["--output_dir", str(out), *QUIET, "--save_strategy", "no", "--resume_from_checkpoint", "auto"]
    with monkeypatch.context() as patch:  # the first attempt trains, then dies before it finishes (a lost node)
        patch.setattr(Session, "finish", lost_node)
        with pytest.raises(RuntimeError, match="lost node"):
            run_toy(capsys, argv)
    history = (out / "metrics.jsonl").read_text()
    run_toy(capsys, argv)  # no checkpoint: the same job from the start, its old records replaced, not mixed
    assert (out / "metrics.jsonl").read_text().count('"step": 1,') == history.count('"step": 1,')


def lost_node(*args, **kwargs):
    raise RuntimeError("lost node")


def test_auto_never_starts_afresh_over_checkpoints_that_fail_to_verify(tmp_path, capsys):
    out = tmp_path / "run"
    run_toy(capsys, ["--output_dir", str(out), *AUTO, "--logging_steps", "4", "--stop_at_step", "4"])
    for weights in (out / "checkpoints").glob("step-*/model.safetensors"):
        weights.write_bytes(b"truncated")
    io = run_toy(capsys, ["--output_dir", str(out), *AUTO, "--logging_steps", "4", "--stop_at_step", "4"], code=2)
    assert "verifies against its manifest" in io.err


def join_restarted_beside_another_attempts_keys(store_port: int, output_dir: str) -> None:
    """On each of the session's 2 ranks: the group joined as workers that torchelastic restarted on a membership
    change, where the nodes' restart counts differ (the agent of a node that joined later counts 0, the others 1) and
    the agent's store, which every round of the job shares (hosted here by rank 0, as the leader agent would), holds
    an earlier attempt's keys."""
    rank = int(os.environ["RANK"])
    os.environ.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT=str(1 - rank),
                      TORCHELASTIC_RUN_ID="job", MASTER_PORT=str(store_port))
    agent = None
    if rank == 0:
        agent = torch.distributed.TCPStore("127.0.0.1", store_port, 2, is_master=True, wait_for_workers=False)
        stale = "0" * 32  # an earlier attempt's rank 1 said hello and was answered; this attempt must not read it
        agent.set("accel_train/hello/1", stale)
        agent.set(f"accel_train/ack/{stale}", "f" * 32)
        agent.set("test/earlier_attempt_over", "1")
    else:  # an earlier attempt's keys are written before this attempt starts, never while it says hello
        torch.distributed.TCPStore("127.0.0.1", store_port, 2, is_master=False,
                                   timeout=datetime.timedelta(seconds=60)).get("test/earlier_attempt_over")
    accelerator = build_accelerator(TrainConfig(output_dir=output_dir, report_to=["none"], ddp_timeout=20))
    total = torch.tensor([rank + 1.0])
    torch.distributed.all_reduce(total)
    assert accelerator.num_processes == 2 and total.item() == 3.0
    torch.distributed.barrier()  # the agent's store (rank 0) outlives rank 1's use of it
    del agent


def test_restarted_workers_whose_restart_counts_differ_join_one_group(ranks, tmp_path):
    """Before: each rank keyed its group by its own node's restart count, so the two never met (20 s timeout)."""
    ranks.run(join_restarted_beside_another_attempts_keys, free_port(), str(tmp_path / "run"), timeout=120)


@pytest.mark.slow
def test_three_random_worker_kills_under_the_elastic_agent_end_with_bitwise_the_same_weights(tmp_path):
    args = [*QUIET, "--save_strategy", "steps", "--save_steps", "3", "--num_train_epochs", "6",
            "--resume_from_checkpoint", "auto", "--ddp_timeout", "60"]
    launch(SCRIPTS / "toy_train.py", [*args, "--output_dir", str(tmp_path / "full")], num_processes=2)
    kills = tmp_path / "kills.txt"
    env = subprocess_env(ACCELERATE_USE_CPU="1", ACCEL_TRAIN_FAULT="elastic_kill:7:3:6",
                         ACCEL_TRAIN_FAULT_LOG=str(kills))
    proc = launch(SCRIPTS / "toy_train.py", [*args, "--output_dir", str(tmp_path / "cut")], num_processes=2,
                  launcher_args=["--max_restarts", "3", "--monitor_interval", "0.5"], env=env)
    records = [tuple(map(int, line.split())) for line in kills.read_text().splitlines()]
    # three kills, one in each of the first three attempts: a restarted attempt joins its gloo group at once (before
    # accel_train keyed each attempt's group apart, about half the restarts read a dead rank's address)
    assert [r[0] for r in records] == [0, 1, 2]
    # the attempt after each kill started from the newest checkpoint before the kill (a later kill's record says
    # where its attempt started; the last attempt's start is in its log)
    starts = [r[3] for r in records[1:]] + [int(re.findall(r"resumed from \S+ at step (\d+)",
                                                           proc.stdout + proc.stderr)[-1])]
    lost = [killed_at - start for (_, _, killed_at, _), start in zip(records, starts, strict=True)]
    assert all(0 < steps <= 3 for steps in lost), lost  # at most the save interval per failure
    assert same_weights(tmp_path / "full", tmp_path / "cut")
    assert len(re.findall(r"failed \(exitcode", proc.stdout + proc.stderr)) == 3  # no other failure
    print(f"kills (restart count, rank, step): {[r[:3] for r in records]}; steps lost per failure: {lost}")


@pytest.mark.slow
def test_a_hung_peer_is_an_error_naming_it_within_the_timeout(tmp_path):
    out = tmp_path / "run"
    env = subprocess_env(ACCELERATE_USE_CPU="1", ACCEL_TRAIN_FAULT="hang_after_step:3@1")
    proc = launch(SCRIPTS / "toy_train.py", ["--output_dir", str(out), *QUIET, "--ddp_timeout", "15",
                                             "--logging_steps", "1"], num_processes=2, check=False, env=env,
                  timeout=300)
    assert proc.returncode != 0
    assert "rank 0 waited --ddp_timeout 15 s in a collective after step 3" in proc.stderr
    assert "rank(s) 1 never arrived and recorded no error" in proc.stderr
    assert json.loads((out / "crash_rank0.json").read_text())["step"] == 3
