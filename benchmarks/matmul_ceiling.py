"""The highest MFU a model's own matmuls allow on this machine: each matmul of one training step timed alone.

MFU divides a step's model FLOPs by the device's dense matmul peak, which `core/peak.py` times on a 2048 x 2048
square. A step's FLOP rate never exceeds the rate its matmuls reach on their own shapes: this script builds the
forward and backward matmuls of one micro-batch of a BERT-shaped encoder (by default MiniLM, the main job's model: 6
layers, 384 wide, 1,536 in the MLP, 12 heads) - every linear layer's forward, input-gradient and weight-gradient
products and the attention's batched products - times each alone in bf16 (the fastest of `--repeats` loops of calls,
each long enough to time: a best case, as the peak is), and reports their FLOP-weighted throughput against the
measured peak (the loop's own, `core/peak.py`: the fastest 2048-square matmul this machine has timed, re-timed after
the shapes and raised when faster). That share is an upper bound of the step's MFU: the step would reach it only if
everything that is not a matmul (dropout's masks, norms, softmax, casts, the optimizer) took no time at all.

    python benchmarks/matmul_ceiling.py --tokens 1102 4096 16384 --json /tmp/matmul_ceiling.json

`--tokens` is the tokens of one micro-batch (the main job's token budget packs about 1,102 padded tokens: 32
sentences of about 34); `--length` the padded length that sets the attention's shape.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from accel_train.core.peak import MATMUL_SIDE, measured_peak, time_matmul  # noqa: E402

LOOP_SECONDS = 0.05  # each timed sample is a loop of calls that lasts about this long


def step_matmuls(tokens: int, length: int, hidden: int, intermediate: int, heads: int,
                 layers: int) -> list[tuple[str, tuple[int, ...], tuple[int, ...], int]]:
    """(name, left shape, right shape, count per step) of every matmul in one forward + backward of the encoder."""
    out = []
    for name, fan_in, fan_out, count in (("attention q/k/v/o", hidden, hidden, 4), ("MLP up", hidden, intermediate, 1),
                                         ("MLP down", intermediate, hidden, 1)):
        out += [(f"{name} forward", (tokens, fan_in), (fan_in, fan_out), count * layers),
                (f"{name} input grad", (tokens, fan_out), (fan_out, fan_in), count * layers),
                (f"{name} weight grad", (fan_out, tokens), (tokens, fan_in), count * layers)]
    sequences, head_dim = max(1, tokens // length), hidden // heads
    scores = ((sequences * heads, length, head_dim), (sequences * heads, head_dim, length))
    context = ((sequences * heads, length, length), (sequences * heads, length, head_dim))
    # forward S = q k^T, O = p v; backward dP = dO v^T (the scores' shape), dv = p^T dO, dq = dS k, dk = dS^T q
    out += [("attention scores' shape (S, dP)", *scores, 2 * layers),
            ("attention context's shape (O, dv, dq, dk)", *context, 4 * layers)]
    return out


def flops(left: tuple[int, ...], right: tuple[int, ...]) -> int:
    batch = left[0] if len(left) == 3 else 1
    return 2 * batch * left[-2] * left[-1] * right[-1]


def seconds_per_call(left: torch.Tensor, right: torch.Tensor, repeats: int) -> float:
    """Seconds of one product in the fastest of `repeats` loops of calls, after a warm-up that also sizes the loop."""
    started, calls = time.perf_counter(), 0
    while time.perf_counter() - started < LOOP_SECONDS or calls < 3:
        torch.matmul(left, right)
        calls += 1
    per_loop = max(1, int(calls * LOOP_SECONDS / (time.perf_counter() - started)))
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(per_loop):
            torch.matmul(left, right)
        samples.append((time.perf_counter() - started) / per_loop)
    return min(samples)


def ceiling(tokens: int, args: argparse.Namespace, peak: float) -> dict:
    generator = torch.Generator().manual_seed(0)
    rows, total_flops, total_seconds = [], 0, 0.0
    for name, left_shape, right_shape, count in step_matmuls(tokens, args.length, args.hidden, args.intermediate,
                                                             args.heads, args.layers):
        left = torch.randn(left_shape, generator=generator).to(torch.bfloat16)
        right = torch.randn(right_shape, generator=generator).to(torch.bfloat16)
        seconds = seconds_per_call(left, right, args.repeats)
        work = flops(left_shape, right_shape)
        rows.append({"matmul": name, "left": list(left_shape), "right": list(right_shape), "per_step": count,
                     "tflops": work / seconds / 1e12, "share_of_peak": work / seconds / peak})
        total_flops, total_seconds = total_flops + work * count, total_seconds + seconds * count
    return {"tokens": tokens, "length": args.length, "matmul_seconds_per_step": total_seconds,
            "matmul_tflops": total_flops / total_seconds / 1e12, "mfu_ceiling": total_flops / total_seconds / peak,
            "matmuls": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1102, 4096, 16384])
    parser.add_argument("--length", type=int, default=34)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cpu = torch.device("cpu")
    first = measured_peak(cpu, "bf16")  # the loop's own MFU peak (cached per machine and threads, only ever raised)
    runs = [ceiling(tokens, args, first) for tokens in args.tokens]
    peak = max(first, time_matmul(cpu, "bf16", MATMUL_SIDE, args.repeats))  # re-timed after: the machine's speed varies
    for run in runs:
        for row in [run, *run["matmuls"]]:
            key = "mfu_ceiling" if row is run else "share_of_peak"
            row[key] *= first / peak
    result = {"threads": torch.get_num_threads(), "peak_tflops": peak / 1e12, "model": {
        k: getattr(args, k) for k in ("hidden", "intermediate", "heads", "layers")}, "runs": runs}
    print(f"bf16 matmul peak {peak / 1e12:.2f} TFLOP/s at {result['threads']} threads (2048-square, core/peak.py)")
    for run in result["runs"]:
        print(f"\n{run['tokens']} tokens per micro-batch (length {run['length']}): the step's matmuls alone "
              f"{run['matmul_tflops']:.3f} TFLOP/s = MFU ceiling {run['mfu_ceiling']:.3f}")
        for row in run["matmuls"]:
            print(f"  {row['matmul']:<32} {str(row['left']):>16} @ {str(row['right']):<16} x{row['per_step']:<3} "
                  f"{row['tflops']:.3f} TFLOP/s ({row['share_of_peak']:.0%})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
