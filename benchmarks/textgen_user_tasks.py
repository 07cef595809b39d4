"""Text generation on a user's own data: rule-generated seq2seq tasks that are NOT the recipe's demo, run with the
recipe's defaults for user data (only the data flags), to check that those defaults learn.

    python benchmarks/textgen_user_tasks.py --out /tmp/textgen_user            # write the tasks, run each
    python benchmarks/textgen_user_tasks.py --out /tmp/textgen_user --write_only
    python benchmarks/textgen_user_tasks.py --out /tmp/textgen_user --tasks numbers --variant A="--learning_rate 1e-4"

Each task is 8,000 training and 400 validation pairs as jsonl files (`text` -> `summary`), drawn from (seed, split)
alone, no validation source in training, every target a string that MiniLM's uncased WordPiece tokenizer writes
exactly (so exact match can reach 100%):

* numbers — a number written in words -> its digits ("three thousand and forty-two" -> "3042");
* sort — five to seven words -> the same words in alphabetical order;
* names — "surname, first name [initial]" (some upper-case) -> "first name [initial] surname", lower-cased.

Every run is `recipes/text_generation.py --train_file ... --validation_file ... --text_column text --summary_column
summary --num_train_epochs 2 [variant flags]`, one process, `--cpu_threads` threads. Prints a markdown table: eval
token loss, exact match, distinct outputs over distinct sources (a collapsed model writes one string for every
input), the generation-collapse warning, and the time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ONES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
        "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")
TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
WORDS = ("apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "candle", "forest", "rocket", "garden",
         "mirror", "orange", "pencil", "silver", "window", "yellow", "basket", "dragon", "engine", "feather", "guitar",
         "harbor", "island", "jacket", "kettle", "ladder", "magnet", "needle", "oyster", "pepper", "quartz", "saddle",
         "tunnel", "violin", "walnut", "zebra", "anchor", "bridge", "castle")
FIRST = ("john", "mary", "peter", "susan", "david", "linda", "james", "karen", "paul", "nancy", "mark", "lisa",
         "george", "helen", "frank", "emma", "oscar", "rita", "victor", "alice")
LAST = ("smith", "jones", "brown", "taylor", "wilson", "davies", "evans", "thomas", "johnson", "roberts", "walker",
        "wright", "thompson", "white", "hughes", "edwards", "green", "hall", "wood", "harris", "clarke", "jackson")


def number_words(n: int) -> str:
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    if n < 1000:
        rest = n % 100
        return ONES[n // 100] + " hundred" + ("" if rest == 0 else " and " + number_words(rest))
    rest = n % 1000
    joiner = " and " if 0 < rest < 100 else " "
    return number_words(n // 1000) + " thousand" + ("" if rest == 0 else joiner + number_words(rest))


def numbers(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(0, 99_999)
    return number_words(n), str(n)


def sort(rng: random.Random) -> tuple[str, str]:
    words = rng.sample(WORDS, rng.randint(5, 7))
    return " ".join(words), " ".join(sorted(words))


def names(rng: random.Random) -> tuple[str, str]:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    initial = rng.choice("abcdefghjklmnprstw") + "." if rng.random() < 0.5 else ""
    source = f"{last}, {first}" + (f" {initial}" if initial else "")
    if rng.random() < 0.4:
        source = source.title()
    return source, " ".join(p for p in (first, initial, last) if p)


TASKS = {"numbers": numbers, "sort": sort, "names": names}


def write_task(name: str, out: Path, seed: int = 0, train: int = 8000, validation: int = 400) -> dict[str, Path]:
    make = TASKS[name]
    rng = random.Random(f"{name}-{seed}")
    rows: dict[str, list[dict]] = {"train": [], "validation": []}
    seen: set[str] = set()
    for split, n in (("train", train), ("validation", validation)):
        while len(rows[split]) < n:
            source, target = make(rng)
            if split == "validation" and source in seen:
                continue
            seen.add(source) if split == "train" else None
            rows[split].append({"text": source, "summary": target})
    files = {}
    for split, items in rows.items():
        files[split] = out / f"{name}_{split}.jsonl"
        files[split].write_text("".join(json.dumps(r) + "\n" for r in items))
    return files


def run(name: str, files: dict[str, Path], variant: str, flags: list[str], out: Path, threads: int) -> dict:
    run_dir = out / f"{name}-{variant}"
    cmd = [sys.executable, str(ROOT / "recipes" / "text_generation.py"), "--train_file", str(files["train"]),
           "--validation_file", str(files["validation"]), "--text_column", "text", "--summary_column", "summary",
           "--num_train_epochs", "2", *flags, "--output_dir", str(run_dir), "--overwrite_output_dir",
           "--report_to", "none", "--disable_tqdm", "--cpu_threads", str(threads)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    log = out / f"{name}-{variant}.log"
    with log.open("w") as sink:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT).returncode
    if code != 0:
        return {"task": name, "variant": variant, "error": f"exit {code}, see {log}"}
    results = json.loads((run_dir / "all_results.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "predictions.jsonl").read_text().splitlines() if line.strip()]
    warned = "collapse" in log.read_text()
    return {"task": name, "variant": variant, "loss": results["eval_loss"], "exact": results["eval_exact_match"],
            "distinct": f"{len({r['output'] for r in rows})} / {len({r['source'] for r in rows})}",
            "warned": "yes" if warned else "no", "time": results["train_runtime"]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--variant", action="append", default=[], help='NAME="flags" (repeatable); default: the '
                        "recipe's defaults only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write_only", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    files = {name: write_task(name, args.out) for name in args.tasks}
    if args.write_only:
        print("\n".join(str(p) for f in files.values() for p in f.values()))
        return
    variants = [v.split("=", 1) for v in args.variant] or [["defaults", ""]]
    print("| task | variant | eval token loss | exact match | distinct outputs / sources | collapse warned | "
          "train s |\n|---|---|---|---|---|---|---|", flush=True)
    for name in args.tasks:
        for variant, flags in variants:
            r = run(name, files[name], variant, shlex.split(flags), args.out, args.threads)
            if "error" in r:
                print(f"| {name} | {variant} | {r['error']} | | | | |", flush=True)
            else:
                print(f"| {name} | {variant} | {r['loss']:.3f} | {r['exact']:.1f}% | {r['distinct']} | {r['warned']} "
                      f"| {r['time']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
