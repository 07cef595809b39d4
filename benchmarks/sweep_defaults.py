"""Recipe defaults from sweeps on tasks that are not the benchmark's (issue 42): `accel-train sweep` over the NLP
recipe's learning rate, batch and warmup on two sentence tasks of ../shared/data that neither time-to-quality task
uses, TREC (6 question types) and MR (movie-review polarity), then one table of every setting on both.

    python benchmarks/sweep_defaults.py                 # both sweeps (about 30 min on 2 CPU cores), then the table
    python benchmarks/sweep_defaults.py --table_only    # the table of what the studies hold

Each trial trains one epoch (the accuracy a setting reaches in a fixed budget: how fast it learns) on the recipe's
other defaults (all-MiniLM-L6-v2, bf16 by `auto`, length grouping, seed 42) and is scored on 10% of the task's
training file held out (seeded, not stratified: a file's labels are plain ints), never on a test set. The space is
SPACE; TPE is seeded, and its first 10 trials are random, so with --trials 10 both tasks get the same 10 settings.
The studies live in benchmarks/runs/sweep_defaults/<task>/ (study.db, trials.csv, a directory per trial); a rerun
resumes them.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "runs" / "sweep_defaults"
DATA = ROOT.parent / "shared" / "data" / "sentence-classification"
TASKS = {"TREC": "TREC.train.all", "MR": "rt-polarity.all"}
SPACE = """learning_rate: {low: 5.0e-5, high: 1.0e-3, log: true}
per_device_train_batch_size: {choices: [8, 16, 32]}
warmup_steps: {low: 0.0, high: 0.2}
"""
RECIPE_FLAGS = ["--num_train_epochs", "1", "--save_strategy", "no", "--eval_strategy", "epoch",
                "--load_best_model_at_end", "false", "--report_to", "none", "--disable_tqdm", "--run_report", "false",
                "--max_seq_length", "128"]


def sweep(task: str, trials: int) -> None:
    """One study: `accel-train sweep` as a user runs it, alone on the machine."""
    space = OUT / "space.yaml"
    space.write_text(SPACE)
    command = [sys.executable, "-m", "accel_train.cli", "sweep", "--space", str(space), "--trials", str(trials),
               "--metric", "eval_accuracy", "--pruner", "none", "--seed", "0", "--study_dir", str(OUT / task),
               "--", str(ROOT / "recipes" / "nlp_finetune.py"), "--train_file", str(DATA / TASKS[task]),
               *RECIPE_FLAGS]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    subprocess.run(command, check=True, cwd=ROOT, env=env)


def table() -> list[str]:
    """Every completed setting, with its accuracy on each task and the mean, best mean first."""
    scores: dict[tuple, dict[str, float]] = {}
    for task in TASKS:
        path = OUT / task / "trials.csv"
        if not path.is_file():
            continue
        for row in csv.DictReader(path.open()):
            if row["state"] == "COMPLETE":
                key = (float(row["params_learning_rate"]), int(row["params_per_device_train_batch_size"]),
                       float(row["params_warmup_steps"]))
                scores.setdefault(key, {})[task] = float(row["value"])
    lines = ["| learning rate | batch | warmup | " + " | ".join(f"{t} accuracy" for t in TASKS) + " | mean |",
             "|---|---|---|" + "---|" * (len(TASKS) + 1)]
    ranked = sorted(scores.items(), key=lambda kv: -sum(kv[1].values()) / len(TASKS) if len(kv[1]) == len(TASKS)
                    else 1.0)
    for (lr, batch, warmup), by_task in ranked:
        cells = [f"{by_task[t]:.3f}" if t in by_task else "-" for t in TASKS]
        mean = f"{sum(by_task.values()) / len(TASKS):.3f}" if len(by_task) == len(TASKS) else "-"
        lines.append(f"| {lr:.2e} | {batch} | {warmup:.3f} | " + " | ".join(cells) + f" | {mean} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--table_only", action="store_true")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        for task in TASKS:
            sweep(task, args.trials)
    lines = table()
    (OUT / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
