"""What the checks compare, read from the variants' run directories: the logged training records (metrics.jsonl),
the final weights, and a checkpoint's optimizer state and random-generator states. Every figure of the
certificate can be derived again from these files.
"""

from __future__ import annotations

import itertools
import json
import math
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from ..observe.fed_record import fed_file
from ..rundir.checkpoint import TRAIN_STATE, list_checkpoints, load_train_state
from ..rundir.layout import CHECKPOINTS_DIR, CONFIG, HISTORY, checkpoint_name, checkpoint_step
from ..rundir.weights import read_weights, weights_file

OPTIMIZER_FILE = "optimizer.bin"  # Accelerate's name for the first optimizer's state in a checkpoint
RANDOM_STATES = "random_states_0.pkl"  # the main process's generators (Accelerate's name)
BATCH_NORM_BUFFERS = ("running_mean", "running_var")  # a BatchNorm layer's state (SyncBatchNorm's too)


def train_records(run_dir: Path) -> dict[int, dict]:
    """The training log records (with a "loss") by optimizer step. A resumed run appends to the history: the last
    record of a step is the one of the run that went on."""
    records: dict[int, dict] = {}
    path = Path(run_dir) / HISTORY
    if not path.is_file():
        return records
    for line in path.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if "loss" in record and "step" in record and not record.get("final"):
            records[int(record["step"])] = record
    return records


def final_weights(run_dir: Path) -> dict[str, torch.Tensor] | None:
    """The run's final weights (model.safetensors), else those of its newest checkpoint, else None."""
    run_dir = Path(run_dir)
    if weights_file(run_dir) is not None:
        return read_weights(run_dir)
    checkpoints = sorted((run_dir / CHECKPOINTS_DIR).glob("step-*"))
    for checkpoint in reversed(checkpoints):
        if weights_file(checkpoint) is not None:
            return read_weights(checkpoint)
    return None


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / checkpoint_name(step)


def precision_of(run_dir: Path, step: int) -> str | None:
    """The precision a run trained in, as its checkpoint at `step` recorded it ("fp32", "bf16 autocast on cpu"...; the
    loop records the precision in effect, whatever the flags asked), or None (no checkpoint there)."""
    path = checkpoint_dir(run_dir, step)
    return load_train_state(path).get("precision") if path.is_dir() else None


def trained_precision(run_dir: Path) -> str | None:
    """precision_of the run's last complete checkpoint, or None (no checkpoint, or no precision recorded)."""
    found = list_checkpoints(run_dir)
    return precision_of(run_dir, checkpoint_step(found[-1].name)) if found else None


def optimizer_tensors(checkpoint: Path) -> dict[str, torch.Tensor] | None:
    """The optimizer's per-parameter state in a checkpoint as flat names (`state.3.exp_avg`), or None."""
    path = checkpoint / OPTIMIZER_FILE
    if not path.is_file():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    flat = {}
    for index, values in state.get("state", {}).items():
        for key, value in values.items():
            if torch.is_tensor(value):
                flat[f"state.{index}.{key}"] = value
    return flat


def random_states(checkpoint: Path) -> dict[str, object] | None:
    """The main process's generator states saved in a checkpoint (python, numpy, torch), comparable with ==.
    The file is Accelerate's pickle, written by the variants verify itself ran."""
    path = checkpoint / RANDOM_STATES
    if not path.is_file():
        return None
    with open(path, "rb") as fh:
        states = torch.load(fh, weights_only=False) if _is_torch_file(path) else pickle.load(fh)
    out = {}
    for name in ("random_state", "numpy_random_seed", "torch_manual_seed"):
        value = states.get(name)
        if value is not None:
            out[name] = _plain(value)
    return out


def _plain(value):
    """A generator state as nested lists (numpy's repr would summarise its 624 words with '...')."""
    if torch.is_tensor(value) or hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


def _is_torch_file(path: Path) -> bool:
    with open(path, "rb") as fh:
        return fh.read(2) == b"PK"  # torch.save's zip format


def tensor_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[dict]:
    """Each tensor that differs (or is in one only), largest relative difference first: max |a - b| and that over
    max |a|."""
    rows = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b or a[name].shape != b[name].shape:
            rows.append({"tensor": name, "max_abs": math.inf, "relative": math.inf, "note": "missing or reshaped"})
            continue
        x, y = a[name].double(), b[name].double()
        if torch.equal(x, y):
            continue
        diff = (x - y).abs().max().item()
        scale = x.abs().max().item()
        rows.append({"tensor": name, "max_abs": diff, "relative": diff / scale if scale else math.inf})
    return sorted(rows, key=lambda row: -row["relative"])


def first_loss_difference(a: dict[int, dict], b: dict[int, dict], after: int = 0) -> dict | None:
    """The first logged step (> after) where the losses of two runs are not bitwise equal (or one lacks it)."""
    for step in sorted(s for s in set(a) | set(b) if s > after):
        x, y = a.get(step, {}).get("loss"), b.get(step, {}).get("loss")
        if x != y:
            relative = abs(x - y) / abs(x) if x and y is not None else math.inf
            return {"step": step, "loss": [x, y], "relative": relative}
    return None


def largest_loss_difference(a: dict[int, dict], b: dict[int, dict], after: int = 0) -> float:
    """The largest relative difference of two runs' logged losses over the steps (> after) both logged: more evidence
    of a difference's size than the first step alone, where other data may by chance move the loss very little."""
    steps = [s for s in set(a) & set(b) if s > after]
    return max((relative_difference(a[s].get("loss"), b[s].get("loss")) for s in steps), default=0.0)


def relative_difference(x: float | None, y: float | None) -> float:
    if x is None or y is None:
        return math.inf
    return abs(x - y) / max(abs(x), abs(y), 1e-30)


def batch_norm_layers(weights: dict) -> list[str]:
    """The layers whose state holds a batch norm's running statistics (read from the saved weights' names)."""
    return sorted({name.rsplit(".", 1)[0] for name in weights if name.rsplit(".", 1)[-1] in BATCH_NORM_BUFFERS})


# What the project's own feature x invariant matrix (tests/core/test_matrix.py) compares besides: the same readers and
# comparisons judge its cells and a user's run (verify/matrix.py).


def run_config(run_dir: Path) -> dict:
    """The run's resolved config (config.yaml: TrainConfig and the script's own arguments), or {}."""
    path = Path(run_dir) / CONFIG
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def history(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records in the order written, the final summary record left out."""
    path = Path(run_dir) / HISTORY
    lines = path.read_text().splitlines() if path.is_file() else []
    return [record for record in (json.loads(line) for line in lines if line.strip()) if not record.get("final")]


def steps_going_back(run_dir: Path) -> list[tuple[int, int]]:
    """Each place metrics.jsonl's step goes back (the step before, the step after): [] for one timeline."""
    steps = [int(record["step"]) for record in history(run_dir)]
    return [(before, after) for before, after in itertools.pairwise(steps) if after < before]


def flop_count(run_dir: Path) -> dict | None:
    """The FLOPs the run counted (per sample, per token), from its newest checkpoint's train state, or None."""
    checkpoints = sorted((Path(run_dir) / CHECKPOINTS_DIR).glob("step-*"))
    state = checkpoints[-1] / TRAIN_STATE if checkpoints else None
    return json.loads(state.read_text()).get("flop_count") if state is not None and state.is_file() else None


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max |a - b| over every tensor (inf when a tensor is in one only or reshaped, NaN when one is NaN): 0.0 is
    bitwise equal."""
    return max((row["max_abs"] for row in tensor_differences(a, b)), default=0.0)


def feed_across_resume(uninterrupted: list, cut: list | None, resumed: list) -> list[str]:
    """The micro-batches a resumed run fed against the uninterrupted run's (each a list of examples, in order): the
    resumed run goes on with exactly the uninterrupted run's last ones, and the cut run's then the resumed run's are
    the uninterrupted run's, none twice (`cut`: None when the cut run left no record). What differs, in words."""
    found = []
    if resumed != uninterrupted[len(uninterrupted) - len(resumed):]:
        found.append(f"the resumed run's {len(resumed)} micro-batches are not the uninterrupted run's last ones")
    if cut is not None and cut + resumed != uninterrupted:
        found.append(f"the cut run's {len(cut)} micro-batches then the resumed run's {len(resumed)} are not the "
                     f"uninterrupted run's {len(uninterrupted)}")
    return found


def merged_micro_batches(ranks: list[list[list[int]]]) -> list[list[int]]:
    """The processes' micro-batches merged step by step (each sorted): what one process at the global batch feeds.
    Processes that fed other numbers of micro-batches raise ValueError."""
    return [sorted(index for batch in batches for index in batch) for batches in zip(*ranks, strict=True)]


@dataclass
class Fed:
    """What one process of a run recorded (the last record of a step wins: a resumed run replays steps)."""

    plans: dict[int, list[list[int]]] = field(default_factory=dict)  # epoch -> micro-batches (the last recorded)
    replays: dict[int, list[list[list[int]]]] = field(default_factory=dict)  # epoch -> each process run's plan
    meta: dict[int, dict] = field(default_factory=dict)  # epoch -> dataset_length, num_processes, batch_size, ...
    steps: dict[int, dict] = field(default_factory=dict)
    probe: dict | None = None


def read_fed(run_dir: Path, rank: int) -> Fed | None:
    path = fed_file(run_dir, rank)
    if not path.is_file():
        return None
    fed = Fed()
    for line in path.read_text().splitlines():
        record = json.loads(line) if line.strip() else {}
        if "plan" in record:
            epoch = int(record["plan"])
            fed.plans[epoch] = record["batches"]
            fed.replays.setdefault(epoch, []).append(record["batches"])
            fed.meta[epoch] = {k: v for k, v in record.items() if k not in ("plan", "batches")}
        elif "probe" in record:
            fed.probe = record["probe"]
        elif "step" in record:
            fed.steps[int(record["step"])] = record
    return fed


def step_examples(run_dir: Path, processes: int, step: int) -> list[int] | None:
    """The dataset indices every process fed in optimizer step `step` (all its micro-batches), sorted; None when a
    process recorded nothing (ACCEL_TRAIN_RECORD_FED was off, a stream has no indices)."""
    indices: list[int] = []
    for rank in range(processes):
        fed = read_fed(run_dir, rank)
        record = fed.steps.get(step) if fed is not None else None
        if record is None or not fed.plans:
            return None
        for epoch, first, last in record.get("segments", []):
            indices += [i for batch in fed.plans.get(int(epoch), [])[first:last] for i in batch]
    return sorted(indices)


def first_step_lengths(run_dir: Path) -> list[int] | None:
    """The summed lengths of the first optimizer step's micro-batches, in the order they were dealt (process 0's
    first, process 1's first, ..., then each process's second), where the run chose that step's examples unequal
    (core/data.py's UnequalFirstStep, under ACCEL_TRAIN_UNEQUAL_FIRST_STEP=1: the loader knew the lengths); None where
    it did not (no lengths, a token budget, a stream) or fed nothing on record."""
    fed = read_fed(run_dir, 0)
    lengths = None if fed is None else fed.meta.get(0, {}).get("first_step_lengths")
    batches = None if fed is None else fed.plans.get(0)
    if not lengths or not batches or not batches[0]:
        return None
    size = len(batches[0])
    return [sum(lengths[start:start + size]) for start in range(0, len(lengths), size)]
