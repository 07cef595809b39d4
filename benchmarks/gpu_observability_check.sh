#!/usr/bin/env bash
# GPU check of the observability paths the CPU tests cannot reach (issue 9): the CUDA allocator snapshot, CUDA
# kernels in the profiler trace, gradient flow under fp16 (unscaled: equal to fp32's at step 1), the pre-flight's
# precision finding and the report on a GPU. The toy job only: needs torch, accelerate, transformers, matplotlib.
#
#   bash benchmarks/gpu_observability_check.sh          # about a minute on one GPU
#
# Environment: OUT (default /tmp/accel_train_obs_check). Prints one PASS/FAIL line per check; exit 1 on a FAIL.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/accel_train_obs_check}
rm -rf "$OUT" && mkdir -p "$OUT"
export PYTHONPATH=".:tests${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
TOY=(python3 tests/scripts/toy_train.py --per_device_train_batch_size 16 --eval_strategy no --save_strategy no
     --logging_steps 1 --disable_tqdm --grad_flow_steps 1)
"${TOY[@]}" --output_dir "$OUT/bf16" --max_steps 6 --mixed_precision bf16 --run_report true \
    --activation_stats_steps 2 --profile_steps 2-3 --memory_snapshot_step 3 > "$OUT/bf16.log" 2>&1
for precision in no fp16; do  # step 1's gradients at the initial weights: fp16's must come back unscaled
  "${TOY[@]}" --output_dir "$OUT/grad_$precision" --max_steps 1 --mixed_precision "$precision" \
      --max_grad_norm 0 > "$OUT/grad_$precision.log" 2>&1
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path

out, failed = Path(sys.argv[1]), False


def check(name, ok, detail=""):
    global failed
    failed |= not ok
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}")


run = out / "bf16"
snapshot = json.loads((run / "diagnostics" / "memory_step3_rank0.json").read_text())
pickle = run / "diagnostics" / "memory_step3_rank0.pickle"
check("CUDA allocator snapshot", pickle.exists() and pickle.stat().st_size > 0 and "cuda_snapshot" in snapshot,
      f"{pickle.stat().st_size if pickle.exists() else 0} bytes, peak {snapshot.get('gpu_peak_allocated_mb')} MiB")
trace = json.loads(next((run / "profiler").glob("rank0.*.pt.trace.json")).read_text())["traceEvents"]
kernels = [e for e in trace if e.get("cat") == "kernel"]
check("CUDA kernels in the profiler trace", len(kernels) > 0, f"{len(kernels)} kernel events")
findings = json.loads((run / "report" / "preflight.json").read_text())["findings"]
precision = next(f["message"] for f in findings if f["check"] == "precision")
check("pre-flight: bf16 autocast on cuda", "bf16 autocast on cuda" in precision, precision)
check("pre-flight: no warning", not [f for f in findings if f["level"] != "ok"])
report = (run / "report.md").read_text()
check("report names the GPU and precision", "x NVIDIA" in report and "bf16 autocast on cuda" in report)
from accel_train.observe.report.plots import series_by_label
check("report plots GPU peak memory", "gpu peak memory mb" in series_by_label(run / "report" / "throughput.png"))
fp32, fp16 = ([json.loads(l) for l in (out / f"grad_{p}" / "diagnostics" / "grad_flow.jsonl").read_text().splitlines()][0]
              for p in ("no", "fp16"))
ratios = {n: fp16["norms"][n] / fp32["norms"][n] for n in fp32["norms"]}
check("fp16 gradient flow unscaled (fp16 / fp32 within 2%)", all(abs(r - 1) < 0.02 for r in ratios.values()),
      str({n: round(r, 4) for n, r in ratios.items()}))
sys.exit(1 if failed else 0)
PY
