"""A tiny causal LM (GPT-2 from a config) on sequences of very different lengths, trained by the public API with the
default loss (per-token sums and counts). Run in-process or through the launcher by the token-loss tests.

With `--optim sgd --sgd_momentum 0 --learning_rate 1 --max_grad_norm 0 --max_steps 1` the first step moves every
parameter by exactly minus its gradient, which the tests compare with the one-big-batch token-mean gradient.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, Dataset

from accel_train import TrainConfig, build_accelerator, default_loss, make_loader, parse_config, run_cli, train

VOCAB = 32
LONGEST = 40  # sequences() makes 3 to 40 tokens


@dataclass(frozen=True)
class TokenArgs:
    num_sequences: int = 16
    eval_sequences: int = 12
    mask_all: bool = False  # every label is -100: no token counts
    save_initial: bool = False  # write the initial weights (the tests compute the reference gradient from them)
    sort_by_length: bool = False  # micro-batches of similar lengths, as length-grouped batching makes them
    stop_at_step: int = -1  # ask the loop to stop here (a clean interruption)
    pack_width: int = 0  # > 0: the sequences packed into rows of this many tokens (accel_train's --packing)
    padding_free: bool = False  # each micro-batch one row of its sequences (accel_train's --padding_free)
    loss_chunk_size: int = 0  # > 0: the default loss in chunks of this many tokens (chunked cross-entropy)
    spike_batch: int = -1  # the micro-batch of the sequences at this position (in order) has its loss x spike_scale
    spike_scale: float = 1e4
    without_batch: int = -1  # leave the sequences of this micro-batch position out (a run that never held them)
    length_buckets: str = ""  # "16,32,48" / "auto": batches padded by the text recipes' TrainCollator to buckets
    static_shapes: bool = False  # --torch_compile with one static graph per shape, buckets or not
    evaluate: bool = True  # false: no evaluation loader (no final evaluation either)
    mean_loss: bool = False  # the loss as a mean over the micro-batch's sequences of each one's token mean: one value
    # per example, as a classifier's (the contract's "loss"), not per-token sums


class StopAt:
    """Asks the loop to stop at `step` (once it saved); at the start of training, forgets what the loss saw before
    (a probe's batches): `fed` holds what training fed."""

    def __init__(self, step: int, fed: list | None = None):
        self.step, self.fed = step, fed if fed is not None else []

    def on_train_start(self, state):
        self.fed.clear()

    def on_save(self, state, path):
        return state.step == self.step


def tiny_lm(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return GPT2LMHeadModel(config)


def sequences(n: int, seed: int, sort_by_length: bool = False) -> list[list[int]]:
    """Lengths from 3 to 40 tokens: a token in a short sequence must not weigh more than one in a long one."""
    g = torch.Generator().manual_seed(seed)
    lengths = [3 + int(torch.randint(0, 38, (1,), generator=g)) for _ in range(n)]
    if sort_by_length:
        lengths.sort()
    return [torch.randint(1, VOCAB, (length,), generator=g).tolist() for length in lengths]


class Sequences(Dataset):
    def __init__(self, rows: list[list[int]]):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def collate(mask_all: bool = False):
    """Right padding with 0; labels -100 on padding (and everywhere with mask_all)."""

    def fn(rows):
        longest = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), longest, dtype=torch.long)
        mask = torch.zeros(len(rows), longest, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row)
            mask[i, :len(row)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        if mask_all:
            labels[:] = -100
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return fn


def bucketed(spec: str):
    """The text_generation recipe's TrainCollator with --length_buckets `spec` (rows of at most 40 tokens)."""
    from accel_train.tasks.text.buckets import allow_recompiles, resolve_buckets
    from accel_train.tasks.text.generation.tokens import TrainCollator

    buckets = resolve_buckets(spec, LONGEST, None)
    allow_recompiles(buckets)
    collator = TrainCollator(0, None, buckets)
    return lambda rows: collator([{"input_ids": r, "labels": r} for r in rows])


def packed_rows(rows: list[list[int]], width: int):
    """The sequences as an input_ids / labels dataset, packed into rows of `width` tokens."""
    import datasets

    from accel_train.tasks.text.generation.packing import pack_examples

    return pack_examples(datasets.Dataset.from_dict({"input_ids": rows, "labels": rows}), width)


def packed_loader(rows: list[list[int]], args: TokenArgs, batch_size: int) -> DataLoader:
    from accel_train.tasks.text.generation.packing import PackedCollator

    data = packed_rows(rows, args.pack_width).rows if args.pack_width else \
        [{"input_ids": r, "labels": r} for r in rows]
    return DataLoader(data, batch_size=batch_size, shuffle=False,
                      collate_fn=PackedCollator(0, flatten=args.padding_free))


def reference_gradient(model, rows: list[list[int]], per_sequence: bool = False) -> dict[str, torch.Tensor]:
    """∇ (Σ token losses / number of tokens) over all rows in one batch: the step gradient to match; `per_sequence`:
    ∇ of the mean over the rows of each row's token mean (--mean_loss)."""
    batch = collate()(rows)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    counted = (labels != -100).sum(dim=1)
    loss = (losses.sum(dim=1) / counted).mean() if per_sequence else losses.sum() / counted.sum()
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def main(argv=None):
    quiet = {"report_to": ["none"], "disable_tqdm": True, "run_report": False, "save_strategy": "no"}
    config, args = parse_config((TrainConfig, TokenArgs), argv, defaults=quiet)
    accelerator = build_accelerator(config, static_shapes=args.static_shapes or bool(args.length_buckets))
    model = tiny_lm()
    out = Path(config.output_dir)
    if args.save_initial and accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.clone() for k, v in model.state_dict().items()}, str(out / "initial.safetensors"))
    rows = sequences(args.num_sequences, 0, args.sort_by_length)
    size = config.per_device_train_batch_size * accelerator.num_processes
    spiked = sum(map(sum, rows[args.spike_batch * size:(args.spike_batch + 1) * size])) if args.spike_batch >= 0 else -1
    if config.max_tokens_per_batch:  # --max_tokens_per_batch: the plan's batches over the sequences' lengths
        train_loader = make_loader(Sequences(rows), config, train=True, lengths=list(map(len, rows)),
                                   collate_fn=collate(args.mask_all), num_processes=accelerator.num_processes)
        plan = train_loader.batch_sampler.epoch_batches(0)  # spike_batch: this micro-batch of epoch 0's plan
        spiked = sum(sum(rows[i]) for i in plan[args.spike_batch]) if args.spike_batch >= 0 else -1
    if args.without_batch >= 0:
        rows = rows[:args.without_batch * size] + rows[(args.without_batch + 1) * size:]
    collator = bucketed(args.length_buckets) if args.length_buckets else collate(args.mask_all)
    if not config.max_tokens_per_batch:
        train_loader = DataLoader(Sequences(rows), batch_size=config.per_device_train_batch_size, shuffle=False,
                                  collate_fn=collator)
    if args.pack_width or args.padding_free:
        train_loader = packed_loader(rows, args, config.per_device_train_batch_size)
    eval_loader = DataLoader(Sequences(sequences(args.eval_sequences, 1)),
                             batch_size=config.per_device_eval_batch_size, collate_fn=collate())
    base = default_loss(0.0, args.loss_chunk_size)
    fed: list[list[int]] = []  # each training micro-batch: [sum of its token ids, its real tokens] (what was fed)

    @functools.wraps(base)  # keeps the default loss's attributes
    def loss_fn(model, batch):
        if not model.training:
            return base(model, batch)
        real = batch["labels"].ne(-100) | batch["input_ids"].ne(0)
        fed.append([int(batch["input_ids"].sum()), int(real.sum())])
        out = base(model, batch)
        if fed[-1][0] == spiked:  # the spiked micro-batch (identified by its content: padding adds 0)
            out = {**out, "loss_sum": out["loss_sum"] * args.spike_scale}
        if args.mean_loss:  # per-sample sums and counts [B] -> the mean over the micro-batch's sequences
            return {"loss": (out["loss_sum"] / out["num_items"].clamp(min=1)).mean()}
        return out

    result = train(model, train_loader, config=config, eval_loader=eval_loader if args.evaluate else None,
                   accelerator=accelerator, loss_fn=loss_fn, hooks=[StopAt(args.stop_at_step, fed)],
                   extra_configs=[args])
    if accelerator.is_main_process:
        (out / "token_results.json").write_text(json.dumps(result.metrics))
    record = {"fed": fed, "metrics": result.metrics, "step": result.state.step, "samples": result.state.samples_seen}
    name = f"token_rank{accelerator.process_index}_{os.getpid()}_{time.time_ns()}.json"  # one file per run
    Path(config.output_dir, name).write_text(json.dumps(record))
    return result


if __name__ == "__main__":
    run_cli(main)
