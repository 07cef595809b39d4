"""Text classification for recipes (the nlp_finetune recipe): data, labels, tokens, flags and metrics, in one import.

    from accel_train.tasks.text.classification import (ClassificationDataArguments, load_text_files,
                                                       encode_labels, tokenize, classification_metrics, ...)

The pieces are this package's modules: `data` (data files, `datasets` names, the embedded tweet corpus, label
encoding, tokenization, padding statistics), `args` (the recipe's model and data flags), `eval` (metrics, the
training batches' padding, the test split's predictions at the finish seam), `head` (the loss, and a regression head
that predicts in fp32 under mixed precision).
"""

from .args import ClassificationDataArguments, ClassificationModelArguments
from .data import (
    DEFAULT_LABEL_COLUMNS,
    DEFAULT_TEXT_COLUMNS,
    FILE_BUILDERS,
    Labels,
    data_summary,
    embedded_tweets_path,
    encode_labels,
    headerless_hint,
    load_embedded_tweets,
    load_named_dataset,
    load_text_files,
    pad_with_eos,
    padding_ratio,
    pick_columns,
    read_label_text_lines,
    split_off_validation,
    tokenize,
    truncated_counts,
)
from .eval import PredictionFinish, classification_metrics, fixed_batches_reason, loader_lengths, train_padding
from .head import classification_loss, regression_head_in_fp32

__all__ = [
    "ClassificationDataArguments", "ClassificationModelArguments",
    "DEFAULT_LABEL_COLUMNS", "DEFAULT_TEXT_COLUMNS", "FILE_BUILDERS", "Labels", "data_summary", "embedded_tweets_path",
    "encode_labels", "headerless_hint", "load_embedded_tweets", "load_named_dataset", "load_text_files",
    "pad_with_eos", "padding_ratio", "pick_columns", "read_label_text_lines", "split_off_validation", "tokenize",
    "truncated_counts",
    "PredictionFinish", "classification_metrics", "fixed_batches_reason", "loader_lengths", "train_padding",
    "classification_loss", "regression_head_in_fp32",
]
