"""An encoder-decoder's artifacts verified together: greedy decoding over them against the model's `generate()`.

Two loops, both as `generate(num_beams=1, do_sample=False)` decodes: `greedy_decode` with the decoder alone (the
whole prefix at every step), and with the decoder then the decoder with past (the last token and the cache). Each
must give exactly the model's token ids on the example rows; a difference is an ExportError naming the loop, the
row and the step. The artifacts are loaded back the way a serving stack loads them (`formats.load_artifact`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ExportError
from .formats import load_artifact
from .inputs import Sample
from .seq2seq import ENCODER_INPUTS, start_token

DECODE_NEW_TOKENS = 16  # the generation check's length: enough steps to pass the first few, short enough to be cheap
Runner = Callable[[Sequence[torch.Tensor]], list[torch.Tensor]]


def greedy_decode(runners: dict[str, Runner], input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int,
                  eos: Sequence[int], pad: int, max_new_tokens: int, with_past: bool) -> torch.Tensor:
    """Greedy decoding over the artifacts (`runners`: encoder, decoder, decoder_with_past), as `generate()` does it:
    the start token, then each step's most likely token; a finished row (it produced an end token) gets `pad`
    afterwards; stops when every row has finished or after `max_new_tokens`. `with_past`: the decoder runs the first
    step only and the decoder with past each later one on the cache. Returns [batch, 1 + new tokens]."""
    (hidden,) = runners["encoder"]([input_ids, attention_mask])
    tokens = torch.full((input_ids.shape[0], 1), start, dtype=torch.long)
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    ends = torch.tensor(list(eos), dtype=torch.long)
    logits, *past = runners["decoder"]([tokens, hidden, attention_mask])
    for step in range(max_new_tokens):
        if step:
            if with_past:
                logits, *own = runners["decoder_with_past"]([tokens[:, -1:], hidden, attention_mask, *past])
                past = [own[2 * (i // 4) + i % 4] if i % 4 < 2 else cached for i, cached in enumerate(past)]
            else:
                logits = runners["decoder"]([tokens, hidden, attention_mask])[0]
        chosen = logits[:, -1].argmax(-1).long()
        chosen = torch.where(done, torch.full_like(chosen, pad), chosen)
        tokens = torch.cat([tokens, chosen[:, None]], dim=1)
        done |= torch.isin(chosen, ends)
        if bool(done.all()):
            break
    return tokens


def verify_generation(fmt: str, paths: dict[str, Path], input_names: dict[str, list[str]], model: nn.Module,
                      sample: Sample, max_new_tokens: int = DECODE_NEW_TOKENS) -> dict[str, Any]:
    """Load the artifacts (`paths`, `input_names`: by artifact name) back and decode the sample's rows greedily with
    them, without and (when there is a decoder with past) with the cache; the token ids must equal the model's
    `generate()` (greedy, no logits processors, `max_new_tokens`). Returns export.json's "generation_check"."""
    runners = {name: load_artifact(fmt, paths[name], input_names[name]) for name in paths}
    if any(run is None for run in runners.values()):
        return {"verified": False, "note": "onnxruntime is not installed: the decoding loops were not run"}
    input_ids, attention_mask = (sample.tensors[k] for k in ENCODER_INPUTS)
    settings = _greedy_settings(model, max_new_tokens)
    loops = {"decoder": False, **({"decoder_with_past": True} if "decoder_with_past" in runners else {})}
    with torch.no_grad():
        expected = _generate(model, input_ids, attention_mask, settings)
        for loop, with_past in loops.items():
            got = greedy_decode(runners, input_ids, attention_mask, settings["decoder_start_token_id"],
                                settings["eos_token_id"], settings["pad_token_id"], max_new_tokens, with_past)
            if not (got.shape == expected.shape and torch.equal(got, expected)):
                row, step = _first_difference(got, expected)
                raise ExportError(
                    f"--format {fmt}: greedy decoding with the exported encoder and {loop} gives other tokens than "
                    f"the model's generate() on example row {row} (of {input_ids.shape[0]}), from new token {step}: "
                    f"{got[row, 1:].tolist()} vs {expected[row, 1:].tolist()}. The artifacts' logits differ where "
                    "two tokens are nearly tied, or a graph froze a shape: see the artifacts' checks above.")
    return {"verified": True, "tokens_equal": True, "loops": list(loops), "items": int(input_ids.shape[0]),
            "max_new_tokens": max_new_tokens, "generated_tokens": int(expected.shape[1] - 1), "decoding": "greedy",
            **{k: v for k, v in settings.items() if k.endswith("_id")}}


def generation_summary(check: dict[str, Any]) -> str:
    if not check.get("verified"):
        return f"decoding loops not verified ({check.get('note')})"
    return (f"greedy decoding with {' / '.join(check['loops'])}: the same {check['generated_tokens']} new tokens as "
            f"generate() on all {check['items']} example rows")


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

