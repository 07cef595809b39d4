#!/usr/bin/env bash
# GPU check for recipes/text_generation.py (issue 15, item 8): a GPT-2-small-sized causal LM built from a config
# (12 layers, 768 wide, 12 heads, block 1024, vocabulary padded to 50,304 as nanoGPT does: 124M parameters) trained
# through the recipe on language-modelling blocks, in bf16, bf16 + torch.compile, fp16 and fp32 (TF32). Prints
# tokens/s, the loop's measured MFU (FlopCounterMode), nanoGPT's MFU formula on the same tokens/s, and each
# precision's speed over fp32, beside nanoGPT's published figures (below).
#
#   bash benchmarks/gpu_textgen_check.sh [any recipe flag ...]
#
# Environment: STEPS (40), BATCH (16 sequences per step), BLOCK (1024), OUT (/tmp/accel_train_gpu_textgen),
# MODEL (config overrides, default GPT-2 small), RUNS ("bf16 bf16_compile fp16 fp32"), PEAK_TFLOPS (989.4: H100/H200
# bf16 dense). The data: every markdown and Python file of this repository as text (offline, no download); the
# tokenizer: a byte-level BPE of 8,000 tokens trained on it at start (the model keeps 50,304 embeddings).
# A CPU smoke test of the same invocation (what CI can run):
#   STEPS=2 BATCH=2 BLOCK=32 RUNS=fp32 MODEL="vocab_size=8064,n_positions=32,n_embd=32,n_layer=1,n_head=2" \
#     bash benchmarks/gpu_textgen_check.sh --cpu_threads 1
#
# nanoGPT's published numbers (github.com/karpathy/nanoGPT README), turned into MFU with nanoGPT's own
# estimate_mfu (flops per token 6N + 12*L*H*Q*T, N = 123.7M non-embedding parameters, A100 bf16 peak 312 TFLOP/s):
#   bench.py, one A100, 12 x 1024 tokens per iteration, torch.compile: 135 ms/iter -> 91k tokens/s -> MFU 25%;
#   train.py, 8 x A100 for ~4 days, 600k iterations of 491,520 tokens -> ~107k tokens/s per GPU -> MFU ~29%.
set -uo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-40}
BATCH=${BATCH:-16}
BLOCK=${BLOCK:-1024}
OUT=${OUT:-/tmp/accel_train_gpu_textgen}
MODEL=${MODEL:-vocab_size=50304,n_positions=1024,n_embd=768,n_layer=12,n_head=12,resid_pdrop=0.0,embd_pdrop=0.0,attn_pdrop=0.0}
RUNS=${RUNS:-bf16 bf16_compile fp16 fp32}
PEAK_TFLOPS=${PEAK_TFLOPS:-989.4}
mkdir -p "$OUT"
python3 - "$OUT/corpus.jsonl" <<'PY'
import json, sys
from pathlib import Path
files = sorted(p for p in Path(".").rglob("*") if p.suffix in (".md", ".py") and ".git" not in p.parts
               and not any(part.startswith((".", "outputs")) for part in p.parts))
rows = [{"text": p.read_text(errors="replace")} for p in files]
Path(sys.argv[1]).write_text("".join(json.dumps(r) + "\n" for r in rows))
print(f"corpus: {len(rows)} files, {sum(len(r['text']) for r in rows) / 1e6:.2f} M characters")
PY
COMMON=(recipes/text_generation.py --train_file "$OUT/corpus.jsonl" --text_column text --block_size "$BLOCK"
        --validation_split 0.05 --model_type gpt2 --config_overrides "$MODEL" --train_tokenizer_vocab_size 8000
        --max_steps "$STEPS" --per_device_train_batch_size "$BATCH" --per_device_eval_batch_size "$BATCH"
        --learning_rate 6e-4 --warmup_steps 0.1 --weight_decay 0.1 --adam_beta2 0.95 --logging_steps 10
        --eval_strategy no --save_strategy no --report_to none --disable_tqdm --no_run_report --overwrite_output_dir)
status=0
for name in $RUNS; do
  case $name in
    bf16) flags=(--mixed_precision bf16) ;;
    bf16_compile) flags=(--mixed_precision bf16 --torch_compile) ;;
    fp16) flags=(--mixed_precision fp16) ;;
    fp32) flags=(--mixed_precision no) ;;
    *) echo "unknown run $name"; exit 2 ;;
  esac
  echo "=== $name"
  if ! timeout 900 python3 -m accelerate.commands.launch --num_processes 1 --num_machines 1 --dynamo_backend no \
      "${COMMON[@]}" "${flags[@]}" "$@" --output_dir "$OUT/$name" > "$OUT/$name.log" 2>&1; then
    echo "FAILED: $name (last lines of $OUT/$name.log):"; tail -25 "$OUT/$name.log"; status=1
  fi
done
python3 - "$OUT" "$MODEL" "$BLOCK" "$PEAK_TFLOPS" $RUNS <<'PY'
import json, statistics, sys
from pathlib import Path
import torch
from transformers import GPT2Config, GPT2LMHeadModel
out, overrides, block, peak, names = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5:]
config = GPT2Config()
config.update_from_string(overrides)
with torch.device("meta"):
    model = GPT2LMHeadModel(config)
params = sum(p.numel() for p in model.parameters())
non_embedding = params - model.transformer.wpe.weight.numel()  # nanoGPT's get_num_params()
flops_per_token = 6 * non_embedding + 12 * config.n_layer * config.n_head * (config.n_embd // config.n_head) * block
print(f"\nmodel: {params / 1e6:.1f}M parameters ({non_embedding / 1e6:.1f}M without position embeddings), block {block}; "
      f"nanoGPT formula {flops_per_token / 1e9:.3f} GFLOP per token; peak {peak} TFLOP/s")
print("\n| run | tokens/s | vs fp32 | MFU (loop, measured FLOPs) | MFU (nanoGPT formula) | peak GPU MB | final loss |")
print("|---|---|---|---|---|---|---|")
rows = {}
for name in names:
    path = out / name / "metrics.jsonl"
    logs = [json.loads(l) for l in path.read_text().splitlines()] if path.exists() else []
    train = [r for r in logs if "tokens_per_second" in r]
    if not train:
        print(f"| {name} | (failed) | | | | | |")
        continue
    steady = train[1:] or train  # the first interval holds compilation and warm-up
    tps = statistics.median(r["tokens_per_second"] for r in steady)
    mfu = [r["mfu"] for r in steady if "mfu" in r]
    rows[name] = (tps, statistics.median(mfu) if mfu else None, max(r.get("gpu_peak_memory_mb", 0) for r in train),
                  train[-1]["loss"])
base = rows.get("fp32", (None,))[0]
for name, (tps, mfu, mem, loss) in rows.items():
    formula = tps * flops_per_token / (peak * 1e12)
    print(f"| {name} | {tps:,.0f} | {f'{tps / base:.2f}x' if base else '-'} | {f'{mfu:.1%}' if mfu else '-'} | "
          f"{formula:.1%} | {mem:,.0f} | {loss:.3f} |")
print("\nnanoGPT (A100, bf16, compiled, by its own formula): bench.py 25%, the 4-day 8 x A100 run ~29%. The fp32 row's "
      "formula MFU is against the same bf16 peak, so it reads as a share of what bf16 could do.")
PY
exit $status
