"""How long a stream takes to resume, by the position it resumes at: accel_train's saved loader position against
re-reading up to it (Accelerate's skip_first_batches, what accel_train did before).

A `datasets` stream of parquet files (20 shards of 60,000 rows) is read by train() with a tiny model, 1,000 rows a
batch, up to P consumed rows, and checkpointed there. Then, for each P:
  - resume: train() resumed from that checkpoint for one more step; the time from on_train_start to the first
    batch reaching the loss (the loader's position loaded from the checkpoint, workers started, one batch read);
  - re-read: the same stream through a prepared loader and `accelerator.skip_first_batches(loader, P / 1000)`,
    timed to its first batch.
The resumed run's first batch is checked to be the row after P.

    python benchmarks/stream_resume.py                       # P = 10^4 and 10^6 (the re-read at 10^6 takes minutes)
    python benchmarks/stream_resume.py --positions 10000 --workers 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from accel_train import TrainConfig, build_accelerator, train  # noqa: E402

SHARDS, ROWS, BATCH = 20, 60_000, 1000


def write_shards(folder: Path) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    for shard in range(SHARDS):
        index = np.arange(shard * ROWS, (shard + 1) * ROWS)
        x = np.random.default_rng(shard).standard_normal(ROWS).astype("float32")
        pq.write_table(pa.table({"index": index, "x": x}), folder / f"part-{shard:03d}.parquet", row_group_size=5000)
    return sorted(str(p) for p in folder.glob("*.parquet"))


def reset_accelerate_state() -> None:  # several Accelerators in one process, one after another
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def stream(files):
    return datasets.load_dataset("parquet", data_files=files, split="train", streaming=True).with_format("torch")


class FirstBatch:
    """on_train_start's time, and the first training batch's time and first row index (set by the loss)."""

    def __init__(self):
        self.start = self.first = self.row = None

    def on_train_start(self, state):
        self.start = time.perf_counter()


def run(files, out: Path, steps: int, workers: int, resume: bool, clock: FirstBatch | None = None):
    config = TrainConfig(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=steps, optim="sgd",
                         learning_rate=1e-3, lr_scheduler_type="constant", report_to=["none"], disable_tqdm=True,
                         run_report=False, eval_strategy="no", save_strategy="steps", save_steps=steps,
                         logging_steps=steps, dataloader_num_workers=workers, preflight=False,
                         resume_from_checkpoint="latest" if resume else None)
    reset_accelerate_state()
    accelerator = build_accelerator(config)
    torch.manual_seed(0)

    def loss_fn(model, batch):
        if clock is not None and clock.first is None:
            clock.first, clock.row = time.perf_counter(), int(batch["index"][0])
        return model(batch["x"].float().unsqueeze(1)).pow(2).mean()

    train(torch.nn.Linear(1, 1), DataLoader(stream(files), batch_size=BATCH, num_workers=workers), config=config,
          loss_fn=loss_fn, accelerator=accelerator, hooks=[clock] if clock else [])


def reread_seconds(files, batches: int, workers: int) -> tuple[float, int]:
    reset_accelerate_state()
    accelerator = build_accelerator(TrainConfig(output_dir=tempfile.mkdtemp(), report_to=["none"]))
    loader = accelerator.prepare(DataLoader(stream(files), batch_size=BATCH, num_workers=workers))
    start = time.perf_counter()
    batch = next(iter(accelerator.skip_first_batches(loader, batches)))
    return time.perf_counter() - start, int(batch["index"][0])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, nargs="+", default=[10_000, 1_000_000])
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--no_reread", action="store_true", help="skip the re-read comparison (minutes at 10^6)")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = write_shards(Path(tmp) / "data")
        for position in args.positions:
            steps, out = position // BATCH, Path(tmp) / f"run{position}"
            started = time.perf_counter()
            run(files, out, steps, args.workers, resume=False)
            read = time.perf_counter() - started
            clock = FirstBatch()
            run(files, out, steps + 1, args.workers, resume=True, clock=clock)
            row = {"position": position, "workers": args.workers, "first_read_s": round(read, 2),
                   "resume_s": round(clock.first - clock.start, 3), "resumed_at_row": clock.row}
            if not args.no_reread:
                seconds, first = reread_seconds(files, steps, args.workers)
                row.update(reread_s=round(seconds, 2), reread_at_row=first)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("| rows consumed | resume, saved position (s) | re-read (s) | first row after resume |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['position']:,} | {r['resume_s']} | {r.get('reread_s', '-')} | {r['resumed_at_row']:,} |")


if __name__ == "__main__":
    main()
