"""An encoder-decoder (EncoderDecoderModel, T5, BART: `config.is_encoder_decoder`) exported as the ONNX ecosystem
exports seq2seq models (Optimum's encoder_model / decoder_model): two artifacts, run by a decoding loop.

* ``encoder``: ``input_ids``, ``attention_mask`` [batch, encoder_sequence] -> ``encoder_hidden_states``
  [batch, encoder_sequence, hidden]; run once per source.
* ``decoder``: ``decoder_input_ids`` [batch, decoder_sequence] (the decoder start token, then the tokens chosen so
  far), ``encoder_hidden_states``, ``encoder_attention_mask`` (the source's mask) -> ``logits``
  [batch, decoder_sequence, vocabulary]; run once per new token on the whole prefix (no past key values: each step
  recomputes the prefix, so a step costs O(prefix) instead of O(1); the tokens are the same).

Each artifact is verified like any other (its outputs against the model's at other shapes), and then the two
together: `greedy_decode` over the loaded artifacts must give exactly the token ids of the model's own
`generate()` (greedy, the same number of new tokens) on the example rows. A disagreement is an ExportError
naming the row and the step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import ExportError
from .formats import load_artifact
from .inputs import Sample, views
from .targets import ExportTarget, Positional

ENCODER_INPUTS = ["input_ids", "attention_mask"]
DECODER_INPUTS = ["decoder_input_ids", "encoder_hidden_states", "encoder_attention_mask"]
DECODE_NEW_TOKENS = 16  # the generation check's length: enough steps to pass the first few, short enough to be cheap
EncodedViews = tuple[tuple[torch.Tensor, ...], list[tuple[str, tuple[torch.Tensor, ...]]]]


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
    """The whole model's forward with the encoder's output given: what `generate()` calls at each step (the
    projection between encoder and decoder widths, when a model has one, included), without a cache."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = without_encoder(model)

    def forward(self, decoder_input_ids, encoder_hidden_states, encoder_attention_mask):
        # an all-ones decoder mask made from the input: a traced tensor keeps transformers from dropping the causal
        # mask for SDPA's is_causal (which it decides from the prefix length, a decision torch.jit.trace would freeze)
        out = self.model(encoder_outputs=(encoder_hidden_states,), attention_mask=encoder_attention_mask,
                         decoder_input_ids=decoder_input_ids, decoder_attention_mask=torch.ones_like(decoder_input_ids),
                         use_cache=False)
        return {"logits": out.logits}


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
    """[(target, example, checks)] for the encoder and the decoder; the decoder's inputs are the encoder's real
    outputs on the same rows, with prefixes of 3, 5 and 1 tokens (1: the first decoding step)."""
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
    decoder_axes = {"decoder_input_ids": {0: "batch", 1: "decoder_sequence"},
                    "encoder_hidden_states": {0: "batch", 1: "encoder_sequence"},
                    "encoder_attention_mask": {0: "batch", 1: "encoder_sequence"}}
    steps = [3, 3, 5, 1]
    with torch.no_grad():
        decoder_views = [_decoder_inputs(encoder.module, rows, length, start_token(model))
                         for rows, length in zip([example, *[c for _, c in checks]], steps, strict=True)]
    decoder_sample = AxesSample(dict(zip(DECODER_INPUTS, decoder_views[0], strict=True)), sample.source,
                                sample.pad_token_id, axes=decoder_axes)
    decoder = ExportTarget("decoder", Positional(Decoder(model), DECODER_INPUTS, ["logits"]), DECODER_INPUTS,
                           ["logits"], decoder_sample, f"{name}.decoder")
    decoder_checks = [(f"{text}, decoder prefix of {length}", inputs)
                      for (text, _), inputs, length in zip(checks, decoder_views[1:], steps[1:], strict=True)]
    return [(encoder, example, checks), (decoder, decoder_views[0], decoder_checks)]


def _decoder_inputs(encoder: Positional, rows: Sequence[torch.Tensor], length: int, start: int):
    input_ids, attention_mask = rows
    (hidden,) = encoder(input_ids, attention_mask)
    prefix = input_ids[:, :length].clone()  # token ids of the vocabulary, as the loop feeds back its choices
    prefix[:, 0] = start
    return prefix, hidden, attention_mask


Runner = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]


def greedy_decode(encoder: Runner, decoder: Runner, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  start: int, eos: Sequence[int], pad: int, max_new_tokens: int) -> torch.Tensor:
    """Greedy decoding over the two artifacts, as `generate(num_beams=1, do_sample=False)` does it: the start token,
    then each step's most likely token; a finished row (it produced an end token) gets `pad` afterwards; stops when
    every row has finished or after `max_new_tokens`. Returns [batch, 1 + new tokens], the start token first."""
    (hidden,) = encoder([input_ids, attention_mask])
    tokens = torch.full((input_ids.shape[0], 1), start, dtype=torch.long)
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    ends = torch.tensor(list(eos), dtype=torch.long)
    for _ in range(max_new_tokens):
        (logits,) = decoder([tokens, hidden, attention_mask])
        chosen = logits[:, -1].argmax(-1).long()
        chosen = torch.where(done, torch.full_like(chosen, pad), chosen)
        tokens = torch.cat([tokens, chosen[:, None]], dim=1)
        done |= torch.isin(chosen, ends)
        if bool(done.all()):
            break
    return tokens


def verify_generation(fmt: str, paths: dict[str, Any], model: nn.Module, sample: Sample,
                      max_new_tokens: int = DECODE_NEW_TOKENS) -> dict[str, Any]:
    """Load the encoder and decoder artifacts (`paths`: name -> file) back and decode the sample's rows greedily with
    them; the token ids must equal the model's `generate()` (greedy, no logits processors, `max_new_tokens`).
    Returns export.json's "generation_check"; raises ExportError naming the first row and step that differ."""
    runners = {name: load_artifact(fmt, paths[name], names)
               for name, names in (("encoder", ENCODER_INPUTS), ("decoder", DECODER_INPUTS))}
    if any(run is None for run in runners.values()):
        return {"verified": False, "note": "onnxruntime is not installed: the decoding loop was not run"}
    input_ids, attention_mask = (sample.tensors[k] for k in ENCODER_INPUTS)
    settings = _greedy_settings(model, max_new_tokens)
    with torch.no_grad():
        expected = _generate(model, input_ids, attention_mask, settings)
        got = greedy_decode(runners["encoder"], runners["decoder"], input_ids, attention_mask,
                            settings["decoder_start_token_id"], settings["eos_token_id"], settings["pad_token_id"],
                            max_new_tokens)
    record = {"verified": True, "items": int(input_ids.shape[0]), "max_new_tokens": max_new_tokens,
              "decoding": "greedy, no past key values", **{k: v for k, v in settings.items() if k.endswith("_id")},
              "generated_tokens": int(expected.shape[1] - 1)}
    if got.shape == expected.shape and torch.equal(got, expected):
        return {**record, "tokens_equal": True}
    row, step = _first_difference(got, expected)
    raise ExportError(
        f"--format {fmt}: greedy decoding with the exported encoder and decoder gives other tokens than the model's "
        f"generate() on example row {row} (of {input_ids.shape[0]}), from new token {step}: "
        f"{got[row, 1:].tolist()} vs {expected[row, 1:].tolist()}. The decoder artifact's logits differ where two "
        "tokens are nearly tied, or the graph froze a shape: see the decoder's checks above.")


def _greedy_settings(model: nn.Module, max_new_tokens: int) -> dict[str, Any]:
    generation = getattr(model, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    eos = model.config.eos_token_id if eos is None else eos
    pad = getattr(generation, "pad_token_id", None)
    pad = model.config.pad_token_id if pad is None else pad
    ends = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return {"decoder_start_token_id": start_token(model), "eos_token_id": ends,
            "pad_token_id": int(pad if pad is not None else (ends[0] if ends else 0)),
            "max_new_tokens": max_new_tokens}


def _generate(model: nn.Module, input_ids, attention_mask, settings: dict[str, Any]) -> torch.Tensor:
    """`generate()` greedy with only these settings: the model's generation config may name logits processors
    (forced or suppressed tokens, repetition penalties) that are decoding choices, not part of the artifacts."""
    from transformers import GenerationConfig

    kept = model.generation_config
    model.generation_config = GenerationConfig(do_sample=False, num_beams=1, **{
        k: (v or None) if k == "eos_token_id" else v for k, v in settings.items()})
    try:
        return model.generate(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        model.generation_config = kept


def _first_difference(got: torch.Tensor, expected: torch.Tensor) -> tuple[int, int]:
    length = min(got.shape[1], expected.shape[1])
    unequal = (got[:, :length] != expected[:, :length]).int()
    if got.shape[0] == expected.shape[0] and unequal.any():
        row = int(unequal.any(1).int().argmax())
        return row, int(unequal[row].argmax())
    return 0, length


def generation_summary(check: dict[str, Any]) -> str:
    if not check.get("verified"):
        return f"decoding loop not verified ({check.get('note')})"
    return (f"greedy decoding with encoder + decoder: the same {check['generated_tokens']} new tokens as generate() "
            f"on all {check['items']} example rows")
