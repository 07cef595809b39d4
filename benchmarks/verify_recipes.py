"""`accel-train verify` on each of the 7 shipped recipes, small settings, one recipe at a time (never two at once: the
variants of one verify already take both cores). Each certificate goes to benchmarks/runs/verify_recipes/<recipe>/
(verify.json and report.md, the variants' run directories beside them); the summary table (recipe, checks passed /
property / not applicable / failed, seconds) to benchmarks/runs/verify_recipes/summary.md and stdout.

    python benchmarks/verify_recipes.py                       # all 7 (about 30-40 minutes on 2 CPU cores)
    python benchmarks/verify_recipes.py --only nlp_finetune   # some of them (comma-separated)

Small settings: each recipe's embedded demo data cut to 64 training and 16-32 evaluation examples, the tiny model
configurations the recipes' tests use where the recipe builds its model from a config (the pretrained MiniLM text
towers stay MiniLM), dropout off where the recipe's model has a flag for it (dropout draws its masks per micro-batch
and per process: docs/verify.md), --steps 4. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "runs" / "verify_recipes"
RESNET = '{"widths": [8, 16], "blocks_per_stage": 1}'
DENSE = '{"widths": [8, 16, 16], "blocks_per_stage": 1, "head_width": 8}'
NO_DROPOUT = "hidden_dropout_prob=0,attention_probs_dropout_prob=0"
COMMON = ["--per_device_train_batch_size", "8", "--no_preflight"]
# recipe -> its flags (after COMMON)
RECIPES = {
    "nlp_finetune": ["--max_train_samples", "64", "--max_eval_samples", "32", "--config_overrides", NO_DROPOUT],
    "image_classification": ["--max_train_samples", "64", "--max_eval_samples", "32", "--config_overrides", RESNET],
    "multimodal_contrastive": ["--max_train_samples", "64", "--max_eval_samples", "32",
                               "--vision_config_overrides", RESNET],
    # one thread: with 2, two runs of the same command end with weights 4e-7 apart (losses equal), which determinism
    # names a nondeterministic kernel (the fusion layers' attention; docs/verify.md, the recipes' certificates)
    "multimodal_fusion": ["--max_train_samples", "64", "--max_eval_samples", "32", "--vision_config_overrides",
                          RESNET, "--fusion_dim", "16", "--fusion_heads", "2", "--embed_dim", "16", "--cpu_threads",
                          "1"],
    "object_detection": ["--num_train_canvases", "64", "--num_test_canvases", "32", "--config_overrides", DENSE],
    "semantic_segmentation": ["--num_train_canvases", "64", "--num_test_canvases", "32", "--config_overrides",
                              '{"widths": [8, 16, 16], "blocks_per_stage": 1}'],
    "text_generation": ["--max_train_samples", "64", "--max_eval_samples", "16", "--decoder_layers", "1",
                        "--max_generate_samples", "8", "--generation_max_new_tokens", "8"],
}


def verify_one(name: str, steps: int) -> dict:
    out = OUT / name
    command = [sys.executable, "-m", "accel_train.cli", "verify", "--steps", str(steps), "--output_dir", str(out),
               "--", str(ROOT / "recipes" / f"{name}.py"), *COMMON, *RECIPES[name]]
    print(f"== {name}: {' '.join(command)}", flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    code = subprocess.run(command, env=env, cwd=ROOT).returncode
    seconds = time.monotonic() - start
    certificate = json.loads((out / "verify.json").read_text()) if (out / "verify.json").is_file() else {}
    statuses = {check: result["status"] for check, result in certificate.get("checks", {}).items()}
    return {"recipe": name, "exit_code": code, "seconds": round(seconds), "statuses": statuses,
            "causes": {check: result.get("cause") for check, result in certificate.get("checks", {}).items()
                       if result.get("cause")},
            "not_applicable": {check: result["measured"].get("reason") for check, result in
                               certificate.get("checks", {}).items() if result["status"] == "not applicable"},
            "error": certificate.get("error")}


def table(rows: list[dict]) -> str:
    lines = ["| recipe | exit | passed | property | not applicable | failed | seconds |",
             "|---|---|---|---|---|---|---|"]
    for row in rows:
        by = {status: [c for c, s in row["statuses"].items() if s == status]
              for status in ("passed", "property", "not applicable", "failed")}
        cells = [f"{len(v)}" + (f" ({', '.join(v)})" if v and status != "passed" else "") for status, v in by.items()]
        error = f" error: {row['error']}" if row["error"] else ""
        lines.append(f"| {row['recipe']} | {row['exit_code']}{error} | {' | '.join(cells)} | {row['seconds']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(RECIPES), help="comma-separated recipes")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    summary_file = OUT / "summary.json"
    rows = {row["recipe"]: row for row in json.loads(summary_file.read_text())} if summary_file.is_file() else {}
    for name in [n.strip() for n in args.only.split(",") if n.strip()]:
        rows[name] = verify_one(name, args.steps)
        ordered = [rows[n] for n in RECIPES if n in rows]
        summary_file.write_text(json.dumps(ordered, indent=2))
        (OUT / "summary.md").write_text(table(ordered) + "\n")
    print(table([rows[n] for n in RECIPES if n in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
