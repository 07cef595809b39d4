"""Causal-LM fine-tuning throughput: this project's recipe (recipes/text_generation.py) against TRL's SFTTrainer, on
the same tiny Llama (the same initial weights), the same tokenizer and the same token ids; writes
benchmarks/LM_THROUGHPUT.md (the machine, the commands, ratios ours / TRL).

    pip install -e ".[bench]"                                 # TRL, the peer
    python benchmarks/lm_throughput.py                        # every row, one after another: alone on the machine
    python benchmarks/lm_throughput.py --rows a,b             # some rows: a, g, r, b, w, c, ce, loss
    python benchmarks/lm_throughput.py --quick --rows a --output /tmp/lm.md   # smoke test: 300 training examples
    LM_THROUGHPUT_SEED=43 python benchmarks/lm_throughput.py --rows b --output /tmp/b43.md   # another seed

Rows (every run in a fresh subprocess of its own, never two at once):
  a   both unpacked: the recipe's defaults (length-grouped batches of 16) vs SFTTrainer packing=False,
      padding_free=False (its default random batches of 16)
  g   SFTTrainer unpacked with its own length grouping (train_sampling_strategy="group_by_length"): TRL at its best
  r   the recipe unpacked in random order (--group_by_length false): the padded run packing replaces
  b   both packed into rows of 256 tokens: recipe --packing --max_seq_length 256 vs SFTTrainer packing=True
      (packing_strategy "bfd", max_length 256); rows per batch chosen for the unpacked run's real tokens per step
  w   the recipe packed into rows of 512 (2 rows a batch): less padding, longer attention
  c   padding-free batches of 16: recipe --padding_free vs SFTTrainer padding_free=True (no packing)
  ce  the recipe alone, chunked cross-entropy: a 32k-vocabulary model, language modelling in 1024-token blocks,
      batch 4, --loss_chunk_size 0 vs 512, a few --max_steps: step time and peak memory
  loss  the training step of that model alone, full logits vs chunks of 512 and 1024: the step's own peak memory

Data: AG News (test.csv, 7,600 rows): prompt = description + "\\nTitle:", completion = title + eos, 200 items held out,
the recipe's textgen_ag_headlines_llama.yaml settings (train_on_prompt, max_source_length 96, max_target_length 32,
a byte-level BPE of 8,000 trained on the training texts, Llama 256 x 4 layers). The benchmark trains the tokenizer
and builds the model once, saves both, and both tools load that folder; TRL gets the recipe's own token ids
(`input_ids` + `labels` columns, which SFTTrainer uses as they are). Real tokens = the non-pad tokens of one epoch,
counted from the data (the same number for both tools) / the tool's own train_runtime. Eval loss = one function
(the recipe's token_loss, bf16 autocast) on the final model of every run: the completion tokens of the 200 items.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "recipes")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

CSV = ROOT.parent / "shared" / "data" / "ag-news-test" / "test.csv"
THREADS, BATCH, SEQ, LR, QUICK_EXAMPLES = 2, 16, 256, 1e-3, 300
# The seed of everything (tokenizer data split, initial weights, data order) in both tools; the children inherit it
SEED = int(os.environ.get("LM_THROUGHPUT_SEED", "42"))
# LM_THROUGHPUT_GPU=1 (benchmarks/gpu_lm_check.sh): a GPU machine, a GPT-2-124M-shaped model from a config (vocabulary
# 50,257, 1,024 positions), batches of LM_THROUGHPUT_BATCH, no CPU thread setting, and an MFU column
GPU = os.environ.get("LM_THROUGHPUT_GPU") == "1"
if os.environ.get("LM_THROUGHPUT_BATCH"):
    BATCH = int(os.environ["LM_THROUGHPUT_BATCH"])
CE_BATCH, CE_BLOCK, CE_VOCAB, CE_CHUNK = 4, 1024, 32000, 512
LOSS_CHUNKS, LOSS_REPEATS = (0, 512, 1024), 5
LLAMA = ("hidden_size=256,intermediate_size=688,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=4,"
         "tie_word_embeddings=true")
# The recipe's data settings (textgen_ag_headlines_llama.yaml): built into GenerationDataArguments here and into
# the recipe's flags, so both tools read the same rows and cut them the same way.
PAIRS = dict(train_file=str(CSV), column_names="label,title,description", prompt_column="description",
             completion_column="title", prompt_suffix="\nTitle:", train_on_prompt=True, validation_split=200,
             max_source_length=96, max_target_length=32)
HYPER = ["--num_train_epochs", "1", "--learning_rate", str(LR), "--lr_scheduler_type", "cosine", "--warmup_steps",
         "0.05", "--weight_decay", "0.1", "--optim", "adamw", "--mixed_precision", "bf16", "--seed", str(SEED),
         "--eval_strategy", "no", "--save_strategy", "no", "--max_generate_samples", "0", "--report_to", "none",
         "--disable_tqdm", *([] if GPU else ["--cpu_threads", str(THREADS)]), "--overwrite_output_dir"]
GPT2_124M = "n_embd=768,n_layer=12,n_head=12,n_positions=1024,vocab_size=50257"


def flags(fields: dict) -> list[str]:
    return [x for key, value in fields.items() for x in ([f"--{key}"] if value is True else [f"--{key}", str(value)])]


def shell(argv: list[str]) -> str:
    """A command line to paste: the prompt suffix's newline written $'\\n' (one line of markdown)."""
    return " ".join("$'" + a.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'" if "\n" in a
                    else shlex.quote(a) for a in argv)


def pair_args(quick: bool):
    from accel_train.tasks.text.generation import GenerationDataArguments

    return GenerationDataArguments(**PAIRS, max_train_samples=QUICK_EXAMPLES if quick else None)


def recipe_splits(tokenizer, quick: bool):
    """The recipe's own tokenization of the pairs: {"train", "validation"} TokenizedSplits (validation labels on the
    completion only, as the recipe evaluates)."""
    from accel_train.tasks.text.generation import ModelFacts, load_raw_data, resolve_columns, tokenize_splits

    args = pair_args(quick)
    raw = load_raw_data(args, SEED)
    task = resolve_columns(args, False, raw["train"].column_names)
    return tokenize_splits(raw, tokenizer, args, task, ModelFacts(seq2seq=False, positions=128))


# ---------------------------------------------------------------------------------------------------- set-up
def build_assets(folder: Path, quick: bool) -> dict:
    """Train the tokenizer and build both models once (seeded), save them, and work out the plan every run reads:
    real tokens of an epoch, mean example length, rows per packed batch."""
    from transformers import AutoTokenizer, set_seed

    from accel_train.tasks.text.generation import (
        GenerationModelArguments,
        build_generation_model,
        load_raw_data,
        load_tokenizer,
        pack_examples,
        resolve_columns,
        training_texts,
    )

    args = pair_args(quick)
    raw = load_raw_data(args, SEED)
    task = resolve_columns(args, False, raw["train"].column_names)
    model_args = (GenerationModelArguments(model_type="gpt2", train_tokenizer_vocab_size=8000,
                                           config_overrides=GPT2_124M) if GPU else
                  GenerationModelArguments(model_type="llama", train_tokenizer_vocab_size=8000,
                                           config_overrides=LLAMA + ",max_position_embeddings=128"))
    tokenizer = load_tokenizer(model_args, lambda: training_texts(raw["train"], task))
    set_seed(SEED)
    model = build_generation_model(model_args, tokenizer)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    # the chunked-CE model: the same tokenizer, a 32k output layer (the logits chunking is about) and 1024 positions
    ce_args = GenerationModelArguments(model_type="llama", train_tokenizer_vocab_size=8000,
                                       config_overrides=f"{LLAMA},max_position_embeddings={CE_BLOCK},"
                                                        f"vocab_size={CE_VOCAB}")
    set_seed(SEED)
    build_generation_model(ce_args, tokenizer).save_pretrained(folder / "model_ce")
    tokenizer.save_pretrained(folder / "model_ce")
    loaded = AutoTokenizer.from_pretrained(folder / "model")
    splits = recipe_splits(loaded, quick)
    if splits["train"].tokens[:50]["input_ids"] != recipe_splits(tokenizer, quick)["train"].tokens[:50]["input_ids"]:
        raise SystemExit("the saved tokenizer tokenizes differently from the trained one: the comparison would not "
                         "be on the same token ids")
    lengths = [len(ids) for ids in splits["train"].tokens["input_ids"]]
    mean = sum(lengths) / len(lengths)
    plan = {"examples": len(lengths), "real_tokens": sum(lengths), "mean_length": mean,
            "validation_items": len(splits["validation"].tokens), "parameters": model.num_parameters(),
            "packed_rows": max(1, round(BATCH * mean / SEQ)), "grouped_padding": grouped_padding(lengths),
            "packed_padding": pack_examples(splits["train"].tokens, SEQ).padding_share}
    (folder / "plan.json").write_text(json.dumps(plan))
    return plan


def packed_rows(plan: dict, width: int) -> int:
    """Rows of `width` per packed batch: about the real tokens of an unpacked batch of 16."""
    return max(1, round(BATCH * plan["mean_length"] / width))


def random_padding(lengths: list[int], batch: int = BATCH) -> float:
    """The padding share of batches in a seeded random order, each padded to its longest row (what the recipe's
    sampler does without length grouping; its own permutation differs, the share hardly)."""
    import torch

    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(SEED)).tolist()
    batches = [order[i:i + batch] for i in range(0, len(order), batch)]
    return 1 - sum(lengths) / sum(len(b) * max(lengths[i] for i in b) for b in batches)


def grouped_padding(lengths: list[int]) -> float:
    """The padding share of the recipe's unpacked epoch, replayed: its LengthGroupedSampler (seeded with (seed,
    epoch 0), grouping by len(input_ids) + len(labels) as the recipe does) cut into batches of 16, each padded to
    its longest row (no multiple on a CPU)."""
    from accel_train.core.data import LengthGroupedSampler

    sampler = LengthGroupedSampler([2 * n for n in lengths], BATCH, SEED)
    sampler.set_epoch(0)
    order = list(sampler)
    batches = [order[i:i + BATCH] for i in range(0, len(order), BATCH)]
    positions = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    return 1 - sum(lengths) / positions


# ------------------------------------------------------------------------------------------ the runs (children)
def recipe_pairs(assets: Path, plan: dict, quick: bool, extra: list[str], packed: bool) -> dict:
    """The recipe on the pairs, in this (fresh) process: its results, its training peak, and the common eval loss of
    the model it wrote."""
    import text_generation
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from accel_train.tasks.text.generation.packing import pack_examples

    out = assets / "runs" / "_".join(["recipe", *(a.strip("-") for a in extra)])
    width = int(extra[extra.index("--max_seq_length") + 1]) if "--max_seq_length" in extra else SEQ
    batch = packed_rows(plan, width) if packed else BATCH
    # --generation_max_new_tokens: the YAML's 24, since the recipe checks that a prompt (96) and what could be
    # generated after it fit the 128 positions, even with generation off
    argv = [*flags(PAIRS), *(["--max_train_samples", str(QUICK_EXAMPLES)] if quick else []),
            "--model_name_or_path", str(assets / "model"), "--per_device_train_batch_size", str(batch),
            "--per_device_eval_batch_size", "64", "--generation_max_new_tokens", "24", "--logging_steps", "20",
            *HYPER, *extra, "--output_dir", str(out)]
    text_generation.main(argv)
    result = recipe_results(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    splits = recipe_splits(tokenizer, quick)
    result["eval_loss"] = completion_loss(model, splits["validation"], tokenizer.pad_token_id)
    if "--group_by_length" in extra:  # random batches: the padding of a seeded random order of the same lengths
        result["padding_share"] = random_padding([len(i) for i in splits["train"].tokens["input_ids"]])
    if packed:  # the packed rows in a seeded random order, batches padded to their longest row, as the collator does
        rows = [len(r) for r in pack_examples(splits["train"].tokens, width).rows["input_ids"]]
        result["padding_share"] = random_padding(rows, batch)
    result["command"] = "python recipes/text_generation.py " + shell(argv).replace(str(assets), "$ASSETS")
    return result


def recipe_results(out: Path) -> dict:
    """train_runtime (the step loop alone), steps, the recipe's own eval loss and, from metrics.jsonl, the peak
    resident memory up to the last training log (before the final evaluation) and the median logged step rate."""
    results = json.loads((out / "all_results.json").read_text())
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logs = [r for r in history if "loss" in r and "samples_per_second" in r]
    if not logs or "train_runtime" not in results:
        raise SystemExit(f"{out}: no training log records or no train_runtime in all_results.json")
    rates = [r["samples_per_second"] for r in logs[1:]] or [logs[0]["samples_per_second"]]  # the first has warm-up
    return {"train_runtime": results["train_runtime"], "steps": results["train_steps"],
            "own_eval_loss": results.get("eval_loss"),
            "train_peak_rss_mb": max(r.get("gpu_peak_memory_mb", r.get("cpu_peak_rss_mb", 0.0)) for r in logs),
            "samples_per_second": statistics.median(rates), "final_loss": logs[-1]["loss"]}


def recipe_lm(assets: Path, plan: dict, quick: bool, extra: list[str], packed: bool) -> dict:
    """The chunked-CE section: the 32k-vocabulary model on plain text in 1024-token blocks, a few steps (60 validation
    texts: the final evaluation is not what is measured)."""
    import text_generation

    out = assets / "runs" / "_".join(["lm", *(a.strip("-") for a in extra)])
    argv = ["--train_file", str(CSV), "--column_names", PAIRS["column_names"], "--text_column", "description",
            "--block_size", str(CE_BLOCK), "--validation_split", "200", "--max_eval_samples", "60",
            *(["--max_train_samples", str(QUICK_EXAMPLES)] if quick else []),
            "--model_name_or_path", str(assets / "model_ce"), "--max_steps", str(ce_steps(quick)),
            "--per_device_train_batch_size", str(CE_BATCH), "--per_device_eval_batch_size", str(CE_BATCH),
            "--logging_steps", "1", *HYPER, *extra, "--output_dir", str(out)]
    text_generation.main(argv)
    result = recipe_results(out)
    result["step_seconds"] = CE_BATCH / result.pop("samples_per_second")
    result["command"] = "python recipes/text_generation.py " + shell(argv).replace(str(assets), "$ASSETS")
    return result


def loss_step(assets: Path, plan: dict, quick: bool, chunk: int, packed: bool) -> dict:
    """One training step of the 32k-vocabulary model (forward, the loss, backward) on a batch of CE_BATCH x CE_BLOCK
    tokens, in this fresh process, as the recipe's loop runs it in bf16: the model prepared by Accelerate with
    mixed_precision bf16 (which autocasts its forward only), the loss called outside any autocast, so the chunks
    compute in the dtype the forward gives them (bf16), as in training. The peak resident memory above what the
    process held before the step (VmHWM lowered to the current use first) and the median time of the steps after
    one warm-up (LOSS_REPEATS; 1 with --quick). The loss is the recipe's: the default loss with `chunk` (0: the full
    logits)."""
    import time

    import torch
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from accel_train import default_loss
    from accel_train.core.meter import peak_memory, reset_cpu_peak_memory

    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = accelerator.prepare(AutoModelForCausalLM.from_pretrained(assets / "model_ce").train())
    generator = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, CE_VOCAB, (CE_BATCH, CE_BLOCK), generator=generator)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    loss_fn = default_loss(0.0, chunk)
    repeats = 1 if quick else LOSS_REPEATS
    times, peaks = [], []
    for repeat in range(repeats + 1):
        model.zero_grad(set_to_none=False)  # the gradients exist before the step: not counted as the loss's
        reset_cpu_peak_memory()
        before = peak_memory(torch.device("cpu"))["cpu_peak_rss_mb"]
        started = time.perf_counter()
        out = loss_fn(model, batch)  # no autocast here: the loop has none around the loss either
        accelerator.backward(out["loss_sum"].sum() / out["num_items"].sum())
        if repeat:  # the first is the warm-up
            times.append(time.perf_counter() - started)
            peaks.append(peak_memory(torch.device("cpu"))["cpu_peak_rss_mb"] - before)
        loss = float(out["loss_sum"].sum().detach() / out["num_items"].sum())
    return {"step_seconds": statistics.median(times), "step_peak_mb": statistics.median(peaks), "loss": loss,
            "repeats": repeats}


def ce_steps(quick: bool) -> int:
    return 2 if quick else 10


def trl_pairs(assets: Path, plan: dict, quick: bool, options: dict, packed: bool) -> dict:
    """SFTTrainer on the recipe's token ids and the same saved model, in this (fresh) process."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from accel_train.core.meter import peak_memory

    tokenizer = AutoTokenizer.from_pretrained(assets / "model")
    splits = recipe_splits(tokenizer, quick)
    model = AutoModelForCausalLM.from_pretrained(assets / "model", dtype=torch.float32)
    settings = trl_settings(plan["packed_rows"] if packed else BATCH, options)
    trainer = SFTTrainer(model=model, args=SFTConfig(output_dir=str(assets / "runs" / "trl"), **settings),
                         train_dataset=splits["train"].tokens.select_columns(["input_ids", "labels"]),
                         processing_class=tokenizer)
    # swapped in after construction: SFTTrainer refuses a custom collator with padding-free batches, and train()
    # builds its loader from this attribute
    counter = CountingCollator(trainer.data_collator)
    trainer.data_collator = counter
    out = trainer.train()
    if trainer.accelerator.mixed_precision != "bf16":
        raise SystemExit(f"SFTTrainer trained in {trainer.accelerator.mixed_precision}, not bf16 autocast")
    # VmHWM now (set-up and training, not the eval); on a GPU the allocator's peak, as the recipe reports it
    cpu_peak = peak_memory(torch.device("cpu"))["cpu_peak_rss_mb"]
    peak = torch.cuda.max_memory_allocated() / 2**20 if on_gpu() else cpu_peak
    counted = [r["num_tokens"] for r in trainer.state.log_history if "num_tokens" in r]
    return {"train_runtime": out.metrics["train_runtime"], "steps": out.global_step, "train_peak_rss_mb": peak,
            "padding_share": 1 - counter.real / counter.positions, "fed_tokens": counter.real,
            "trl_num_tokens": counted[-1] if counted else None, "final_loss": out.metrics.get("train_loss"),
            "eval_loss": completion_loss(model, splits["validation"], tokenizer.pad_token_id),
            "command": f"SFTConfig({', '.join(f'{k}={v!r}' for k, v in settings.items())})"}


def on_gpu() -> bool:
    import torch

    return GPU and torch.cuda.is_available()


def trl_settings(batch: int, options: dict) -> dict:
    """The recipe's hyperparameters in SFTConfig's words. SFTConfig's own defaults differ: activation checkpointing on,
    lr 2e-5, max_length 1024; every row's examples are at most 96 + 32 = 128 tokens, so max_length 128 cuts none."""
    base = dict(num_train_epochs=1, per_device_train_batch_size=batch, learning_rate=LR, lr_scheduler_type="cosine",
                warmup_steps=0.05, weight_decay=0.1, optim="adamw_torch", bf16=True, use_cpu=not on_gpu(), seed=SEED,
                logging_steps=20, eval_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True,
                activation_checkpointing=False, dataloader_num_workers=0, max_length=128)
    return {**base, **options}


class CountingCollator:
    """The trainer's own collator, counting the token positions it builds (padding included) and the real tokens in
    them: the padding share of the batches SFTTrainer actually fed."""

    def __init__(self, collate):
        self.collate, self.positions, self.real = collate, 0, 0

    def __call__(self, rows):
        batch = self.collate(rows)
        self.positions += batch["input_ids"].numel()
        mask = batch.get("attention_mask")  # padding-free batches have none: every position is a real token
        self.real += int(mask.sum()) if mask is not None else sum(len(r["input_ids"]) for r in rows)
        return batch


def completion_loss(model, validation, pad_token_id: int) -> float:
    """Token-mean cross-entropy on the validation completions (labels -100 on the prompt), by the recipe's own
    `token_loss` under bf16 autocast, as its evaluation runs: one function for the final model of every run."""
    import torch

    from accel_train.core.loss import token_loss
    from accel_train.tasks.text.generation import TrainCollator

    rows = validation.tokens.select_columns(["input_ids", "labels"])
    collate = TrainCollator(pad_token_id)
    total, count = 0.0, 0.0
    model.to("cpu").eval()  # the same device for every run (TRL leaves its model on the GPU)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for start in range(0, len(rows), 16):
            out = token_loss(model, collate([rows[i] for i in range(start, min(start + 16, len(rows)))]))
            total += float(out["loss_sum"].sum())
            count += float(out["num_items"].sum())
    return total / count


# name -> (runner, recipe flags or SFTConfig fields, packed batches); a row is the runs whose name starts "row/"
RUNS = {
    "a/recipe": (recipe_pairs, [], False),
    "r/recipe": (recipe_pairs, ["--group_by_length", "false"], False),
    "a/trl": (trl_pairs, {}, False),
    "g/trl": (trl_pairs, {"train_sampling_strategy": "group_by_length"}, False),
    "b/recipe": (recipe_pairs, ["--packing", "--max_seq_length", str(SEQ)], True),
    "w/recipe": (recipe_pairs, ["--packing", "--max_seq_length", str(2 * SEQ)], True),
    "b/trl": (trl_pairs, {"packing": True, "packing_strategy": "bfd", "max_length": SEQ}, True),
    # padding-free without packing: SFTTrainer wants max_length None then (the rows are already cut by the recipe)
    "c/recipe": (recipe_pairs, ["--padding_free"], False),
    "c/trl": (trl_pairs, {"padding_free": True, "max_length": None}, False),
    "ce/0": (recipe_lm, ["--loss_chunk_size", "0"], False),
    f"ce/{CE_CHUNK}": (recipe_lm, ["--loss_chunk_size", str(CE_CHUNK)], False),
    **{f"loss/{chunk}": (loss_step, chunk, False) for chunk in LOSS_CHUNKS},
}


def child(name: str, assets: Path, quick: bool) -> None:
    import torch

    torch.set_num_threads(THREADS)
    runner, options, packed = RUNS[name]
    result = runner(assets, json.loads((assets / "plan.json").read_text()), quick, options, packed)
    (assets / "results" / f"{name.replace('/', '_')}.json").write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------- the parent
def isolation_probe() -> dict:
    """Does a padding-free batch keep its documents apart on sdpa? Two documents flattened into one row by
    SFTTrainer's own collator (position_ids, no attention_mask); change the first and measure how far the second's
    logits move (0: transformers built a block-diagonal mask from the position_ids), with use_cache=False as
    SFTTrainer calls the model, and with the config's default: a cache is then made, and transformers looks for
    packed sequences only without one."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    collate = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    second = list(range(20, 27))
    batches = [collate([{"input_ids": first}, {"input_ids": second}]) for first in (list(range(5, 15)), [50] * 10)]
    inputs = [{k: v for k, v in b.items() if k != "labels"} for b in batches]
    out = {"keys": sorted(inputs[0])}
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([second]), use_cache=False).logits[0]
        for name, cache in (("no_cache", False), ("cache", None)):
            logits = [model(**x, use_cache=cache).logits[0, 10:] for x in inputs]
            out[name] = float((logits[0] - logits[1]).abs().max())
            out[f"{name}_vs_alone"] = float((logits[0] - alone).abs().max())
    return out


def run_child(name: str, assets: Path, quick: bool) -> dict:
    """One run in a fresh process (torch threads fixed): its result, and the process's peak resident set from
    wait4 (set-up, training and the evaluation)."""
    slug = name.replace("/", "_")
    log, result = assets / "logs" / f"{slug}.log", assets / "results" / f"{slug}.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--assets", str(assets),
               *(["--quick"] if quick else [])]
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS)}
    print(f"running {name} ...", flush=True)
    with log.open("w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        _, status, usage = os.wait4(process.pid, 0)  # the child's own rusage, not all children's so far
    code = os.waitstatus_to_exitcode(status)
    if code or not result.exists():
        text = log.read_text().strip().splitlines()
        print(f"{name} FAILED (exit {code}); the end of its log {log}:\n" + "\n".join(text[-15:]), flush=True)
        return {"error": text[-1][:160] if text else f"exit {code}"}
    out = json.loads(result.read_text())
    out["process_peak_rss_mb"] = usage.ru_maxrss / 1024  # KiB on Linux
    result.write_text(json.dumps(out))  # with the process's peak: what --reuse takes
    return out


ROWS = {"a": ("unpacked", ["a/recipe", "a/trl"]), "g": ("unpacked, TRL length-grouped", ["g/trl"]),
        "r": ("unpacked, the recipe in random order", ["r/recipe"]),
        "b": (f"packed into rows of {SEQ}", ["b/recipe", "b/trl"]),
        "w": (f"packed into rows of {2 * SEQ}", ["w/recipe"]), "c": ("padding-free", ["c/recipe", "c/trl"]),
        "ce": ("chunked cross-entropy", list(k for k in RUNS if k.startswith("ce/"))),
        "loss": ("the loss step alone", list(k for k in RUNS if k.startswith("loss/")))}
BATCHES = {"a/recipe": "{batch} examples, length-grouped (its default)",
           "a/trl": "{batch} examples, random order (its default)",
           "r/recipe": "{batch} examples, random order (--group_by_length false)",
           "g/trl": "{batch} examples, train_sampling_strategy=group_by_length",
           "b/recipe": "{rows} packed rows of <= 256, random order, padded to the longest",
           "w/recipe": "{wide} packed rows of <= 512, random order, padded to the longest",
           "b/trl": "{rows} packed rows of <= 256 (bfd), flattened into one row",
           "c/recipe": "{batch} examples, length-grouped, flattened",
           "c/trl": "{batch} examples, flattened (position_ids)"}
# The recipe's padding, from its own code on the same data, where the run itself did not record one: row a its
# length-grouped epoch replayed; packed rows (pack_examples) as if each were padded to the full width, an upper
# bound (the packed runs record their batches' padding: their rows in a seeded random order, each batch padded to
# its longest row); row c none (each batch one row, no multiple on a CPU)
RECIPE_PADDING = {"a/recipe": lambda p: f"{p['grouped_padding']:.1%}",
                  "b/recipe": lambda p: f"at most {p['packed_padding']:.1%}", "c/recipe": lambda p: "0.0%"}
OURS = {"a/trl": "a/recipe", "g/trl": "a/recipe", "b/trl": "b/recipe", "c/trl": "c/recipe"}  # TRL run -> ours
# Beside the ours / TRL ratios: packing against the recipe's own padded runs (the same data, tokens and model)
PACKING_RATIOS = (("b/recipe", "a/recipe"), ("b/recipe", "r/recipe"), ("w/recipe", "a/recipe"),
                  ("w/recipe", "r/recipe"), ("c/recipe", "a/recipe"))


def cell(value, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def pairs_table(results: dict, plan: dict) -> list[str]:
    pairs = {n: r for n, r in results.items() if not n.startswith(("ce/", "loss/"))}
    if not pairs:
        return []
    lines = ["| row | run | batches | steps | train s | real tokens/s | ours / TRL | padding share | peak RSS MB "
             "(training / process) | eval loss | recipe's own eval loss |", "|" + "---|" * 11]
    tps = {n: plan["real_tokens"] / r["train_runtime"] for n, r in results.items() if "train_runtime" in r}
    for row, (title, names) in ROWS.items():
        for name in (n for n in names if n in pairs):
            r, tool = results[name], "accel_train" if name.endswith("recipe") else "TRL"
            tool += " (earlier invocation, same machine, alone)" if r.get("reused") else ""
            if "error" in r:
                lines.append(f"| {row} {title} | {tool} | failed: {r['error']} |" + " |" * 8)
                continue
            padding = f"{r['padding_share']:.1%}" if "padding_share" in r else RECIPE_PADDING[name](plan)
            ours = OURS.get(name)
            ratio = f"{tps[ours] / tps[name]:.2f}x" if ours in tps else ""
            shape = BATCHES[name].format(rows=plan["packed_rows"], wide=packed_rows(plan, 2 * SEQ), batch=BATCH)
            lines.append(f"| {row} {title} | {tool} | {shape} | {r['steps']} "
                         f"| {r['train_runtime']:.1f} | {tps[name]:.0f} | {ratio} | {padding} | "
                         f"{r['train_peak_rss_mb']:.0f} / {cell(r.get('process_peak_rss_mb'))} | "
                         f"{r['eval_loss']:.4f} | {cell(r.get('own_eval_loss'), '.4f')} |")
    lines += ["", "Packing against the recipe's own padded runs (real tokens/s ratio; eval loss, difference):", ""]
    lines += [f"- {a} / {b}: {tps[a] / tps[b]:.2f}x; eval loss {results[a]['eval_loss']:.4f} vs "
              f"{results[b]['eval_loss']:.4f} ({results[a]['eval_loss'] / results[b]['eval_loss'] - 1:+.1%})"
              for a, b in PACKING_RATIOS if a in tps and b in tps]
    return lines


def chunk_rows(results: dict, row: str, columns, versus) -> list[str]:
    """One table line per run of `row` ("ce" or "loss"): the chunk size, `columns(r)`, and `versus(r, base)` against
    the full-logits run (chunk 0)."""
    base = results.get(f"{row}/0", {})
    lines = []
    for name in (n for n in ROWS[row][1] if n in results):
        r, chunk = results[name], name.split("/")[1]
        if "error" in r:
            lines.append(f"| {chunk} | failed: {r['error']} | | | |")
            continue
        compared = "" if chunk == "0" or "step_seconds" not in base else versus(r, base)
        lines.append(f"| {chunk} | {columns(r)} | {compared} |")
    return lines


def mfu_lines(results: dict, plan: dict) -> list[str]:
    """On a GPU: each run's model FLOP utilisation, 6 x parameters x real tokens/s over the device's dense bf16 peak
    (the datasheet's, accel_train.core.peak.datasheet_tflops), the same formula for both tools."""
    import torch

    if not GPU:
        return []
    if not torch.cuda.is_available():
        return ["MFU: LM_THROUGHPUT_GPU=1 without a GPU (a smoke test of the code path): none.", ""]
    from accel_train.core.peak import datasheet_tflops

    name = torch.cuda.get_device_name()
    peak = datasheet_tflops(name, "bf16")  # the exact device: an L40 is no L4, an H100 PCIe no SXM part
    if peak is None:
        return [f"MFU: no bf16 peak known for {name}.", ""]
    lines = [f"MFU on {name} (6 x {plan['parameters'] / 1e6:.0f}M parameters x real tokens/s / {peak} TFLOP/s):", ""]
    lines += [f"- {n}: {6 * plan['parameters'] * plan['real_tokens'] / r['train_runtime'] / (peak * 1e12):.1%}"
              for n, r in results.items() if "train_runtime" in r and not n.startswith(("ce/", "loss/"))]
    return [*lines, ""]


def ce_table(results: dict) -> list[str]:
    names = [n for n in ROWS["ce"][1] if n in results]
    if not names:
        return []
    steps = next((r["steps"] for r in map(results.get, names) if "steps" in r), "-")
    return [f"Chunked cross-entropy, the recipe alone: Llama 256 x 4 layers with a {CE_VOCAB:,}-token output layer, "
            f"language modelling on the descriptions (`--text_column description`) in blocks of {CE_BLOCK}, batch "
            f"{CE_BATCH}, {steps} steps, bf16 autocast. Step time: the median of the logged steps after the first.",
            "",
            "| --loss_chunk_size | step s | peak RSS MB (training / process) | loss at the last step | "
            "vs 0 (time, memory) |", "|---|---|---|---|---|",
            *chunk_rows(results, "ce",
                        lambda r: f"{r['step_seconds']:.2f} | {r['train_peak_rss_mb']:.0f} / "
                                  f"{cell(r.get('process_peak_rss_mb'))} | {r['final_loss']:.4f}",
                        lambda r, b: f"{r['step_seconds'] / b['step_seconds']:.2f}x, "
                                     f"{r['train_peak_rss_mb'] / b['train_peak_rss_mb']:.2f}x")]


def loss_table(results: dict) -> list[str]:
    names = [n for n in ROWS["loss"][1] if n in results]
    if not names:
        return []
    repeats = next((r["repeats"] for r in map(results.get, names) if "repeats" in r), LOSS_REPEATS)
    return [f"The training step alone (forward, loss, backward) of the same model on {CE_BATCH} x {CE_BLOCK} tokens, "
            "in bf16 as the recipe's loop runs it (the model prepared by Accelerate, which autocasts its forward; the "
            "loss called outside it, the chunks in the forward's bf16), each setting in a fresh process: the peak "
            "resident memory above the process's memory before the step (gradients already allocated) and the step "
            f"time, medians of {repeats} steps after a warm-up.", "",
            "| --loss_chunk_size | step s | step peak MB above its start | loss | vs full logits (time, memory) |",
            "|---|---|---|---|---|",
            *chunk_rows(results, "loss", lambda r: f"{r['step_seconds']:.2f} | {r['step_peak_mb']:.0f} | "
                                                   f"{r['loss']:.4f}",
                        lambda r, b: f"{r['step_seconds'] / b['step_seconds']:.2f}x, "
                                     f"{b['step_peak_mb'] / r['step_peak_mb']:.1f}x lower")]


def machine() -> str:
    import accelerate
    import torch
    import transformers
    import trl

    from accel_train.core.peak import cpu_info

    return (f"{cpu_info('model name') or platform.processor()}, {os.cpu_count()} cores, {THREADS} torch threads per "
            f"run; Python {platform.python_version()}, torch {torch.__version__}, transformers "
            f"{transformers.__version__}, accelerate {accelerate.__version__}, trl {trl.__version__}")


def header(plan: dict, quick: bool, probe: dict) -> list[str]:
    per_step = BATCH * plan["mean_length"]
    lines = ["# Causal-LM fine-tuning: accel_train's text_generation recipe vs TRL's SFTTrainer", ""]
    if quick:
        lines += ["**--quick smoke test: a few hundred examples, the machine possibly shared. Not results.**", ""]
    lines += [
        f"Machine: {machine()}. Every run in a fresh process of its own, one after another.", "",
        f"Data: AG News test.csv, {plan['examples']} training examples, {plan['validation_items']} validation items; "
        f"prompt = description + \"\\nTitle:\", completion = title + eos, trained on prompt and completion "
        f"(train_on_prompt), {plan['real_tokens']} real tokens an epoch, {plan['mean_length']:.1f} tokens an example. "
        f"Model: Llama 256 x 4 layers, {plan['parameters'] / 1e6:.1f}M parameters, tied embeddings, a byte-level BPE "
        "of 8,000 trained on the training texts: built once, saved, loaded by both tools (same initial weights). TRL "
        "gets the recipe's token ids (`input_ids` + `labels`, which SFTTrainer uses as they are).", "",
        f"Same for both: 1 epoch, AdamW (torch), lr {LR}, cosine, warmup 5%, weight decay 0.1, clip 1.0, bf16 "
        f"autocast, seed {SEED}, no checkpoints, no generation, no evaluation during training. Packed rows per batch: "
        f"16 x {plan['mean_length']:.1f} tokens = {per_step:.0f} real tokens per unpacked step, / {SEQ} = "
        f"{per_step / SEQ:.2f} -> {plan['packed_rows']} rows of <= {SEQ} tokens.", "",
        "Real tokens/s = the epoch's real tokens (counted from the data, the same for both) / the tool's own "
        "train_runtime (the recipe: its step loop; TRL: `trainer.train()`'s train_runtime, its loader set-up "
        "included); ours / TRL: the recipe's real tokens/s over TRL's in the same row (row g: over row a's recipe "
        "run). Padding share: TRL's counted in the batches it fed; the recipe's from its own code on the same data "
        "(row a: its length-grouped epoch replayed; r: batches of a seeded random order; b, w: the packed rows in a "
        "seeded random order, each batch padded to its longest row; c: none, one row per batch). Peak RSS: VmHWM "
        "up to the end of training (the recipe's last training log; TRL's right after train()) / the whole process "
        "(wait4). Eval loss: one function (the recipe's token_loss, bf16 autocast) on every run's final model, "
        "completion tokens of the validation items.", "",
        f"Attention isolation, TRL's padding-free batch on sdpa (keys {', '.join(probe['keys'])}; no "
        f"attention_mask): changing document 1 moves document 2's logits by {probe['no_cache']:.2g} with "
        f"use_cache=False, as SFTTrainer calls the model (vs document 2 alone: {probe['no_cache_vs_alone']:.2g}); "
        f"with the config's use_cache left on, by {probe['cache']:.2g}: transformers builds the block-diagonal mask "
        "from position_ids only when there is no cache.", ""]
    return lines


DIFFERENCES = [
    "What differs, on purpose or because the tools do:",
    "- Batch order: the recipe groups similar lengths by default; SFTTrainer draws random batches (row g gives it "
    "its own length grouping). Packing: SFTTrainer's bfd packs per map batch of 1,000 examples.",
    "- Loss: SFTTrainer always computes it with its fused LM head (trl add_fused_lm_head: log-probabilities in "
    "vocabulary chunks of 32,768, one chunk here; without Triton, on a CPU, it scores every position, masked ones "
    "included); the recipe from the full logits (its --loss_chunk_size default chunks only vocabularies of 32,000 "
    "and more). Both are the token mean of the optimizer step; both leave each example's first label unscored in "
    "packed and padding-free rows, as the shift does in padded ones.",
    "- train_runtime: the recipe times its step loop only (the loaders and the model are prepared before); "
    "Trainer's includes building its loader.",
]


def commands(results: dict) -> list[str]:
    lines = ["Commands ($ASSETS: the folder this script builds; the TRL runs are SFTTrainer(model, "
             "args=SFTConfig(...), train_dataset=<input_ids, labels>, processing_class=tokenizer)):", ""]
    lines += [f"- {name}: `{r['command']}`" for name, r in results.items() if "command" in r]
    return lines + ["", "Regenerate: `python benchmarks/lm_throughput.py` (alone on the machine)."]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="accel_train's text-generation recipe vs TRL's SFTTrainer: real "
                                     "tokens/s, padding, peak memory, eval loss (module docstring: the rows)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_EXAMPLES} training examples: a smoke test")
    parser.add_argument("--output", type=Path, default=None,
                        help="the markdown file (default: benchmarks/LM_THROUGHPUT.md; with --quick, none)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the models, logs and runs here")
    parser.add_argument("--reuse", action="store_true",
                        help="with --workdir: take the runs whose results are there already instead of running them "
                             "again (the table says which were reused)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--assets", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.assets, args.quick)
        return 0
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    output = args.output or (None if args.quick else ROOT / "benchmarks" / "LM_THROUGHPUT.md")
    with tempfile.TemporaryDirectory() as tmp:
        assets = args.workdir or Path(tmp)
        for sub in ("logs", "results", "runs"):
            (assets / sub).mkdir(parents=True, exist_ok=True)
        plan = (json.loads((assets / "plan.json").read_text()) if args.reuse and (assets / "plan.json").exists()
                else build_assets(assets, args.quick))
        probe = isolation_probe()
        results = {}
        for name in (n for row in rows for n in ROWS[row][1]):
            done = assets / "results" / f"{name.replace('/', '_')}.json"
            results[name] = {**json.loads(done.read_text()), "reused": True} if args.reuse and done.exists() \
                else run_child(name, assets, args.quick)
    text = "\n".join([*header(plan, args.quick, probe), *pairs_table(results, plan), "", *mfu_lines(results, plan),
                      *ce_table(results), "",
                      *loss_table(results), "",
                      *DIFFERENCES, "", *commands(results), ""])
    print("\n" + text)
    if output:
        output.write_text(text)
        print(f"-> {output}")
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
