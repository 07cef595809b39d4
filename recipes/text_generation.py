"""Train a text generator — a seq2seq model or a causal LM, chosen from the model config — and score what it writes.

    accelerate launch recipes/text_generation.py          # DEMO: rule-GENERATED dates -> "21 march 1987", ~2.5 min
    accelerate launch recipes/text_generation.py --config recipes/configs/textgen_ag_headlines.yaml        # AG News
    accelerate launch recipes/text_generation.py --config recipes/configs/textgen_ag_headlines_llama.yaml  # tiny Llama
    accelerate launch recipes/text_generation.py --model_name_or_path t5-small --dataset_name cnn_dailymail \
        --dataset_config_name 3.0.0 --text_column article --summary_column highlights --source_prefix "summarize: "
    accelerate launch recipes/text_generation.py --model_name_or_path HuggingFaceTB/SmolLM2-135M-Instruct \
        --train_file chats.jsonl --messages_column messages --mixed_precision bf16 --gradient_checkpointing

Data: --text_column / --summary_column (source -> target), --prompt_column / --completion_column, or
--messages_column (chat template; the loss on every assistant reply unless --train_on_prompt), or --text_column
alone (causal language modelling in --block_size blocks). Model: --model_name_or_path, a new one from
--config_name / --model_type (+ --config_overrides, --train_tokenizer_vocab_size), or by default an
encoder-decoder warm-started from all-MiniLM-L6-v2; --lora_r for a LoRA adapter (peft; --merge_lora). Every
evaluation reports the teacher-forced token loss and perplexity (the plain NLL, whatever --label_smoothing_factor);
once the final model is written, the run generates for --max_generate_samples validation items, scores the text
against the raw references (ROUGE-1/2/L/Lsum, BLEU, sacreBLEU, exact match, generated length, repeated trigrams)
and against what the tokenizer writes of them (*_vs_round_trip: the start-up report says which share of the
targets the tokenizer can write at all), writes predictions.jsonl and warns when the outputs collapsed. With
--overfit_batches N it generates for the N memorised batches instead.
"""

from __future__ import annotations

from accelerate.utils import gather_object

from accel_train import (
    ModelError,
    TrainConfig,
    build_accelerator,
    default_loss,
    load_metric,
    make_loader,
    pad_multiple,
    parse_with_defaults,
    run_cli,
    train,
)
from accel_train.tasks.text.buckets import allow_recompiles, resolve_buckets
from accel_train.tasks.text.generation import (
    GENERATION_SCORES,
    GenerationArguments,
    GenerationDataArguments,
    GenerationFinish,
    GenerationModelArguments,
    Generator,
    MergeLora,
    TrainCollator,
    build_generation_model,
    check_best_metric,
    check_packing_flags,
    config_is_seq2seq,
    default_batching,
    evaluate_generation,
    load_raw_data,
    load_tokenizer,
    loss_chunk,
    model_facts,
    packing_width,
    refuse_deepspeed,
    resolve_columns,
    round_trip_line,
    tokenize_splits,
    training_set,
    training_texts,
    vocabulary_digest,
)

DEFAULTS = dict(output_dir="outputs/text_generation", num_train_epochs=3, per_device_train_batch_size=32,
                per_device_eval_batch_size=64, learning_rate=3e-4, weight_decay=0.01, warmup_steps=0.05,
                logging_steps=20, eval_strategy="epoch", save_strategy="epoch", save_total_limit=1)
# The encoder-decoder warm-started here (no model flag): the pretrained encoder stays frozen, dropout is off, batches
# of 16 at 5e-4. On rule-generated tasks of a user's own (benchmarks/textgen_user_tasks.py, 8,000 pairs, 2 epochs)
# the encoder trained at 3e-4 or 1e-4 made every input give one output; frozen, with dropout, at 3e-4 x 32 the
# numbers task reached 10% exact match, with these settings 67% (benchmarks/text_generation.md).
WARM_START_DEFAULTS = dict(freeze_encoder=True, learning_rate=5e-4, per_device_train_batch_size=16,
                           config_overrides="hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0")
# The demo (no data flag): short dates, 8,000 pairs, 1 epoch.
DEMO_DEFAULTS = dict(text_column="text", summary_column="summary", max_source_length=24, max_target_length=12,
                     generation_max_new_tokens=12, num_train_epochs=1, save_strategy="no")
CONFIG_TYPES = (TrainConfig, GenerationDataArguments, GenerationModelArguments, GenerationArguments)
METRICS = ("rouge", "bleu", "sacrebleu", "exact_match")


def load_data(data_args: GenerationDataArguments, model_args: GenerationModelArguments, seed: int):
    """Raw splits and what their columns mean for this model's family."""
    raw = load_raw_data(data_args, seed)
    seq2seq = config_is_seq2seq(model_args)
    check_packing_flags(data_args, seq2seq)
    return raw, resolve_columns(data_args, seq2seq, raw["train"].column_names)


def build_model(model_args: GenerationModelArguments, raw, task):
    """Tokenizer first (a new model's vocabulary is the tokenizer's), then the model."""
    tokenizer = load_tokenizer(model_args, lambda: training_texts(raw["train"], task))
    if model_args.train_tokenizer_vocab_size and len(set(gather_object([vocabulary_digest(tokenizer)]))) > 1:
        raise ModelError("the processes trained different tokenizers from the same texts; train it once, save it "
                         "and pass --tokenizer_name.")
    return build_generation_model(model_args, tokenizer), tokenizer


def build_loss(config: TrainConfig, chunk_size: int = 0):
    """The loop's default loss: per-sequence token cross-entropy sums and counts (-100 ignored, the causal shift taken):
    each step the token mean of the whole step, eval_loss token-weighted; `chunk_size`: in chunks of hidden states."""
    return default_loss(config.label_smoothing_factor, chunk_size)


def build_metrics(accelerator, model, generator, modules):
    """With --predict_with_generate, generation scores at every evaluation (the token loss and perplexity come from
    the loop: the default loss returns per-sequence token sums and counts)."""
    if generator is None:
        return None

    def metrics_fn(outputs):
        return evaluate_generation(generator, accelerator, model, modules, "eval")[0]
    metrics_fn.metric_names = [f"eval_{name}" for name in GENERATION_SCORES]
    return metrics_fn


def parse(argv=None):
    """The four configs; the warm-started model's defaults when no model is named, the demo's when no data is."""
    def more(configs):
        data_args, model_args = configs[1], configs[2]
        named = model_args.model_name_or_path or model_args.config_name or model_args.model_type
        return {**({} if named else WARM_START_DEFAULTS),
                **({} if data_args.train_file or data_args.dataset_name else DEMO_DEFAULTS)}
    return parse_with_defaults(CONFIG_TYPES, argv, DEFAULTS, more)


def main(argv=None) -> dict[str, float]:
    config, data_args, model_args, gen_args = parse(argv)
    check_best_metric(config, gen_args.predict_with_generate)
    accelerator = build_accelerator(config, static_shapes=bool(data_args.length_buckets))  # one graph per bucket
    refuse_deepspeed(accelerator)  # the token loss's sums: before minutes of loading a model and tokenizing
    demo = not (data_args.train_file or data_args.dataset_name)
    raw, task = load_data(data_args, model_args, config.seed)
    model, tokenizer = build_model(model_args, raw, task)
    facts = model_facts(model)
    with accelerator.main_process_first():
        splits = tokenize_splits(raw, tokenizer, data_args, task, facts, gen_args.generation_max_new_tokens)
    warm = not (model_args.model_name_or_path or model_args.config_name or model_args.model_type)
    accelerator.print(("DEMO: dates GENERATED by rules (not human data), rewritten in one form\n" if demo else "") +
                      (f"model: encoder-decoder warm-started from {model_args.encoder_decoder_from or 'MiniLM'}, "
                       f"encoder {'frozen' if model_args.freeze_encoder else 'trained'}, --config_overrides "
                       f"{model_args.config_overrides} (this model's defaults: --freeze_encoder false to train the "
                       "encoder)\n" if warm else "") +
                      f"data: {task.kind}, {'seq2seq' if facts.seq2seq else 'causal LM'} "
                      f"{type(accelerator.unwrap_model(model)).__name__}; " +
                      ", ".join(f"{k} {len(v.tokens)}" + (f" ({v.targets_cut} of {v.targets} targets cut to "
                                                          f"--max_target_length)" if v.targets_cut else "")
                                for k, v in splits.items()))
    width = packing_width(data_args, task, facts)  # the longest row this task makes
    buckets = resolve_buckets(data_args.length_buckets, width, pad_multiple(accelerator))
    allow_recompiles(buckets)  # a static graph per width, in training and in evaluation
    collator = TrainCollator(tokenizer.pad_token_id, pad_multiple(accelerator), buckets)
    train_set, eval_set = (splits[s].tokens.select_columns(["input_ids", "labels"]) for s in ("train", "validation"))
    config, batching = default_batching(config, accelerator, data_args, facts.seq2seq)  # a token budget, or why not
    rows = training_set(train_set, data_args, width, tokenizer.pad_token_id, pad_multiple(accelerator), model,
                        buckets, config.max_tokens_per_batch)  # padded (to buckets), packed, padding-free or a budget
    chunk, chunk_note = loss_chunk(model_args, model, accelerator.distributed_type.value)
    trips = round_trip_line({name: split.round_trip for name, split in splits.items() if split.round_trip})
    for line in (rows.summary, batching, chunk_note, trips):  # trips: the ceiling of exact match on the raw targets
        if line:
            accelerator.print(line)
    modules = {name: load_metric(name) for name in METRICS}
    every_eval = (Generator(splits["validation"], tokenizer, facts.seq2seq, gen_args, config.per_device_eval_batch_size,
                            gen_args.max_generate_samples)
                  if gen_args.predict_with_generate and splits["validation"].can_generate else None)
    finish = [GenerationFinish(splits, tokenizer, facts.seq2seq, config, gen_args, modules, collator, rows)]
    if model_args.merge_lora:
        finish.append(MergeLora(model_args, tokenizer, config.output_dir))
    result = train(model, make_loader(rows.rows, config, train=True, collate_fn=rows.collator, lengths=rows.lengths,
                                      num_processes=accelerator.num_processes),
                   config=config, loss_fn=build_loss(config, chunk), accelerator=accelerator,
                   eval_loader=make_loader(eval_set, config, train=False, collate_fn=collator),
                   metrics_fn=build_metrics(accelerator, model, every_eval, modules), processing_class=tokenizer,
                   hooks=finish, extra_configs=[data_args, model_args, gen_args])
    prefix = "overfit" if config.overfit_batches else "eval"
    accelerator.print(f"\n{summary(result.metrics, prefix, gen_args.lead_baseline_words)}   -> {config.output_dir}")
    return dict(result.metrics)


def summary(m: dict, prefix: str, lead: int) -> str:
    def gen(p):
        return (f"ROUGE-1/2/L {m[f'{p}_rouge1']:.1f}/{m[f'{p}_rouge2']:.1f}/{m[f'{p}_rougeL']:.1f}, BLEU "
                f"{m[f'{p}_bleu']:.1f}, exact match {m[f'{p}_exact_match']:.1f}%, repeated trigram "
                f"{m[f'{p}_repeated_trigram_pct']:.1f}%")
    parts = [f"eval token loss {m['eval_loss']:.3f} (perplexity {m['eval_perplexity']:.1f})"] \
        if "eval_perplexity" in m else []
    if f"{prefix}_rouge1" in m:
        parts.append(f"{prefix} generation ({m[f'{prefix}_generated_items']:.0f} items): {gen(prefix)}")
    if f"{prefix}_lead{lead}_rouge1" in m:
        parts.append(f"lead-{lead} baseline: {gen(f'{prefix}_lead{lead}')}")
    return "\n".join(parts)


if __name__ == "__main__":
    run_cli(main)
