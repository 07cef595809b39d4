"""Text generation for recipes: data, tokens, models and generation metrics, in one import.

    from accel_train.tasks.text.generation import (GenerationDataArguments, load_raw_data, resolve_columns,
                                                   tokenize_splits, build_generation_model, Generator, ...)

The pieces are this package's modules: `data` (arguments, raw splits, column checks), `tokens` (token ids,
collators), `chat` (conversations: every reply learned), `model` (models, tokenizers, LoRA and its merge), `eval`
(generate on N processes, score text), `roundtrip` (targets the tokenizer cannot write: the ceiling of exact
match, the scores against the references' round trip), `checks` (what is refused before training, collapse and
source reliance after it), `finish` (the finish-seam hooks), `packing` (packed and padding-free batches), `demo`
(the rule-generated demo task).
"""

from .chat import ChatExample, chat_example
from .checks import (
    GENERATION_SCORES,
    check_best_metric,
    collapse_warning,
    output_diversity,
    refuse_deepspeed,
    rolled_rows,
    source_reliance,
)
from .data import (
    GenerationDataArguments,
    TaskColumns,
    check_texts,
    load_raw_data,
    resolve_columns,
    training_texts,
)
from .demo import load_date_demo
from .eval import (
    GeneratedItems,
    GenerationArguments,
    Generator,
    evaluate_generation,
    lead_words,
    repeated_ngram_share,
    score_generations,
    write_predictions,
)
from .finish import GenerationFinish, MergeLora, merge_lora
from .model import (
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
from .packing import (
    Packed,
    PackedCollator,
    TrainingSet,
    best_fit_decreasing,
    check_isolation,
    check_packing_flags,
    default_batching,
    fixed_batches_reason,
    isolation_error,
    pack_examples,
    training_set,
)
from .roundtrip import (
    ROUND_TRIP_SCORES,
    RoundTrip,
    check_round_trip,
    decode_output,
    round_trip_line,
    round_trip_metrics,
    round_trips,
)
from .tokens import (
    IGNORE_INDEX,
    GenerationCollator,
    ModelFacts,
    TokenizedSplit,
    TrainCollator,
    lm_documents,
    packing_width,
    tokenize_splits,
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
    "ROUND_TRIP_SCORES", "RoundTrip", "check_round_trip", "decode_output", "round_trip_line", "round_trip_metrics",
    "round_trips",
    "IGNORE_INDEX", "GenerationCollator", "ModelFacts", "TokenizedSplit", "TrainCollator", "lm_documents",
    "packing_width", "tokenize_splits",
    "Packed", "PackedCollator", "TrainingSet", "best_fit_decreasing", "check_isolation", "check_packing_flags",
    "default_batching", "fixed_batches_reason", "isolation_error", "pack_examples", "training_set",
]
