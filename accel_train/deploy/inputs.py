"""Example inputs for an export: a few model-ready rows, and the shapes the model is traced and checked at.

A `Sample` holds N rows of what the model's forward takes (``input_ids`` / ``attention_mask`` /
``token_type_ids`` for a text model, normalised float ``pixel_values`` for an image model). Where the rows come
from, best first: the run's evaluation data (the first evaluation batch at the end of training, or a file the
user gives), else inputs made from the run's saved tokenizer / image processor (`synthetic_sample`), else (a run
with neither) the training set's first samples. A tuple batch, ``(inputs, targets)`` or ``(x1, x2, y)``, gives
every element but the last, named after the parameters of the model's forward they are passed as.

`views` cuts the rows into the example a format traces with and the held-out inputs it is verified on: the
same shape with other rows, another batch size with a longer (padded) sequence, and one unpadded row. A graph
that baked in the example's batch size or sequence length fails the second and third.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import IterableDataset

from ..errors import ExportError

# Integer [batch, sequence] inputs: their second axis is the (dynamic) sequence axis.
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
SAMPLE_ROWS = 8

# Used when a text run left no evaluation texts behind: real sentences of different lengths, tokenised with the
# run's own tokenizer (so every id is in its vocabulary and the padding is the tokenizer's).
SENTENCES = (
    "The delivery arrived two days late and the box was damaged.",
    "Great service!",
    "I am not sure how I feel about the new update; some parts are better, others are clearly worse.",
    "Thanks for the quick reply.",
    "The battery lasts all day, even with the screen at full brightness.",
    "Worst experience ever.",
    "It works, but the instructions could have been written more clearly for first-time users.",
    "Absolutely love it.",
)


@dataclass(frozen=True)
class Sample:
    """Rows of model-ready inputs: every tensor has the rows as its first dimension.

    `source` says where they came from (written to export.json); `pad_token_id` pads ``input_ids`` when a
    view needs a longer sequence.
    """

    tensors: dict[str, torch.Tensor]
    source: str
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if not self.tensors:
            raise ExportError(f"example inputs ({self.source}): no tensors.")
        rows = {t.shape[0] for t in self.tensors.values() if t.ndim}
        if len(rows) != 1:
            shapes = {k: list(v.shape) for k, v in self.tensors.items()}
            raise ExportError(f"example inputs ({self.source}): the tensors disagree on the number of rows {shapes}.")

    @property
    def rows(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def token_inputs(self) -> list[str]:
        return [k for k, v in self.tensors.items() if is_token_input(k, v)]

    def select(self, names: Sequence[str]) -> Sample:
        return Sample({k: self.tensors[k] for k in names}, self.source, self.pad_token_id)

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        """{input: {axis: name}}: the batch axis of every input, the sequence axis of token inputs."""
        tokens = self.token_inputs()
        return {k: ({0: "batch", 1: "sequence"} if k in tokens else {0: "batch"}) for k in self.tensors}

    def save(self, path: Path) -> Path:
        from safetensors.torch import save_file

        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(path),
                  metadata={"source": self.source, "pad_token_id": str(self.pad_token_id)})
        return path


def is_token_input(name: str, tensor: torch.Tensor) -> bool:
    return name in TOKEN_INPUTS and tensor.ndim == 2 and not tensor.is_floating_point()


def views(sample: Sample) -> tuple[tuple[torch.Tensor, ...], list[tuple[str, tuple[torch.Tensor, ...]]]]:
    """(example, [(description, inputs), ...]): positional tuples in the sample's order.

    The example has 2 rows and one padding column more than the rows need, so that the masked path is the
    one traced; the checks use other rows at that shape, 3 rows padded 4 columns longer, and 1 row unpadded.
    """
    example = _rows(sample, [0, 1], extra=1)
    checks = [("held-out rows, example shape", _rows(sample, [2, 3], extra=1)),
              ("batch 3, longer sequence", _rows(sample, [4, 5, 6], extra=5)),
              ("batch 1, unpadded", _rows(sample, [7], extra=0, trim=True))]
    return example, checks


def shape_text(inputs: Sequence[torch.Tensor]) -> str:
    return " ".join("x".join(map(str, t.shape)) for t in inputs)


def _rows(sample: Sample, rows: list[int], extra: int, trim: bool = False) -> tuple[torch.Tensor, ...]:
    index = torch.tensor([r % sample.rows for r in rows])
    picked = {k: v.index_select(0, index) for k, v in sample.tensors.items()}
    tokens = sample.token_inputs()
    mask = picked.get("attention_mask")
    if tokens and trim and mask is not None:
        keep = mask[0].bool() if mask.shape[0] == 1 else mask.bool().any(0)
        picked = {k: (v[:, keep] if k in tokens else v) for k, v in picked.items()}
    elif tokens and extra:
        for k in tokens:
            pad = sample.pad_token_id if k == "input_ids" else 0
            v = picked[k]
            picked[k] = torch.cat([v, v.new_full((v.shape[0], extra), pad)], dim=1)
    return tuple(picked.values())


# ----------------------------------------------------------------------------------------- where rows come from


def sample_from_batch(batch: Mapping[str, Any] | Sequence[Any], names: Sequence[str] | None = None,
                      image_processor: Any = None, pad_token_id: int = 0, source: str = "the run's evaluation data",
                      model: Any = None) -> Sample:
    """Model-ready rows from a loader batch: the tensors named in `names` (default: every per-row tensor but the
    labels; an image-text batch's ``caption_input_ids`` [B, K, L] give each image's first caption as
    ``input_ids``); uint8 ``pixel_values`` are rescaled and standardised as `image_processor` says.

    A tuple batch ``(inputs, targets)`` or ``(x1, x2, y)`` is read as the loss functions read it: every element but
    the last is a positional input of `model`'s forward, named after the forward's parameters (``forward(x, z)``:
    "x", "z"), and the last is the target, left out."""
    if not isinstance(batch, Mapping):
        batch = positional_inputs(batch, model, source)
    rows = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor) and v.ndim and k != "labels"}
    for key in ("input_ids", "attention_mask"):
        caption = rows.pop(f"caption_{key}", None)
        if caption is not None and caption.ndim == 3 and key not in rows:
            rows[key] = caption[:, 0]
    lead = rows.get("input_ids", rows.get("pixel_values"))
    wanted = list(names or [k for k, v in rows.items() if lead is None or v.shape[0] == lead.shape[0]])
    missing = [k for k in wanted if k not in rows]
    if missing or not wanted:
        raise ExportError(f"example inputs ({source}): the batch has no tensor {missing[:1] or 'to use'} (it has "
                          f"{sorted(batch)}); pass inputs that name the model's arguments.")
    tensors = {k: rows[k].detach().cpu()[:SAMPLE_ROWS] for k in wanted}
    if "pixel_values" in tensors:
        tensors["pixel_values"] = normalize_pixels(tensors["pixel_values"], image_processor)
    return Sample(tensors, source, pad_token_id)


def first_samples(loader: Any) -> Any:
    """The first rows of a map-style loader's dataset, collated by the loader's own collate function (read by index:
    no sampler, no worker, no random number drawn); None for a stream."""
    dataset = getattr(loader, "dataset", None)
    if dataset is None or isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__") or not len(dataset):
        return None
    return loader.collate_fn([dataset[i] for i in range(min(SAMPLE_ROWS, len(dataset)))])


def positional_inputs(batch: Sequence[Any], model: Any, source: str) -> dict[str, torch.Tensor]:
    """The inputs of a tuple batch, by the name of the forward parameter each one is passed as."""
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        kind = f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list)) else type(batch).__name__
        raise ExportError(f"example inputs ({source}): the batch is {kind}; a batch is a dict of named inputs or a "
                          "tuple (inputs..., target). Pass --inputs FILE.safetensors (input name -> tensor).")
    inputs = list(batch[:-1])
    forward = getattr(model, "forward", None)
    try:
        params = list(inspect.signature(forward).parameters.values()) if forward is not None else []
    except (TypeError, ValueError):
        params = []
    named = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    if len(named) < len(inputs) or not all(isinstance(t, torch.Tensor) for t in inputs):
        kinds = ", ".join(type(t).__name__ for t in inputs)
        raise ExportError(f"example inputs ({source}): a tuple batch passes its first {len(inputs)} element(s) "
                          f"({kinds}) to the model as positional tensors, and {type(model).__name__}.forward"
                          f"({', '.join(p.name for p in params)}) names {len(named)} parameter(s) that take them by "
                          "name. Give forward one named parameter per input tensor, or pass --inputs "
                          "FILE.safetensors (input name -> tensor).")
    return dict(zip(named[: len(inputs)], inputs, strict=True))


def normalize_pixels(pixels: torch.Tensor, processor: Any = None) -> torch.Tensor:
    """Float pixels as the model saw them: uint8 rescaled and standardised with the processor's mean and std
    (without a processor: each channel to mean 0, std 1 over these images)."""
    if pixels.is_floating_point():
        return pixels.float()
    x = pixels.float() * float(getattr(processor, "rescale_factor", None) or 1 / 255)
    mean, std = getattr(processor, "image_mean", None), getattr(processor, "image_std", None)
    if mean is None or std is None:
        mean, std = x.mean(dim=(0, 2, 3)), x.std(dim=(0, 2, 3)).clamp_min(1e-6)
    shape = (1, -1, 1, 1)
    return (x - torch.as_tensor(mean).view(shape)) / torch.as_tensor(std).view(shape)


def sample_from_texts(texts: Sequence[str], tokenizer: Any, source: str, max_length: int = 128) -> Sample:
    """Rows tokenised by the run's tokenizer, padded on the right to the longest (as the loop's evaluation batches
    are; a causal LM's saved tokenizer pads on the left for generation, and views add padding on the right)."""
    if tokenizer is None:
        raise ExportError(f"example inputs ({source}): texts need the run's tokenizer, and the run directory has "
                          "none (tokenizer files beside the weights).")
    encoded = tokenizer(list(texts)[:SAMPLE_ROWS], padding=True, truncation=True, max_length=max_length,
                        return_tensors="pt", padding_side="right")
    tensors = {k: v for k, v in encoded.items() if k in TOKEN_INPUTS}
    return Sample(tensors, source, int(tokenizer.pad_token_id or 0))


def sample_from_file(path: Path, tokenizer: Any = None) -> Sample:
    """A .safetensors file of named input tensors (rows first), or a text file with one text per line."""
    if not path.is_file():
        raise ExportError(f"--inputs {path}: no such file.")
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        return Sample(tensors, meta.get("source", str(path)), int(meta.get("pad_token_id", 0)))
    texts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not texts:
        raise ExportError(f"--inputs {path}: no texts (one per line), nor a .safetensors file of input tensors.")
    return sample_from_texts(texts, tokenizer, f"{path.name} ({len(texts)} texts)")


def synthetic_sample(tokenizer: Any = None, image_size: int | None = None, channels: int = 3,
                     image_processor: Any = None, seed: int = 0) -> Sample:
    """Rows made from the run's saved processing objects: the built-in sentences through the tokenizer, and/or
    random images at the processor's size, standardised as the processor says."""
    tensors: dict[str, torch.Tensor] = {}
    source, pad = [], 0
    if tokenizer is not None:
        text = sample_from_texts(SENTENCES, tokenizer, "built-in sentences")
        tensors.update(text.tensors)
        source.append("built-in sentences through the run's tokenizer")
        pad = text.pad_token_id
    if image_size:
        generator = torch.Generator().manual_seed(seed)
        pixels = torch.randint(0, 256, (SAMPLE_ROWS, channels, image_size, image_size), generator=generator,
                               dtype=torch.uint8)
        tensors["pixel_values"] = normalize_pixels(pixels, image_processor)
        source.append(f"random {image_size}x{image_size} images")
    if not tensors:
        raise ExportError("no example inputs: the run directory has neither a tokenizer nor an image processor, and "
                          "no inputs were given. Pass --inputs FILE.safetensors (input name -> tensor, rows first).")
    return Sample(tensors, " and ".join(source), pad)
