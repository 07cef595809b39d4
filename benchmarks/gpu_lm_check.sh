#!/usr/bin/env bash
# GPU check for packing beside TRL (issue 27): a GPT-2-124M-shaped model from a config (12 layers, 768 wide, 12 heads,
# 1,024 positions, vocabulary 50,257; a byte-level BPE of 8,000 trained on the data at start), bf16, on AG News from
# ../shared/data: this recipe and TRL's SFTTrainer side by side in one run of benchmarks/lm_throughput.py, unpacked
# (row a) and packed (row b), real tokens/s and MFU (6 x parameters x real tokens/s over the device's bf16 peak, the
# same formula for both), peak GPU memory, one eval loss for all.
#
#   bash benchmarks/gpu_lm_check.sh                  # writes $OUT/LM_GPU.md (OUT: /tmp/accel_train_gpu_lm)
#
# Environment: BATCH (64 examples per unpacked step; packed rows per step follow from it), ROWS ("a,b"), OUT. Needs
# TRL (pip install -e ".[bench]") and the data beside the repository (../shared/data/ag-news-test). A CPU smoke test
# of the same code path (what a machine without a GPU can run; slow, small):
#   LM_THROUGHPUT_GPU=1 python benchmarks/lm_throughput.py --quick --rows a --output /tmp/lm_gpu_smoke.md
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/accel_train_gpu_lm}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
LM_THROUGHPUT_GPU=1 LM_THROUGHPUT_BATCH=${BATCH:-64} python benchmarks/lm_throughput.py --rows "${ROWS:-a,b}" \
    --workdir "$OUT/work" --output "$OUT/LM_GPU.md"
status=$?
cat "$OUT/LM_GPU.md" 2>/dev/null
exit $status
