"""Loading a run's saved weights into a built model: the one way the package does it.

A run saves `model.safetensors` (or shards named by `model.safetensors.index.json`) in its output directory and in
every checkpoint. `load_weights` reads either (or one .safetensors file), strictly: every tensor of the model is
filled and no saved tensor is left over, except tied weights, which are saved once (safetensors refuses tensors
sharing memory) and are filled by the name that was kept. A mismatch raises ModelError naming the first difference.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import ModelError
from .layout import WEIGHTS, WEIGHTS_INDEX


def weights_file(directory: str | Path) -> Path | None:
    """The weights a directory holds: model.safetensors, else the shard index, else None."""
    directory = Path(directory)
    for name in (WEIGHTS, WEIGHTS_INDEX):
        if (directory / name).is_file():
            return directory / name
    return None


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The saved tensors of a directory (whole or sharded) or of one .safetensors file, on the CPU."""
    from safetensors.torch import load_file

    path = Path(path)
    found = weights_file(path) if path.is_dir() else path if path.is_file() else None
    if found is None:
        raise ModelError(f"{path}: no {WEIGHTS} (a run saves it at the end; each checkpoint holds it too).")
    if found.name != WEIGHTS_INDEX:
        return load_file(str(found))
    shards = sorted(set(json.loads(found.read_text())["weight_map"].values()))
    return {name: tensor for shard in shards for name, tensor in load_file(str(found.parent / shard)).items()}


def load_weights(model: torch.nn.Module, path: str | Path, *,
                 exclude: Callable[[str], bool] | None = None, described_as: str = "") -> torch.nn.Module:
    """Load saved weights into `model` strictly and return it. `path`: a run directory, a checkpoint, or a
    .safetensors file. `exclude(name)` drops saved tensors the model is not meant to have (a classifier head
    left out of a backbone). Tied weights stored once fill every name sharing them (`load_state_dict(load_file())`
    would report the second name missing). Raises ModelError naming what does not fit (`described_as`: how the
    message names the model, by default its class)."""
    state = read_weights(path)
    if exclude is not None:
        state = {name: tensor for name, tensor in state.items() if not exclude(name)}
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())  # a transformers model's declared ties
    sharing: dict[int, list[str]] = {}  # a plain module's ties: names whose tensors share memory
    for name, tensor in model.state_dict().items():
        sharing.setdefault(tensor.data_ptr(), []).append(name)
    tied |= {n for names in sharing.values() if len(names) > 1 and any(m in state for m in names) for n in names}
    what = f"{path}: the weights do not fit {described_as or 'the ' + type(model).__name__}"
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as err:  # shapes differ: name the first one
        first = next((line.strip() for line in str(err).splitlines() if "size mismatch" in line), str(err)[:200])
        raise ModelError(f"{what}: {first}") from None
    missing = [name for name in result.missing_keys if name not in tied]
    if missing or result.unexpected_keys:
        details = [f"{len(missing)} missing, e.g. {missing[:2]}"] if missing else []
        if result.unexpected_keys:
            details.append(f"{len(result.unexpected_keys)} unexpected, e.g. {result.unexpected_keys[:2]}")
        raise ModelError(f"{what} ({'; '.join(details)}).")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model
