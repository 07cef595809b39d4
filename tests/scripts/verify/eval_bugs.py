"""Seeded bugs of the evaluation check, each behind its own name in --bugs (the fixed twins: --fixed true). A tiny
token classifier (embedding, mean-pool, linear) on sequences of 3 to 12 tokens, padded per batch to its longest row:

    metric_before_gather  accuracy counted in the loss function on each process, as a batch goes by, and turned into
                          the metric from those local counts: with 2 processes the main process reports its own share
                          of the evaluation set. The twin computes it in metrics_fn from the gathered outputs.
    dropout_in_eval       F.dropout(..., training=True): the masks are drawn in evaluation too, so two evaluations of
                          the same weights differ. The twin passes training=self.training.
    ignores_mask          the mean-pool over every position, padding included: a row's output depends on the longest
                          row batched with it, so another evaluation batch size gives other metrics. The twin pools
                          over the real tokens (attention_mask).

Each bug is seen by one comparison of the check (again, batch size, world size) that the others' bugs would also
move: one bug per verify run.
"""

from dataclasses import dataclass

import torch
from common import parse, run
from torch.utils.data import DataLoader, Dataset

from accel_train import run_cli

BUGS = ("metric_before_gather", "dropout_in_eval", "ignores_mask")
VOCAB, PAD = 20, 0


@dataclass(frozen=True)
class EvalBugArgs:
    bugs: str = ""  # comma-separated, of BUGS
    fixed: bool = False  # the twin: the same script with the named bugs fixed
    num_samples: int = 64
    eval_samples: int = 44  # not a multiple of the batch: the last batch is smaller, and 2 processes fill it


class Sentences(Dataset):
    """Sequence i: 3 to 12 token ids in 1..VOCAB-1 drawn from i alone; label 1 when low ids are the majority."""

    def __init__(self, n: int, offset: int):
        self.n, self.offset = n, offset

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(f"sentence {i} of {self.n}")
        g = torch.Generator().manual_seed(self.offset + i)
        ids = torch.randint(1, VOCAB, (int(torch.randint(3, 13, (1,), generator=g)),), generator=g)
        return {"input_ids": ids, "labels": ((ids < VOCAB // 2).float().mean() > 0.5).long()}


def pad(items):
    """Dynamic padding: each batch to its own longest row, with the attention mask."""
    width = max(len(item["input_ids"]) for item in items)
    ids = torch.full((len(items), width), PAD)
    mask = torch.zeros(len(items), width, dtype=torch.long)
    for row, item in enumerate(items):
        ids[row, :len(item["input_ids"])] = item["input_ids"]
        mask[row, :len(item["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.stack([item["labels"] for item in items])}


class Pooled(torch.nn.Module):
    def __init__(self, ignores_mask: bool, dropout_in_eval: bool):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, 2)
        self.ignores_mask, self.dropout_in_eval = ignores_mask, dropout_in_eval

    def forward(self, input_ids, attention_mask):
        hidden = torch.tanh(self.embed(input_ids))
        if self.ignores_mask:  # the bug: the padding's embedding is averaged in
            pooled = hidden.mean(1)
        else:
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1)
        # the bug: training=True draws masks in evaluation too
        pooled = torch.nn.functional.dropout(pooled, 0.2, training=self.dropout_in_eval or self.training)
        return self.head(pooled)


class Counts:
    """Accuracy counted as the batches go by, on this process only (the metric_before_gather bug)."""

    def __init__(self):
        self.correct = self.total = 0

    def add(self, logits, labels):
        self.correct += int((logits.argmax(-1) == labels).sum())
        self.total += len(labels)

    def take(self) -> float:
        value = self.correct / max(self.total, 1)
        self.correct = self.total = 0
        return value


def main(argv=None):
    config, args = parse(argv, EvalBugArgs)
    bugs = {name.strip() for name in args.bugs.split(",") if name.strip()}
    if bugs - set(BUGS):
        raise SystemExit(f"--bugs: unknown {sorted(bugs - set(BUGS))}; choose among {', '.join(BUGS)}")
    buggy = set() if args.fixed else bugs
    counts = Counts()

    def loss_fn(model, batch):
        logits = model(batch["input_ids"], batch["attention_mask"])
        losses = torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="none")
        if "metric_before_gather" in buggy and not model.training:
            counts.add(logits, batch["labels"])  # the bug: this process's batches only
        return {"loss": losses.mean(), "per_sample_loss": losses, "logits": logits}

    def metrics_fn(outputs):
        if "metric_before_gather" in buggy:
            return {"accuracy": counts.take()}
        return {"accuracy": (outputs["logits"].argmax(-1) == outputs["labels"]).float().mean()}

    evaluation = DataLoader(Sentences(args.eval_samples, 10_000), batch_size=config.per_device_eval_batch_size,
                            collate_fn=pad)
    run(config, args, Sentences(args.num_samples, 0), loss_fn, collate_fn=pad, eval_loader=evaluation,
        metrics_fn=metrics_fn,
        make_model=lambda: Pooled("ignores_mask" in buggy, "dropout_in_eval" in buggy))


if __name__ == "__main__":
    run_cli(main)
