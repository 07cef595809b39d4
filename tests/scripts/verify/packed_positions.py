"""Seeded bug: a packing collator of the user's own that numbers positions across the whole row (0, 1, ..., len - 1)
instead of restarting them at every example. transformers finds where a packed example starts from the position-id
restarts; without them it builds one causal mask over the row, so each example attends to the examples packed
before it (and sits at positions it never has alone): a packed step is not the padded step of the same examples.
verify's packing check flags it.

The twin batches with the project's PackedCollator (positions restart at every example, no attention_mask,
use_cache=False, each example's first label -100).

The task: a tiny GPT-2 (sdpa attention, no dropout) on sequences of 3 to 40 tokens, trained with the token-sum loss
(accel_train.default_loss). `--packing` packs them into rows of 64 tokens (best-fit decreasing, the recipes'
pack_examples); `--padding_free` writes each micro-batch as one row; neither: right-padded batches. The flags have
the text recipes' names, so verify reads them from the run's config.yaml as it does the recipes'.
"""

from dataclasses import dataclass

import datasets
import torch
from common import parse, run
from transformers import GPT2Config, GPT2LMHeadModel

from accel_train import default_loss, run_cli
from accel_train.tasks.text.generation import PackedCollator, TrainCollator, pack_examples

VOCAB = 32
WIDTH = 64  # tokens per packed row
POSITIONS = 512  # room for a padding-free row of 8 sequences, numbered across the row as the bug does


@dataclass(frozen=True)
class PackingArgs:
    fixed: bool = False  # the twin: the project's PackedCollator
    num_samples: int = 48
    max_train_samples: int | None = None  # the first N sequences
    packing: bool = False
    padding_free: bool = False


def sequences(n: int) -> datasets.Dataset:
    """Sequence `i`: 3 to 40 tokens, a function of the index alone; every token is learned."""
    ids = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        length = 3 + int(torch.randint(0, 38, (1,), generator=g))
        ids.append(torch.randint(1, VOCAB, (length,), generator=g).tolist())
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})


class RowPositions(PackedCollator):
    """The bug: the collator's rows with positions counted over the whole row, not per example."""

    def __call__(self, rows):
        batch = super().__call__(rows)
        width = batch["input_ids"].shape[1]
        batch["position_ids"] = torch.arange(width).expand_as(batch["input_ids"]).clone()
        return batch


def tiny_gpt2() -> torch.nn.Module:
    config = GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        attn_implementation="sdpa")
    return GPT2LMHeadModel(config)


def main(argv=None):
    config, args = parse(argv, PackingArgs)
    examples = sequences(args.num_samples)
    if args.max_train_samples is not None:
        examples = examples.select(range(min(args.max_train_samples, len(examples))))
    collator_class = PackedCollator if args.fixed else RowPositions
    if args.packing:
        rows, collator = pack_examples(examples, WIDTH).rows, collator_class(0)
    elif args.padding_free:
        rows, collator = examples, collator_class(0, flatten=True)
    else:
        rows, collator = examples, TrainCollator(0)
    run(config, args, rows, default_loss(), make_model=tiny_gpt2, collate_fn=collator, shuffle=False)


if __name__ == "__main__":
    run_cli(main)
