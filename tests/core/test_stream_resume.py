"""A stream (a `datasets` IterableDataset read from parquet files, with loader workers) resumes at the position its
checkpoint saved: the same batches as an uninterrupted run, bitwise the same final weights, on 1 and 2 processes,
without re-reading what it had consumed: cut with --stop_at_step at a checkpoint and resumed with latest in this
process (1 process), or launched and SIGKILLed (2 processes, whose loaders fork their workers). A shuffled stream (a
buffer whose content no position holds) resumes by re-reading, bitwise: tests/core/test_matrix.py ("shuffled stream",
cut by SIGTERM, 2 loader workers)."""

from __future__ import annotations

import pytest
import toy_train
from conftest import kill_then_resume, run_toy, stop_then_resume, toy_main, toy_process, toy_records
from safetensors.torch import load_file

# logging every step: --stop_at_step can cut at any step
QUIET = ["--report_to", "none", "--disable_tqdm", "--run_report", "false", "--eval_strategy", "no",
         "--logging_steps", "1"]


def stream_flags(data, *more):
    # 96 points in 8 shards of 12, batches of 4: 24 batches an epoch on 1 process, 12 on each of 2; 30 steps
    # cross an epoch's end, and a shard-order shuffle gives the second epoch another order
    return [*QUIET, "--stream_dir", str(data), "--max_steps", "30", "--per_device_train_batch_size", "4",
            "--save_strategy", "steps", "--save_steps", "4", "--learning_rate", "0.05", *more]


def compare(full, cut, step):
    """Bitwise equal final weights, and the resumed attempt consumed exactly the uninterrupted run's batches
    after `step` (the checkpoint it resumed from), on every rank."""
    a, b = load_file(full / "model.safetensors"), load_file(cut / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0, "the final weights differ after the resume"
    whole, parts = toy_records(full), toy_records(cut)
    assert set(whole) == set(parts)
    for rank, records in parts.items():
        assert records[-1]["indices"] == whole[rank][0]["indices"][step:], f"rank {rank} saw other batches"


# datasets reorders a stream's shards at every epoch by itself (set_epoch); .shuffle(buffer_size=1) on top of it is
# checked without workers only: datasets 5 wraps a shuffled stream into one of up to 10 sources, which leaves loader
# workers without shards (huggingface/datasets#8669) and cannot load a worker's state back
# (workers, shuffle, cut at step): without workers, inside the first epoch (a saved position restored); with 2
# workers, at the start of the second (24 batches an epoch: the new epoch's shard order must come back, not the first
# epoch's); the 2-process test below restores 2 workers' positions inside an epoch. The workers read ahead of the
# batches trained: the position saved is that of the batches trained.
@pytest.mark.parametrize("workers,shuffle,cut,step", [(0, "1", 10, 8), (2, "-1", 27, 24)])
def test_a_stream_resumes_where_its_checkpoint_was_with_bitwise_the_same_weights(tmp_path, workers, shuffle, cut, step):
    """Cut after step `cut` and resumed from the checkpoint at `step`, as after a SIGKILL: the batches between are
    read and trained again, from the position the checkpoint saved, not the one the cut run's loader reached."""
    data = tmp_path / "data"
    toy_train.write_stream_shards(data, 96, 8)
    flags = stream_flags(data, "--dataloader_num_workers", str(workers), "--stream_shuffle", shuffle)
    stop_then_resume(lambda out, *more: toy_main(["--output_dir", str(out), *flags, *more]), tmp_path / "full",
                     tmp_path / "cut", cut, step)
    compare(tmp_path / "full", tmp_path / "cut", step)
    assert (tmp_path / "cut" / "checkpoints" / f"step-{step:08d}" / "stream_position_rank0.pt").is_file()


@pytest.mark.slow
def test_a_stream_resumes_bitwise_on_two_processes_each_at_its_own_position(tmp_path, capsys):
    """Launched, SIGKILLed and resumed: 2 processes whose loaders fork 2 workers each, as a user's launch does (a
    pooled rank is a spawned daemonic process: forking workers there is not what a user runs)."""
    data = tmp_path / "data"
    toy_train.write_stream_shards(data, 96, 8)
    flags = stream_flags(data, "--dataloader_num_workers", "2")

    def toy(out, *more, fault=None, processes=2):
        return toy_process(["--output_dir", str(out), *flags, *more], fault=fault, processes=processes)

    # 12 batches an epoch on each process: step 18 is inside the second epoch, its newest checkpoint step 16
    kill_then_resume(toy, tmp_path / "full", tmp_path / "cut", 18, "step-00000016", processes=2)
    compare(tmp_path / "full", tmp_path / "cut", 16)
    checkpoint = tmp_path / "cut" / "checkpoints" / "step-00000016"
    saved = sorted(p.name for p in checkpoint.glob("stream_position_*"))
    assert saved == ["stream_position_rank0.pt", "stream_position_rank1.pt"]
    # the same global batch on 1 process
    resumed_on_one = run_toy(capsys, ["--output_dir", str(tmp_path / "cut"), *flags, "--per_device_train_batch_size",
                                      "8", "--resume_from_checkpoint", str(checkpoint)], code=2)
    assert "stream positions of 2 process(es), this run has 1" in resumed_on_one.err


def test_a_stream_position_for_another_number_of_processes_is_refused_by_every_process(tmp_path):
    """A checkpoint of 1 process resumed on 2: the process with a position file of its own raised, the other (none
    of its own) went on alone into its next collective and waited there for ever. Each process now counts them."""
    import torch

    from accel_train.core.stream import StreamPosition
    from accel_train.errors import CheckpointError

    torch.save({}, tmp_path / "stream_position_rank0.pt")
    for rank in (0, 1):
        position = StreamPosition.__new__(StreamPosition)
        position.process_index = rank
        with pytest.raises(CheckpointError, match="stream positions of 1 process"):
            position.restore(tmp_path, 2, batch_in_epoch=3)
    assert StreamPosition.__new__(StreamPosition).restore(tmp_path, 2, batch_in_epoch=0) is False  # an epoch's start


def test_a_run_that_ends_mid_epoch_ends_its_loader_workers_with_it(tmp_path):
    """30 steps end inside the second epoch: the stateful loader still holds its iterator, and the 2 workers would
    live on until the garbage collector reached it (whose shutdown waits 5 s per worker); they end with the run."""
    import psutil

    data = tmp_path / "data"
    toy_train.write_stream_shards(data, 96, 8)
    before = {p.pid for p in psutil.Process().children()}
    toy_main(["--output_dir", str(tmp_path / "run"), *stream_flags(data, "--dataloader_num_workers", "2")])
    left = [p for p in psutil.Process().children() if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE]
    assert left == [], f"loader workers outlived the run: {left}"
