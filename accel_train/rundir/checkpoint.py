"""Checkpoints: Accelerate's save_state / load_state, made atomic, verified, rotated and exported.

A checkpoint directory (see layout.py for the rest of the run directory)::

    checkpoints/step-00000120/
      model.safetensors, optimizer.bin, scheduler.bin, random_states_<rank>.pkl   (Accelerate)
      config.json, tokenizer files   transformers models: the folder loads with from_pretrained
      train_state.json       loop position, best metric, hook states (JSON: a checkpoint cannot run code)
      manifest.json          written last: file sizes and SHA-256, the parameter shapes

A checkpoint is written to a hidden temporary directory and renamed into place only when complete, so a
crash mid-write never replaces a good checkpoint; `latest` resolves to the newest checkpoint whose manifest
verifies. Accelerate's own `total_limit` rotation is not used because it deletes by count alone: here the
best checkpoint is never deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from ..errors import CheckpointError
from ..testing import faults
from .layout import checkpoint_name, checkpoint_step, checkpoints_dir

MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.json"
FORMAT_VERSION = 1
ASIDE = ".old-"  # publish() moves a same-step checkpoint aside under this prefix until the new one is in place


def parameter_shapes(model: torch.nn.Module) -> dict[str, list[int]]:
    """Names and shapes of the unwrapped model's parameters and buffers (its state dict): the architecture fingerprint
    of a run. A ZeRO-3 parameter, an empty partition in the module, is read at its full shape (`ds_shape`)."""
    from accelerate.utils import extract_model_from_parallel

    model = extract_model_from_parallel(model)
    params = dict(model.named_parameters(remove_duplicate=False))  # state_dict's tensors are detached: no ds_shape
    return {name: list(getattr(params.get(name), "ds_shape", t.shape)) for name, t in model.state_dict().items()}


def parameter_numel(p: torch.Tensor) -> int:
    """The number of values of a parameter, at its full size under ZeRO-3 (`ds_numel`: the module holds an empty
    partition)."""
    return getattr(p, "ds_numel", None) or p.numel()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    accelerator: Accelerator, output_dir: str | Path, step: int, train_state: dict[str, Any], shapes: dict,
    extra_files: Callable[[Path], Any] | None = None, rank_files: Callable[[Path], Any] | None = None,
) -> Path:
    """Save the full training state for `step`; every rank must call this (collective). `extra_files(folder)` runs
    on the main process before the manifest, so what it writes there (a model's config.json) is verified too;
    `rank_files(folder)` runs on every rank (a stream's loader position, per process)."""
    final, tmp = open_checkpoint(accelerator, output_dir, step)
    error: BaseException | None = None
    try:  # every rank writes its part (RNG state; FSDP / DeepSpeed shards)
        accelerator.save_state(str(tmp), safe_serialization=True)
        if rank_files is not None:
            rank_files(tmp)
    except Exception as err:  # noqa: BLE001 - full disk, permissions (torch.save says so with a RuntimeError,
        error = err  # safetensors with its own error): agreed below, the other ranks must not wait for this one
    failed = any_rank(accelerator, error is not None)  # also the barrier before the manifest
    faults.kill_point("kill_during_save", step, accelerator.is_main_process)
    if not failed and accelerator.is_main_process:
        try:
            if extra_files is not None:
                extra_files(tmp)
            (tmp / TRAIN_STATE).write_text(json.dumps(train_state, indent=2))
            write_manifest(tmp, step, shapes, accelerator.num_processes)
        except Exception as err:  # agreed below: the other ranks must not wait for a rank that raised
            error = err
    failed = any_rank(accelerator, error is not None) or failed
    if failed:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {final}: {why_not_written(error)}") from error
    error = publish(tmp, final) if accelerator.is_main_process else None
    if any_rank(accelerator, error is not None):  # also the barrier: the checkpoint is in place for every process
        raise CheckpointError(f"could not write checkpoint {final}: {why_not_written(error)}") from error
    return final


def why_not_written(error: BaseException | None) -> str:
    """The end of a CheckpointError: what failed (or that another process did), and that nothing older was lost."""
    kept = "The previous checkpoints are untouched"
    if error is None:
        return f"another process failed to write its part. {kept}."
    if isinstance(error, OSError):
        return f"{error}. {kept}; free disk space or fix permissions, then resume with --resume_from_checkpoint latest."
    return f"{type(error).__name__}: {error}. {kept}."


def open_checkpoint(accelerator: Accelerator, output_dir: str | Path, step: int) -> tuple[Path, Path]:
    """(the checkpoint's folder, the temporary folder it is written in), the latter made afresh by the main process
    (collective). A folder it cannot make (a file in the way, permissions, a full disk) is a CheckpointError on every
    process, agreed: raised on the main process alone, it would leave the others waiting at the barrier for ever."""
    root = checkpoints_dir(output_dir)
    final, tmp = root / checkpoint_name(step), root / f".tmp-{checkpoint_name(step)}"
    error = None
    if accelerator.is_main_process:
        try:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as err:
            error = err
    if any_rank(accelerator, error is not None):  # also the barrier: the folder is there for every process
        raise CheckpointError(f"could not write checkpoint {final}: {why_not_written(error)}") from error
    return final, tmp


def publish(tmp: Path, final: Path) -> OSError | None:
    """Rename the written `tmp` into place; the OSError where that failed, the written folder then removed and the
    folders before it as they were. A checkpoint of the same step (step and epoch intervals can coincide) is moved
    aside first and deleted only once `tmp` is in its place (put back where that failed)."""
    aside = final.with_name(f"{ASIDE}{final.name}")
    try:
        if final.is_dir():
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
        os.replace(tmp, final)
    except OSError as err:
        if aside.is_dir() and not final.exists():
            os.replace(aside, final)
        shutil.rmtree(tmp, ignore_errors=True)
        return err
    shutil.rmtree(aside, ignore_errors=True)
    try:
        fsync_dir(final.parent)
    except OSError:  # the rename is done; only its durability on a crash of the machine is not confirmed
        pass
    return None


def any_rank(accelerator: Accelerator, flag: bool) -> bool:
    if accelerator.num_processes == 1:
        return flag
    tensor = torch.tensor([1 if flag else 0], device=accelerator.device)
    return bool(accelerator.reduce(tensor, reduction="sum").item())


def write_manifest(path: Path, step: int, shapes: dict, world_size: int, files: dict | None = None) -> None:
    """`files`: their entries, known already (else every file is hashed)."""
    if files is None:
        files = {}  # recursive: FSDP and DeepSpeed write sharded state in sub-directories
        for f in sorted(path.rglob("*")):
            if f.is_file() and f.name != MANIFEST:
                files[str(f.relative_to(path))] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
    manifest = {"format": FORMAT_VERSION, "step": step, "world_size": world_size, "files": files, "shapes": shapes}
    tmp = path / f"{MANIFEST}.tmp"
    with open(tmp, "w") as fh:
        json.dump(manifest, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path / MANIFEST)


def amend_train_state(accelerator: Accelerator, path: Path, changes: dict[str, Any]) -> None:
    """Set `changes` in the train state of checkpoint `path`, written already (collective; the main process writes),
    as safely as a save: a copy of the folder, its files hard-linked (nothing large copied or hashed again), gets the
    new train_state.json and manifest and is published in its place (the old one keeps its name until the new one is
    complete). Nothing is written where `path` holds `changes` already."""
    error: BaseException | None = None
    if accelerator.is_main_process:
        try:
            error = _amend(path, changes)
        except Exception as err:  # noqa: BLE001 - agreed below: the other processes must not wait for this one
            error = err
    if any_rank(accelerator, error is not None):  # also the barrier: the checkpoint is in place for every process
        raise CheckpointError(f"could not update {path / TRAIN_STATE}: {why_not_written(error)}") from error


def _amend(path: Path, changes: dict[str, Any]) -> OSError | None:
    saved, manifest = load_train_state(path), read_manifest(path)
    changes = json.loads(json.dumps(changes))  # as written and read back (a tuple is a list): equal is unchanged
    if all(saved.get(key) == value for key, value in changes.items()):
        return None
    tmp = path.with_name(f".tmp-{path.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        shutil.copytree(path, tmp, copy_function=_link)
        for name in (TRAIN_STATE, MANIFEST):  # links to the published checkpoint's files: replaced, never written to
            (tmp / name).unlink()
        (tmp / TRAIN_STATE).write_text(json.dumps({**saved, **changes}, indent=2))
        entry = {"bytes": (tmp / TRAIN_STATE).stat().st_size, "sha256": _sha256(tmp / TRAIN_STATE)}
        write_manifest(tmp, manifest["step"], manifest["shapes"], manifest["world_size"],
                       {**manifest["files"], TRAIN_STATE: entry})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish(tmp, path)


def _link(source: str, target: str) -> None:
    try:
        os.link(source, target)  # no bytes copied
    except OSError:  # a filesystem without hard links
        shutil.copy2(source, target)


def read_manifest(path: Path) -> dict:
    try:
        return json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is not a complete accel_train checkpoint (no {MANIFEST}): it was interrupted while being "
            "written or is not a checkpoint. Use --resume_from_checkpoint latest to pick the newest complete one."
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path / MANIFEST} is corrupt. Resume from another checkpoint.") from None


def verify_checkpoint(path: Path) -> dict:
    """Check every file against the manifest (size and SHA-256); return the manifest."""
    manifest = read_manifest(path)
    for name, meta in manifest.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {name}. Resume from another checkpoint.")
        if f.stat().st_size != meta["bytes"] or _sha256(f) != meta["sha256"]:
            raise CheckpointError(
                f"checkpoint {path}: {name} does not match its manifest (truncated or modified). "
                "Resume from another checkpoint."
            )
    return manifest


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints of the current timeline (named step-<8 digits>, manifest present), oldest first.
    Other directories (step-00000012.bak, superseded/) are not checkpoints of this run and are left alone. A
    same-step checkpoint that publish() moved aside (.old-step-<8 digits>) counts where a crash came before the new
    one took its place: it is that step's checkpoint until a resume's start or the next rotation puts it back
    (put_back_aside; read only here, as every rank may list)."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = {}
    for path in root.iterdir():
        name = path.name.removeprefix(ASIDE)
        step = checkpoint_step(name)
        if step is None or not path.is_dir() or not (path / MANIFEST).is_file():
            continue
        if name == path.name or not (root / name).exists():
            found[step] = path
    return [found[step] for step in sorted(found)]


def resolve_checkpoint(output_dir: str | Path, spec: str) -> Path | None:
    """'latest' -> newest complete checkpoint in output_dir that verifies; 'auto' -> the same, or None when there is
    no complete checkpoint (a first start; checkpoints that all fail to verify are an error, never a fresh start over
    them); otherwise a path."""
    if spec in ("latest", "auto"):
        candidates = list_checkpoints(output_dir)
        if not candidates and spec == "auto":
            return None
        if not candidates:
            raise CheckpointError(
                f"--resume_from_checkpoint latest: no complete checkpoint in {checkpoints_dir(output_dir)}. "
                "Start without --resume_from_checkpoint, or point it at a checkpoint directory."
            )
        for path in reversed(candidates):
            try:
                verify_checkpoint(path)
                return path
            except CheckpointError as err:
                print(f"skipping checkpoint {path.name}: {err}", flush=True)
        raise CheckpointError(f"no checkpoint in {checkpoints_dir(output_dir)} verifies against its manifest.")
    path = Path(spec)
    if not path.is_dir():
        raise CheckpointError(f"--resume_from_checkpoint {spec}: no such directory.")
    verify_checkpoint(path)
    return path


def check_compatible(path: Path, manifest: dict, shapes: dict) -> None:
    """Refuse a checkpoint of another architecture before Accelerate fails deep inside load_state_dict."""
    saved = manifest.get("shapes", {})
    missing = sorted(set(shapes) - set(saved))
    unexpected = sorted(set(saved) - set(shapes))
    changed = sorted(k for k in set(saved) & set(shapes) if saved[k] != shapes[k])
    if missing or unexpected or changed:
        details = []
        if changed:
            k = changed[0]
            details.append(f"{len(changed)} parameter(s) differ in shape, e.g. {k}: checkpoint {saved[k]} vs model "
                           f"{shapes[k]}")
        if missing:
            details.append(f"{len(missing)} parameter(s) missing from the checkpoint, e.g. {missing[0]}")
        if unexpected:
            details.append(f"{len(unexpected)} unexpected parameter(s), e.g. {unexpected[0]}")
        raise CheckpointError(
            f"checkpoint {path} was written by a different model: {'; '.join(details)}. "
            "Resume with the same model and label count, or start a new run in another --output_dir."
        )


def load_train_state(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / TRAIN_STATE).read_text())
    except (FileNotFoundError, json.JSONDecodeError) as err:
        raise CheckpointError(f"checkpoint {path}: unreadable {TRAIN_STATE} ({err}).") from None


def put_back_aside(output_dir: str | Path) -> None:
    """A same-step checkpoint publish() moved aside goes back into its place where a crash came before the new one
    took it (else it is removed): at a resume's start and at each rotation. Main process only."""
    root = checkpoints_dir(output_dir)
    for aside in root.glob(f"{ASIDE}*") if root.is_dir() else ():
        final = root / aside.name.removeprefix(ASIDE)
        if final.exists():
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(aside, final)


def rotate_checkpoints(output_dir: str | Path, keep: int | None, protect: str | set | None,
                       verified: set[str] | None = None) -> list[Path]:
    """Keep the newest `keep` checkpoints that verify against their manifest and the `protect`ed (best) one(s: the
    run's best and the one a landed background checkpoint names); delete the other checkpoints that verify. A
    checkpoint that does not verify never counts toward `keep` and is never deleted here, so a good checkpoint is
    never deleted in favour of a corrupt one.

    `verified`: names already known good (written or verified by this process); rotation adds the ones it
    verifies, so each checkpoint is hashed at most once per run. Main process only. Stale temporary directories
    of interrupted saves are removed too, and a same-step checkpoint that publish() had moved aside goes back into
    its place where a crash came before the new one took it (else it is removed)."""
    root = checkpoints_dir(output_dir)
    for stale in root.glob(".tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    put_back_aside(output_dir)
    if keep is None:
        return []
    verified = set() if verified is None else verified
    good = []
    for path in reversed(list_checkpoints(output_dir)):  # newest first: verify only as far as needed
        if path.name not in verified:
            try:
                verify_checkpoint(path)
            except CheckpointError:
                continue
            verified.add(path.name)
        good.append(path)
    kept = {protect} if isinstance(protect, str) or protect is None else set(protect)
    doomed = [p for p in good[keep:] if p.name not in kept]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
        verified.discard(path.name)
    return doomed
