"""An encoder-decoder (EncoderDecoderModel, T5, BART: `config.is_encoder_decoder`) exported as the ONNX ecosystem
exports seq2seq models (Optimum's encoder_model / decoder_model / decoder_with_past_model): three artifacts, run by
a decoding loop (`decoding.py`).

* ``encoder``: ``input_ids``, ``attention_mask`` [batch, encoder_sequence] -> ``encoder_hidden_states``
  [batch, encoder_sequence, hidden] (zero at padding); run once per source.
* ``decoder``: ``decoder_input_ids`` [batch, decoder_sequence] (the decoder start token, then the tokens chosen so
  far), ``encoder_hidden_states``, ``encoder_attention_mask`` (the source's mask) -> ``logits``
  [batch, decoder_sequence, vocabulary] and, per decoder layer i, ``present.i.decoder.key`` / ``.value`` (its
  self-attention keys and values) and ``present.i.encoder.key`` / ``.value`` (its cross-attention's, computed once
  from the source). The first step of a cached loop, or every step of a loop without a cache (the whole prefix).
* ``decoder_with_past``: ``decoder_input_ids`` [batch, 1] (the last chosen token), ``encoder_hidden_states``,
  ``encoder_attention_mask`` and ``past_key_values.i.decoder.key`` ... ``past_key_values.i.encoder.value`` (the
  presents so far) -> ``logits`` [batch, 1, vocabulary] and ``present.i.decoder.key`` / ``.value`` (one position
  longer); each later step.

Each artifact is verified like any other (its outputs against the model's at other shapes), and then together: the
greedy loops over the loaded artifacts must give exactly the token ids of the model's own `generate()`.
A model whose cache is not transformers' EncoderDecoderCache gets the encoder and the decoder (logits only).
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import ExportError
from .inputs import Sample, views
from .targets import ExportTarget, Positional

ENCODER_INPUTS = ["input_ids", "attention_mask"]
DECODER_INPUTS = ["decoder_input_ids", "encoder_hidden_states", "encoder_attention_mask"]
PREFIXES = [3, 3, 5, 1]  # the decoder's prefix lengths: the example, then each check (1: the first step)


def is_encoder_decoder(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))


@dataclass(frozen=True)
class AxesSample(Sample):
    """A Sample whose dynamic axes are given (the decoder's encoder_hidden_states is float yet has a sequence axis;
    the encoder's and the decoder's sequences are different axes, named apart in the artifacts)."""

    axes: dict[str, dict[int, str]] = field(default_factory=dict)

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        return {name: self.axes.get(name, {0: "batch"}) for name in self.tensors}


class Encoder(nn.Module):
    """input_ids, attention_mask -> the encoder's last hidden state, zero at padding positions.

    The decoder's cross-attention masks the padding out, so those rows never reach a token; but they are where
    runtimes disagree most (ONNX Runtime vs PyTorch on the default run's MiniLM: 7e-5 at padding, 4e-6 at real
    tokens), and a comparison of them would fail an export for numbers nothing reads."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model.get_encoder()  # only the encoder: the artifact carries its weights alone

    def forward(self, input_ids, attention_mask):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask)[0]
        return {"encoder_hidden_states": hidden * attention_mask[..., None].to(hidden.dtype)}


class Decoder(nn.Module):
    """The whole model's forward with the encoder's output given: what `generate()` calls at its first step (the
    projection between encoder and decoder widths, when a model has one, included); with `cache`, the keys and
    values of each layer come out too."""

    def __init__(self, model: nn.Module, cache: bool):
        super().__init__()
        self.model = without_encoder(model)
        self.cache = cache

    def forward(self, decoder_input_ids, encoder_hidden_states, encoder_attention_mask):
        # an all-ones decoder mask made from the input: a traced tensor keeps transformers from dropping the causal
        # mask for SDPA's is_causal (which it decides from the prefix length, a decision torch.jit.trace would freeze)
        out = self.model(encoder_outputs=(encoder_hidden_states,), attention_mask=encoder_attention_mask,
                         decoder_input_ids=decoder_input_ids, decoder_attention_mask=torch.ones_like(decoder_input_ids),
                         use_cache=self.cache)
        return {"logits": out.logits, **(presents(cache_of(out), cross=True) if self.cache else {})}


class DecoderWithPast(nn.Module):
    """One step on the cache: the last token, and each layer's keys and values so far (`past_key_values.i.*`, as
    keyword arguments) rebuilt into transformers' EncoderDecoderCache -> logits and the layers' self-attention keys
    and values one position longer (the cross-attention's do not change)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = without_encoder(model)
        self.cache_argument = cache_argument(model)

    def forward(self, decoder_input_ids, encoder_hidden_states, encoder_attention_mask, **past):
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache

        own, cross = DynamicCache(), DynamicCache()
        for i in range(len(past) // 4):
            own.update(past[f"past_key_values.{i}.decoder.key"], past[f"past_key_values.{i}.decoder.value"], i)
            cross.update(past[f"past_key_values.{i}.encoder.key"], past[f"past_key_values.{i}.encoder.value"], i)
        # the decoder's mask covers the cached positions and the new one (its length from a tensor, for the tracer)
        cached = past["past_key_values.0.decoder.key"][:, 0, :, 0]
        mask = torch.cat([torch.ones_like(cached, dtype=decoder_input_ids.dtype), torch.ones_like(decoder_input_ids)],
                         dim=1)
        out = self.model(encoder_outputs=(encoder_hidden_states,), attention_mask=encoder_attention_mask,
                         decoder_input_ids=decoder_input_ids, decoder_attention_mask=mask, use_cache=True,
                         **{self.cache_argument: EncoderDecoderCache(own, cross)})
        return {"logits": out.logits, **presents(cache_of(out), cross=False)}


def cache_argument(model: nn.Module) -> str:
    """The forward's name for the cache: `cache` since transformers 5.x (`past_key_values` deprecated, to be removed
    in 5.40), `past_key_values` before."""
    try:
        return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    except (TypeError, ValueError):
        return "past_key_values"


def cache_of(out: Any) -> Any:
    """The cache a forward returned (`cache` or, before transformers renamed it, `past_key_values`)."""
    found = out.get("cache") if hasattr(out, "get") else None
    return found if found is not None else getattr(out, "past_key_values", None)


def presents(cache: Any, cross: bool) -> dict[str, torch.Tensor]:
    """{present.i.decoder.key: ..., [present.i.encoder.key: ...]} of an EncoderDecoderCache, layer by layer."""
    found = {}
    for i, layer in enumerate(cache.self_attention_cache.layers):
        found[f"present.{i}.decoder.key"], found[f"present.{i}.decoder.value"] = layer.keys, layer.values
        if cross:
            other = cache.cross_attention_cache.layers[i]
            found[f"present.{i}.encoder.key"], found[f"present.{i}.encoder.value"] = other.keys, other.values
    return found


def past_names(layers: int) -> list[str]:
    return [f"past_key_values.{i}.{side}.{kind}" for i in range(layers) for side in ("decoder", "encoder")
            for kind in ("key", "value")]


def cached_layers(model: nn.Module, inputs: Sequence[torch.Tensor]) -> int:
    """How many decoder layers an EncoderDecoderCache holds after one step; 0 when the model keeps another kind of
    cache (the export then has no decoder_with_past)."""
    from transformers.cache_utils import EncoderDecoderCache

    prefix, hidden, mask = inputs
    out = model(encoder_outputs=(hidden,), attention_mask=mask, decoder_input_ids=prefix, use_cache=True)
    cache = cache_of(out)
    return len(cache.self_attention_cache.layers) if isinstance(cache, EncoderDecoderCache) else 0


def without_encoder(model: nn.Module) -> nn.Module:
    """A view of `model` sharing its weights, its encoder (wherever it sits: model.encoder, model.model.encoder)
    replaced by a `DroppedEncoder`: the decoder artifact carries only the weights it uses (the encoder's, not twice)."""
    encoder = model.get_encoder()
    path = next((name for name, module in model.named_modules() if module is encoder and name), None)
    if path is None:
        return model
    *parents, leaf = path.split(".")
    view = copy.copy(model)
    node = view
    for name in parents:
        child = copy.copy(node._modules[name])
        node._modules = {**node._modules, name: child}
        node = child
    node._modules = {**node._modules, leaf: DroppedEncoder(getattr(encoder, "config", None))}
    return view


class DroppedEncoder(nn.Module):
    """Stands where the encoder was in the decoder's view: no weights, its config (EncoderDecoderModel reads the
    encoder's width from it), and an error if called (the decoder is always given the encoder's output)."""

    def __init__(self, config: Any):
        super().__init__()
        self.config = config

    def forward(self, *args, **kwargs):
        raise ExportError("the decoder artifact ran its encoder: it must be given encoder_outputs.")


def start_token(model: nn.Module) -> int:
    """The decoder start token, from the generation config, else the model config (a ExportError without one)."""
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "decoder_start_token_id", None)
        if value is not None:
            return int(value)
    raise ExportError(f"{type(model).__name__}: no decoder_start_token_id in its config or generation config; the "
                      "decoding loop cannot start. Set it in config.json (the token the decoder starts from).")


def seq2seq_plans(model: nn.Module, sample: Sample) -> list[tuple[ExportTarget, Any, list]]:
    """[(target, example, checks)] for the encoder, the decoder and the decoder with past: the decoders' inputs are
    the encoder's real outputs on the same rows, with prefixes of 3, 5 and 1 tokens (1: the first decoding step),
    and for the decoder with past the decoder's own keys and values of those prefixes."""
    missing = [k for k in ENCODER_INPUTS if k not in sample.tensors]
    if missing:
        raise ExportError(f"{type(model).__name__} (an encoder-decoder): the example inputs ({sample.source}) have no "
                          f"{missing}; pass --inputs with input_ids and attention_mask (or a text file).")
    name = type(model).__name__
    source = AxesSample(sample.select(ENCODER_INPUTS).tensors, sample.source, sample.pad_token_id,
                        axes={k: {0: "batch", 1: "encoder_sequence"} for k in ENCODER_INPUTS})
    example, checks = views(source)
    encoder = ExportTarget("encoder", Positional(Encoder(model), ENCODER_INPUTS, ["encoder_hidden_states"]),
                           ENCODER_INPUTS, ["encoder_hidden_states"], source, f"{name}.encoder")
    texts = [f"{text}, decoder prefix of {length}" for (text, _), length in zip(checks, PREFIXES[1:], strict=True)]
    with torch.no_grad():
        rows = [_decoder_inputs(encoder.module, r, n, start_token(model))
                for r, n in zip([example, *[c for _, c in checks]], PREFIXES, strict=True)]
        layers = cached_layers(model, rows[0])
    axes = {"decoder_input_ids": {0: "batch", 1: "decoder_sequence"},
            "encoder_hidden_states": {0: "batch", 1: "encoder_sequence"},
            "encoder_attention_mask": {0: "batch", 1: "encoder_sequence"}}
    decoder = _target("decoder", Decoder(model, cache=bool(layers)), DECODER_INPUTS, rows[0], axes, sample, name)
    plans = [(encoder, example, checks), (decoder, rows[0], list(zip(texts, rows[1:], strict=True)))]
    if layers:
        with torch.no_grad():
            stepped = [_step_inputs(decoder.module, inputs) for inputs in rows]
        axes = {**axes, "decoder_input_ids": {0: "batch"},
                **{n: {0: "batch", 2: "past_sequence" if ".decoder." in n else "encoder_sequence"}
                   for n in past_names(layers)}}
        step = _target("decoder_with_past", DecoderWithPast(model), [*DECODER_INPUTS, *past_names(layers)],
                       stepped[0], axes, sample, name)
        plans.append((step, stepped[0], [(t.replace("decoder prefix", "past"), s)
                                         for t, s in zip(texts, stepped[1:], strict=True)]))
    return plans


def _target(label: str, module: nn.Module, names: list[str], example: Sequence[torch.Tensor],
            axes: dict[str, dict[int, str]], sample: Sample, model_name: str) -> ExportTarget:
    """An ExportTarget whose outputs are the ones the module returns on the example (logits, then the presents)."""
    with torch.no_grad():
        outputs = list(module(**dict(zip(names, example, strict=True))))
    tensors = dict(zip(names, example, strict=True))
    return ExportTarget(label, Positional(module, names, outputs), names, outputs,
                        AxesSample(tensors, sample.source, sample.pad_token_id, axes=axes), f"{model_name}.{label}")


def _decoder_inputs(encoder: Positional, rows: Sequence[torch.Tensor], length: int, start: int):
    input_ids, attention_mask = rows
    (hidden,) = encoder(input_ids, attention_mask)
    prefix = input_ids[:, :length].clone()  # token ids of the vocabulary, as the loop feeds back its choices
    prefix[:, 0] = start
    return prefix, hidden, attention_mask


def _step_inputs(decoder: Positional, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The decoder with past's inputs after the decoder ran `inputs`: a next token, and the decoder's presents."""
    prefix, hidden, mask = inputs
    _, *cache = decoder(*inputs)
    return (prefix[:, -1:].flip(0).clone(), hidden, mask, *cache)
