"""Text generation for recipes: data, tokens, models and generation metrics, in one import.

    from accel_train.tasks.text.generation import (GenerationDataArguments, load_raw_data, resolve_columns,
                                                   tokenize_splits, build_generation_model, Generator, ...)

The pieces live beside this module: `generation_data` (arguments, raw splits, column checks),
`generation_tokens` (token ids, collators), `generation_chat` (conversations: every reply learned),
`generation_model` (models, tokenizers, LoRA and its merge), `generation_eval` (generate on N processes, score
text), `generation_checks` (what is refused before training, collapse and source reliance after it),
`generation_finish` (the finish-seam hooks), `packing` (packed and padding-free batches),
`generation_demo` (the rule-generated demo task).
"""

from .generation_chat import ChatExample, chat_example
from .generation_checks import (
    GENERATION_SCORES,
    check_best_metric,
    collapse_warning,
    output_diversity,
    refuse_deepspeed,
    rolled_rows,
    source_reliance,
)
from .generation_data import (
    GenerationDataArguments,
    TaskColumns,
    check_texts,
    load_raw_data,
    resolve_columns,
    training_texts,
)
from .generation_demo import load_date_demo
from .generation_eval import (
    GeneratedItems,
    GenerationArguments,
    Generator,
    evaluate_generation,
    lead_words,
    repeated_ngram_share,
    score_generations,
    write_predictions,
)
from .generation_finish import GenerationFinish, MergeLora, merge_lora
from .generation_model import (
    GenerationModelArguments,
    add_lora,
    build_generation_model,
    config_is_seq2seq,
    load_tokenizer,
    loss_chunk,
    model_facts,
    train_bpe_tokenizer,
    vocabulary_digest,
    warm_start_encoder_decoder,
)
from .generation_tokens import (
    IGNORE_INDEX,
    GenerationCollator,
    ModelFacts,
    TokenizedSplit,
    TrainCollator,
    lm_documents,
    packing_width,
    tokenize_splits,
)
from .packing import (
    Packed,
    PackedCollator,
    TrainingSet,
    best_fit_decreasing,
    check_isolation,
    check_packing_flags,
    isolation_error,
    pack_examples,
    training_set,
)

__all__ = [
    "ChatExample", "chat_example",
    "GENERATION_SCORES", "check_best_metric", "collapse_warning", "output_diversity", "refuse_deepspeed",
    "rolled_rows", "source_reliance",
    "GenerationFinish", "MergeLora", "merge_lora",
    "GenerationDataArguments", "TaskColumns", "check_texts", "load_raw_data", "resolve_columns", "training_texts",
    "load_date_demo",
    "GeneratedItems", "GenerationArguments", "Generator", "evaluate_generation", "lead_words", "repeated_ngram_share",
    "score_generations", "write_predictions",
    "GenerationModelArguments", "add_lora", "build_generation_model", "config_is_seq2seq", "load_tokenizer",
    "loss_chunk", "model_facts", "train_bpe_tokenizer", "vocabulary_digest", "warm_start_encoder_decoder",
    "IGNORE_INDEX", "GenerationCollator", "ModelFacts", "TokenizedSplit", "TrainCollator", "lm_documents",
    "packing_width", "tokenize_splits",
    "Packed", "PackedCollator", "TrainingSet", "best_fit_decreasing", "check_isolation", "check_packing_flags",
    "isolation_error", "pack_examples", "training_set",
]
