"""What gets exported: the model (or each tower of a dual encoder) as a module of positional tensors in, a tuple
of tensors out.

Every format wants plain tensors at its boundary, while a transformers model takes keyword arguments and returns
a ModelOutput. `Positional` adapts one to the other, with the input order and output names written to
export.json. A dual encoder (``accel_train.tasks.multimodal.dual_encoder.DualEncoder``: a text tower and a vision
tower) is exported as two artifacts, each running the model's own forward with one kind of input and producing
its L2-normalised embeddings (a serving stack embeds texts and images apart); each carries only its tower's
weights. An encoder-decoder's two artifacts (encoder, decoder) are planned in `seq2seq.py`.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ExportError
from .inputs import Sample

DROPPED_OUTPUTS = ("loss", "hidden_states", "attentions")


class Positional(nn.Module):
    """`forward(*tensors)` calls `model(**dict(zip(input_names, tensors)))` and returns the named outputs as a
    tuple (all tensor outputs when `output_keys` is None: see `output_names`)."""

    def __init__(self, model: nn.Module, input_names: Sequence[str], output_keys: Sequence[str] | None = None):
        super().__init__()
        self.model = model
        self.input_names = list(input_names)
        self.output_keys = None if output_keys is None else list(output_keys)

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(**dict(zip(self.input_names, tensors, strict=True)))
        if isinstance(out, torch.Tensor):
            return (out,)
        if isinstance(out, Mapping):
            return tuple(out[k] for k in (self.output_keys or tensor_keys(out)))
        return tuple(out)


@dataclass
class ExportTarget:
    """One artifact to write: `module(*sample tensors in input_names order)` returns `output_names`."""

    name: str
    module: Positional
    input_names: list[str]
    output_names: list[str]
    sample: Sample
    model_class: str


def tensor_keys(out: Mapping[str, Any]) -> list[str]:
    """The outputs worth exporting: "logits" when there are logits, else every tensor output."""
    keys = [k for k, v in out.items() if isinstance(v, torch.Tensor) and k not in DROPPED_OUTPUTS]
    return ["logits"] if "logits" in keys else keys


def is_dual_encoder(model: nn.Module) -> bool:
    """accel_train.tasks.multimodal.dual_encoder.DualEncoder, recognised by what the towers need (no import of the task
    layer)."""
    return all(hasattr(model, name) for name in ("encode_text", "text_projection", "vision_projection", "vision"))


def check_exportable(model: nn.Module) -> None:
    """Refuse, before training, a model the exporter cannot take, with the reason and what to do instead (called by
    `train()` when --export_formats is set, so that the last step of a run is not the first to fail)."""
    name = type(model).__name__
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        raise ExportError(f"--export_formats: {name} is a LoRA adapter on a base model, which the exporter does not "
                          "take; add --merge_lora (the run then ends with a plain model with the adapter merged) and "
                          "export that run directory with `accel-train export OUTPUT_DIR --format ...`.")


class PairScorer(nn.Module):
    """A fusion model's image-text matching logit of each (image b, caption b) pair: what re-ranking calls."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values, input_ids, attention_mask):
        out = self.model(pixel_values=pixel_values, input_ids=input_ids, attention_mask=attention_mask,
                         itm_pairs=lambda o: (o["image_tokens"], o["text_states"], o["text_mask"]))
        return {"itm_logits": out["itm_logits"]}


def export_targets(model: nn.Module, sample: Sample) -> list[ExportTarget]:
    """The artifacts for `model` (in eval mode): one; a text and a vision tower for a dual encoder; and for a fusion
    model (a dual encoder with `match`: FusionEncoder) also its ITM scorer of (image, caption) pairs."""
    name = type(model).__name__
    if is_dual_encoder(model):
        fusion = ("fusion",) if hasattr(model, "match") else ()
        towers = [("text_tower", ["input_ids", "attention_mask"], "text_embeds",
                   ("vision", "vision_projection", *fusion)),
                  ("vision_tower", ["pixel_values"], "image_embeds", ("text", "text_projection", *fusion))]
        targets = [ExportTarget(tower, Positional(_without(model, dropped), inputs, [output]), inputs, [output],
                                sample.select(inputs), f"{name}.{tower}")
                   for tower, inputs, output, dropped in towers if all(k in sample.tensors for k in inputs)]
        pair = ["pixel_values", "input_ids", "attention_mask"]
        if fusion and all(k in sample.tensors for k in pair):
            targets.append(ExportTarget("itm_scorer", Positional(PairScorer(model), pair, ["itm_logits"]), pair,
                                        ["itm_logits"], sample.select(pair), f"{name}.itm_scorer"))
        if not targets:
            raise ExportError(f"{name}: the example inputs ({sorted(sample.tensors)}) feed neither tower; a text "
                              "tower needs input_ids and attention_mask, a vision tower pixel_values.")
        return targets
    inputs = _forward_inputs(model, sample)
    with torch.no_grad():
        out = model(**{k: sample.tensors[k][:2] for k in inputs})
    outputs = _output_names(out)
    keys = outputs if isinstance(out, Mapping) else None
    return [ExportTarget("model", Positional(model, inputs, keys), inputs, outputs, sample.select(inputs), name)]


def _without(model: nn.Module, names: Sequence[str]) -> nn.Module:
    """A view of `model` sharing its weights, with the submodules `names` replaced by nn.Identity: the tower
    runs the model's own forward, and the artifact carries only the weights that tower uses."""
    view = copy.copy(model)
    view._modules = {k: nn.Identity() if k in names else v for k, v in model._modules.items()}
    return view


def _forward_inputs(model: nn.Module, sample: Sample) -> list[str]:
    """The sample's tensors the model's forward accepts, in the forward's argument order."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return list(sample.tensors)
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    names = [k for k in params if k in sample.tensors]
    names += [k for k in sample.tensors if takes_any and k not in names]
    if not names:
        raise ExportError(f"{type(model).__name__}.forward{inspect.signature(model.forward)} takes none of the "
                          f"example inputs {sorted(sample.tensors)}; pass inputs named after its arguments.")
    return names


def _output_names(out: Any) -> list[str]:
    if isinstance(out, torch.Tensor):
        return ["output"]
    if isinstance(out, Mapping):
        keys = tensor_keys(out)
        if keys:
            return keys
    elif isinstance(out, (tuple, list)) and out and all(isinstance(v, torch.Tensor) for v in out):
        return [f"output_{i}" for i in range(len(out))]
    raise ExportError(f"the model returns {type(out).__name__}, not tensors (a tensor, a tuple of tensors or a "
                      "mapping of them); wrap it in a module that returns the tensors to serve.")
