"""Across processes: 2 processes x B against 1 x 2B through the real `accelerate launch` (2 gloo processes on CPU);
resume, early stopping and bf16 on the session's 2 spawned gloo ranks, and every 1-process side in this process
(`main(argv)`): the launcher is not what they test.

5b  2 processes x batch B == 1 process x batch 2B: parameters, learning rate at every step, gathered evaluation.
5c  stop at step K, resume with latest (a new run of main() in the same process or on the same pooled ranks: a
    fresh process is the kill tests' subject), continue to 2K == uninterrupted 2K, bitwise, with 1 and 2 processes.
5d  early stopping stops every rank at the same step; the best checkpoint is kept and restorable.
"""

import json

import pytest
import torch
from conftest import SCRIPTS, launch, read_jsonl, toy_on, toy_records
from safetensors.torch import load_file

from accel_train.rundir.checkpoint import list_checkpoints

TOY = SCRIPTS / "toy_train.py"
QUIET = ["--report_to", "none", "--disable_tqdm"]
pytestmark = pytest.mark.slow




def max_diff(a, b):
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def history(out, key):
    return [(r["step"], r[key]) for r in read_jsonl(out / "metrics.jsonl") if key in r]


def test_two_processes_equal_one_process_with_twice_the_batch(tmp_path, ranks):
    common = ["--num_train_epochs", "3", "--gradient_accumulation_steps", "2", "--learning_rate", "0.05",
              "--warmup_steps", "0.2", "--logging_steps", "1", "--eval_strategy", "steps", "--eval_steps", "4",
              "--per_device_eval_batch_size", "4", "--save_strategy", "no", *QUIET]
    toy_on(ranks, [*common, "--per_device_train_batch_size", "8", "--output_dir", str(tmp_path / "one")])
    launch(TOY, [*common, "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / "two"),
                 "--expected_world_size", "2"], 2)
    one, two = tmp_path / "one", tmp_path / "two"
    assert max_diff(load_file(one / "model.safetensors"), load_file(two / "model.safetensors")) < 1e-6
    lr_one, lr_two = history(one, "learning_rate"), history(two, "learning_rate")
    assert len(lr_one) == 18 and lr_one == lr_two  # identical schedule, stepped once per optimizer step
    loss_one, loss_two = history(one, "loss"), history(two, "loss")
    assert [s for s, _ in loss_one] == [s for s, _ in loss_two]
    assert max(abs(a - b) for (_, a), (_, b) in zip(loss_one, loss_two, strict=True)) < 1e-5
    res_one = json.loads((one / "all_results.json").read_text())
    res_two = json.loads((two / "all_results.json").read_text())
    assert res_one["eval_samples"] == res_two["eval_samples"] == 37  # gathered exactly once per sample
    assert res_one["eval_accuracy"] == res_two["eval_accuracy"]
    assert res_one["eval_loss"] == pytest.approx(res_two["eval_loss"], abs=1e-6)
    # the two ranks saw disjoint halves of every global batch, which together are the 1-process batches
    ranks = toy_records(two)
    merged = [a + b for a, b in zip(ranks[0][0]["indices"], ranks[1][0]["indices"], strict=True)]
    assert [sorted(b) for b in merged] == [sorted(b) for b in toy_records(one)[0][0]["indices"]]


@pytest.mark.parametrize("num_processes", [1, 2])
def test_resume_mid_epoch_is_exact(tmp_path, num_processes, ranks):
    bs = str(8 // num_processes)
    common = ["--num_train_epochs", "3", "--per_device_train_batch_size", bs, "--gradient_accumulation_steps", "2",
              "--dropout", "0.3", "--learning_rate", "0.05", "--warmup_steps", "0.2", "--logging_steps", "1",
              "--save_strategy", "steps", "--save_steps", "5", "--eval_strategy", "steps", "--eval_steps", "4", *QUIET]
    full, cut = tmp_path / "full", tmp_path / "cut"
    toy_on(ranks, [*common, "--output_dir", str(full)], num_processes)
    toy_on(ranks, [*common, "--output_dir", str(cut), "--stop_at_step", "7"], num_processes)  # mid-epoch 2
    toy_on(ranks, [*common, "--output_dir", str(cut), "--resume_from_checkpoint", "latest"], num_processes)
    state = json.loads((list_checkpoints(cut)[-1] / "train_state.json").read_text())
    assert state["step"] == 18 and [r["step"] for r in toy_records(cut)[0]] == [7, 18]  # resumed at 7

    assert max_diff(load_file(full / "model.safetensors"), load_file(cut / "model.safetensors")) == 0.0
    last_full, last_cut = list_checkpoints(full)[-1], list_checkpoints(cut)[-1]
    assert last_full.name == last_cut.name == "step-00000018"
    for name in ("optimizer.bin", "scheduler.bin"):
        a = torch.load(last_full / name, weights_only=True)
        b = torch.load(last_cut / name, weights_only=True)
        assert repr(a) == repr(b), name
    # same losses and learning rates at every step; same samples in the same order on every rank
    assert history(full, "loss") == history(cut, "loss")
    assert history(full, "learning_rate") == history(cut, "learning_rate")
    for rank in range(num_processes):
        uninterrupted = toy_records(full)[rank][0]["indices"]
        first, resumed = toy_records(cut)[rank]
        assert len(first["indices"]) == 7 * 2 and first["step"] == 7
        assert first["indices"] + resumed["indices"] == uninterrupted


def test_early_stopping_stops_all_ranks_together_and_keeps_the_best(tmp_path, ranks):
    out = tmp_path / "es"
    # A large SGD step makes the evaluation loss bounce, so patience runs out well before the 120 steps.
    toy_on(ranks, ["--output_dir", str(out), "--optim", "sgd", "--learning_rate", "3.0", "--max_grad_norm", "0",
                 "--per_device_train_batch_size", "4", "--max_steps", "120", "--eval_strategy", "steps",
                 "--eval_steps", "2", "--early_stopping_patience", "2", "--save_strategy", "steps",
                 "--save_steps", "1000", "--save_total_limit", "1", "--load_best_model_at_end", *QUIET], 2)
    evals = history(out, "eval_loss")
    best, bad, expected_stop = None, 0, None
    for step, value in evals:  # the documented rule, replayed on the recorded evaluations
        if best is None or value < best[1]:
            best, bad = (step, value), 0
        else:
            bad += 1
        if bad >= 2:
            expected_stop = step
            break
    assert expected_stop is not None and expected_stop < 120
    ranks = toy_records(out)
    assert ranks[0][0]["step"] == ranks[1][0]["step"] == expected_stop
    kept = {p.name for p in list_checkpoints(out)}
    assert f"step-{best[0]:08d}" in kept  # the best survives keep-last-1
    results = json.loads((out / "all_results.json").read_text())
    assert results["eval_loss"] == pytest.approx(best[1], abs=1e-7)  # the restored best model, re-evaluated


@pytest.mark.slow
def test_bf16_two_processes_equal_one_process_within_bf16_rounding(tmp_path, ranks):
    """bf16 autocast (what --mixed_precision auto picks on a CPU with native bf16): the matmuls of 4 and of 8 rows
    round differently, so the two runs agree to bf16 rounding, not bitwise; the schedule and the samples are the
    same. Measured: the final weights 3.3e-3 apart at most after 36 steps (bf16 keeps 8 bits of mantissa, a relative
    4e-3); asserted below 1e-2. In fp32 the same comparison is below 1e-6 (the test above)."""
    common = ["--num_train_epochs", "3", "--learning_rate", "0.05", "--logging_steps", "1", "--eval_strategy", "no",
              "--save_strategy", "no", "--mixed_precision", "bf16", *QUIET]
    toy_on(ranks, [*common, "--per_device_train_batch_size", "8", "--output_dir", str(tmp_path / "one")])
    toy_on(ranks, [*common, "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / "two")], 2)
    one, two = tmp_path / "one", tmp_path / "two"
    difference = max_diff(load_file(one / "model.safetensors"), load_file(two / "model.safetensors"))
    print(f"bf16 1 vs 2 processes: max |weight difference| {difference:.2e}")
    assert difference < 1e-2
    assert history(one, "learning_rate") == history(two, "learning_rate")
    losses = [[loss for _, loss in history(out, "loss")] for out in (one, two)]
    assert max(abs(a - b) for a, b in zip(*losses, strict=True)) < 1e-2
