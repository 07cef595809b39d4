"""MiniLM on SST-2 over several seeds: one recipe config against variants, dev and test accuracy per seed.

    python benchmarks/sst2_seeds.py --seeds 42 1 2 3 --parallel 2 --out /tmp/sst2_seeds \
        --variant D="--per_device_train_batch_size 16 --learning_rate 1e-4 --num_train_epochs 3"

Every run is `recipes/nlp_finetune.py --config recipes/configs/nlp_sst2.yaml [variant flags] --seed S`, one
process with one intra-op thread each, `--parallel` of them at a time (on 2 cores, two one-thread runs side by
side each keep about one-thread speed, ~2x the throughput of one run, while a single run on two threads gains
1.6x: see CPU_THREADS.md). The variant "shipped" is the config as it is. Prints a markdown table; run times here are
for runs sharing the machine, not the time of one run alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "recipes" / "configs" / "nlp_sst2.yaml"


def run_one(name: str, flags: list[str], seed: int, out: Path) -> dict:
    run_dir = out / f"{name}-seed{seed}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, str(ROOT / "recipes" / "nlp_finetune.py"), "--config", str(CONFIG), *flags,
           "--seed", str(seed), "--output_dir", str(run_dir), "--report_to", "none", "--disable_tqdm",
           "--overwrite_output_dir"]
    log = out / f"{name}-seed{seed}.log"
    with log.open("w") as sink:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"{name} seed {seed} failed (exit {code}); see {log}")
    per_epoch = [round(100 * json.loads(line)["eval_accuracy"], 2)
                 for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"eval_accuracy"' in line]
    results = json.loads((run_dir / "all_results.json").read_text())
    return {"name": name, "seed": seed, "per_epoch": per_epoch, "dev": 100 * results["eval_accuracy"],
            "test": 100 * results["test_accuracy"], "runtime": results["train_runtime"]}


def describe(values: list[float]) -> str:
    spread = f" ± {statistics.stdev(values):.2f}" if len(values) > 1 else ""
    return f"{statistics.mean(values):.2f}{spread}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 1, 2, 3])
    parser.add_argument("--variant", action="append", default=[],
                        help='NAME="flags" run beside the shipped config (repeatable)')
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--extra", default="",
                        help='flags added to every run, e.g. "--max_train_samples 64" for a smoke run')
    parser.add_argument("--out", type=Path, default=Path("outputs/sst2_seeds"))
    args = parser.parse_args(argv)
    extra = shlex.split(args.extra)
    variants = {"shipped": extra}
    for item in args.variant:
        name, _, flags = item.partition("=")
        variants[name] = [*shlex.split(flags), *extra]
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = [(name, flags, seed) for seed in args.seeds for name, flags in variants.items()]
    started = time.perf_counter()
    with ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(lambda job: run_one(*job, args.out), jobs))
    print(f"\n{len(rows)} runs in {(time.perf_counter() - started) / 60:.1f} min\n")
    print("| variant | seed | dev accuracy per epoch | best dev | test (best dev epoch) |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['name']} | {row['seed']} | {' / '.join(map(str, row['per_epoch']))} | {row['dev']:.2f} "
              f"| {row['test']:.2f} |")
    print("\n| variant | flags | mean best dev ± sd | seeds ≥ 88% dev | mean test ± sd |")
    print("|---|---|---|---|---|")
    for name, flags in variants.items():
        mine = [r for r in rows if r["name"] == name]
        dev, test = [r["dev"] for r in mine], [r["test"] for r in mine]
        print(f"| {name} | `{' '.join(flags) or '(the config)'}` | {describe(dev)} | "
              f"{sum(d >= 88 for d in dev)} / {len(dev)} | {describe(test)} |")


if __name__ == "__main__":
    main()
