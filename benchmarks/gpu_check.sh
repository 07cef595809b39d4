#!/usr/bin/env bash
# GPU check: every GPU preset that fits one GPU runs the NLP recipe for a few dozen steps, then prints
# samples/s, peak GPU memory, the precision actually in effect and the fp16 loss-scaler's skipped steps.
# FSDP runs with one process, saves a sharded checkpoint, resumes from it and exports the gathered model.
#
#   bash benchmarks/gpu_check.sh [--model_name_or_path DIR] [any recipe flag ...]
#
# Environment: STEPS (default 60), OUT (default /tmp/accel_train_gpu_check).
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-60}
OUT=${OUT:-/tmp/accel_train_gpu_check}
HALF=$((STEPS / 2))
COMMON=(--max_steps "$STEPS" --per_device_train_batch_size 32 --eval_strategy no --load_best_model_at_end false
        --save_strategy steps --save_steps "$HALF" --logging_steps 10 --report_to none --disable_tqdm
        --overwrite_output_dir "$@")
status=0
run() {  # name, launcher flags..., -- recipe flags...
  local name=$1; shift
  echo "=== $name"
  if ! accelerate launch "$@" > "$OUT/$name.log" 2>&1; then
    echo "FAILED: $name (last lines of $OUT/$name.log):"; tail -25 "$OUT/$name.log"; status=1
  fi
}
mkdir -p "$OUT"
run single_gpu_bf16 --config_file accelerate_configs/single_gpu_bf16.yaml recipes/nlp_finetune.py \
    "${COMMON[@]}" --output_dir "$OUT/single_gpu_bf16"
run single_gpu_fp16 --config_file accelerate_configs/single_gpu_fp16.yaml recipes/nlp_finetune.py \
    "${COMMON[@]}" --output_dir "$OUT/single_gpu_fp16"
run fsdp_1gpu --config_file accelerate_configs/fsdp.yaml --num_processes 1 recipes/nlp_finetune.py \
    "${COMMON[@]}" --output_dir "$OUT/fsdp_1gpu"
run fsdp_1gpu_resume --config_file accelerate_configs/fsdp.yaml --num_processes 1 recipes/nlp_finetune.py \
    "${COMMON[@]}" --output_dir "$OUT/fsdp_1gpu_resume" \
    --resume_from_checkpoint "$OUT/fsdp_1gpu/checkpoints/step-$(printf %08d "$HALF")"
python3 - "$OUT" <<'PY'
import json, re, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"\n{'run':<18} {'precision in effect':<44} {'samples/s':>10} {'peak GPU MB':>12} {'skipped':>8} {'steps':>6}")
for name in ("single_gpu_bf16", "single_gpu_fp16", "fsdp_1gpu", "fsdp_1gpu_resume"):
    log = (out / f"{name}.log").read_text() if (out / f"{name}.log").exists() else ""
    precision = re.search(r"precision\s+(.+)", log)
    if not (out / name / "all_results.json").exists():
        print(f"{name:<18} (no results)")
        continue
    res = json.loads((out / name / "all_results.json").read_text())
    resumed = " (resumed)" if "resumed from" in log else ""
    print(f"{name:<18} {(precision.group(1) if precision else '?') + resumed:<44} "
          f"{res.get('train_samples_per_second', 0):>10.1f} {res.get('train_gpu_peak_memory_mb', 0):>12.0f} "
          f"{res.get('train_skipped_steps', 0):>8} {res.get('train_steps', 0):>6}")
exported = out / "fsdp_1gpu" / "model.safetensors"
print(f"\nFSDP export gathered to a full state dict: {exported.exists()} ({exported})")
PY
exit $status
