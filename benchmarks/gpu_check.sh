#!/usr/bin/env bash
# GPU check: the presets that fit one GPU run the NLP recipe for a few dozen steps; prints samples/s, MFU, peak GPU
# memory, the precision actually in effect, fp16 loss-scaler skipped steps, and each precision's speed-up over fp32.
# FSDP2 (the shipped fsdp.yaml, unchanged) runs with one process, saves a sharded checkpoint, resumes from it and
# exports the gathered model, which must load with from_pretrained; with deepspeed installed, the ZeRO-2 and ZeRO-3
# presets run too. The table names the back-end each run really had (a refused one fails loudly).
#
#   bash benchmarks/gpu_check.sh [--model_name_or_path DIR] [any recipe flag ...]
#
# Environment: STEPS (default 60), OUT (default /tmp/accel_train_gpu_check), COMPILE=1 adds torch.compile runs.
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-60}
OUT=${OUT:-/tmp/accel_train_gpu_check}
HALF=$((STEPS / 2))
COMMON=(--max_steps "$STEPS" --per_device_train_batch_size 32 --eval_strategy no --load_best_model_at_end false
        --save_strategy steps --save_steps "$HALF" --logging_steps 10 --report_to none --disable_tqdm
        --overwrite_output_dir "$@")
RUNS=()
status=0
run() {  # name, launcher and recipe flags...
  local name=$1; shift
  RUNS+=("$name")
  echo "=== $name"
  if ! timeout 420 python3 -m accelerate.commands.launch "$@" --output_dir "$OUT/$name" > "$OUT/$name.log" 2>&1; then
    echo "FAILED: $name (last lines of $OUT/$name.log):"; tail -25 "$OUT/$name.log"; status=1
  fi
}
mkdir -p "$OUT"
BF16=(--config_file accelerate_configs/single_gpu_bf16.yaml recipes/nlp_finetune.py "${COMMON[@]}")
run fp32_tf32_off "${BF16[@]}" --mixed_precision no --tf32 false
run fp32 "${BF16[@]}" --mixed_precision no
run single_gpu_bf16 "${BF16[@]}"
run single_gpu_fp16 --config_file accelerate_configs/single_gpu_fp16.yaml recipes/nlp_finetune.py "${COMMON[@]}"
run fsdp_1gpu --config_file accelerate_configs/fsdp.yaml --num_processes 1 recipes/nlp_finetune.py "${COMMON[@]}"
run fsdp_1gpu_resume --config_file accelerate_configs/fsdp.yaml --num_processes 1 recipes/nlp_finetune.py \
    "${COMMON[@]}" --resume_from_checkpoint "$OUT/fsdp_1gpu/checkpoints/step-$(printf %08d "$HALF")"
if python3 -c "import deepspeed" 2>/dev/null; then
  run deepspeed_zero2 --config_file accelerate_configs/deepspeed_zero2.yaml --num_processes 1 recipes/nlp_finetune.py \
      "${COMMON[@]}"
  run deepspeed_zero3 --config_file accelerate_configs/deepspeed_zero3.yaml --num_processes 1 --mixed_precision bf16 \
      recipes/nlp_finetune.py \
      "${COMMON[@]}"
fi
if [ "${COMPILE:-0}" = 1 ]; then  # static shapes (max-length padding) so the graph compiles once
  run bf16_static "${BF16[@]}" --pad_to_max_length --max_seq_length 64 --no_group_by_length
  run bf16_static_compile "${BF16[@]}" --pad_to_max_length --max_seq_length 64 --no_group_by_length --torch_compile
fi
python3 - "$OUT" "${RUNS[@]}" <<'PY'
import json, re, statistics, sys
from pathlib import Path
out, names = Path(sys.argv[1]), sys.argv[2:]
rows, base = [], None
for name in names:
    log = (out / f"{name}.log").read_text(errors="replace") if (out / f"{name}.log").exists() else ""
    precision = re.search(r"precision\s+(.+)", log)
    backend = re.search(r"world size\s+\d+ process\(es\), (\w+)", log)
    speed = re.search(r"speed\s+(.+)", log)
    if not (out / name / "all_results.json").exists():
        rows.append(f"| {name} | (failed) | | | | | | | | |")
        continue
    res = json.loads((out / name / "all_results.json").read_text())
    logs = [json.loads(l) for l in (out / name / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    sps = statistics.median(r["samples_per_second"] for r in logs[1:] or logs)  # steady state: skip the first interval
    mfu = [r["mfu"] for r in logs[1:] if "mfu" in r]
    if name == "fp32":
        base = sps
    rows.append((name, backend.group(1) if backend else "?", precision.group(1) if precision else "?",
                 speed.group(1) if speed else "?", sps,
                 statistics.median(mfu) if mfu else None, res.get("train_gpu_peak_memory_mb", 0),
                 res.get("train_skipped_steps", 0), res.get("train_steps", 0), "resumed from" in log))
print("\n| run | back-end | precision in effect | speed settings | samples/s | vs fp32 | MFU | peak GPU MB | fp16 skipped "
      "steps | steps |")
print("|---|---|---|---|---|---|---|---|---|---|")
for row in rows:
    if isinstance(row, str):
        print(row); continue
    name, backend, prec, speed, sps, mfu, mem, skipped, steps, resumed = row
    ratio = f"{sps / base:.2f}x" if base else "-"
    print(f"| {name}{' (resumed)' if resumed else ''} | {backend} | {prec} | {speed} | {sps:.0f} | {ratio} | "
          f"{f'{mfu:.1%}' if mfu is not None else '-'} | {mem:.0f} | {skipped} | {steps} |")
for name in ("fsdp_1gpu", "deepspeed_zero2", "deepspeed_zero3"):
    if (out / name / "model.safetensors").exists():
        from transformers import AutoModelForSequenceClassification
        model = AutoModelForSequenceClassification.from_pretrained(out / name)
        print(f"{name}: the exported model loads with from_pretrained ({sum(p.numel() for p in model.parameters()):,} "
              "parameters)")
PY
exit $status
