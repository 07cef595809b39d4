"""Where accel_train leans on another library's internals, and the versions each reliance was checked with.

A public API that changes fails loudly; an internal one can change silently: a private attribute that is gone makes
a `getattr(..., default)` return the default, and a behaviour torch or Accelerate stopped having breaks nothing until
the run that needed it. So every such reliance is listed here, once, with the versions (major.minor) whose test suite
passed with it. A run on a version outside them says so in its start-up report (`unchecked_notes`); the test-only
sharding shim refuses one (`require_checked`). Raising a range is a deliberate change: run the suite against the
newest releases (`bash .ci/bump`, README "Tests"), then add the version here and to .ci/constraints.txt.

    for line in unchecked_notes():
        print("note", line)
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata


@dataclass(frozen=True)
class Reliance:
    """One internal of `library` that `where` depends on; `checked`: the major.minor versions it was tested with."""

    library: str
    checked: tuple[str, ...]
    where: str
    what: str
    feature: str


RELIANCES: tuple[Reliance, ...] = (
    Reliance("accelerate", ("1.15", "1.16"), "core/stream.py",
             "a prepared loader's `use_stateful_dataloader` attribute, which Accelerate's save_state / load_state "
             "read, and `dataloader_config.use_stateful_dataloader` switched for one prepare() call",
             "a stream resumed at its saved position"),
    Reliance("accelerate", ("1.15", "1.16"), "core/accelerator.py",
             "accelerate.utils.other.is_deepspeed_available, looked up by extract_model_from_parallel at each call",
             "a start-up 2.4 s shorter where DeepSpeed is installed and not the engine"),
    Reliance("datasets", ("5.2",), "core/stream.py",
             "IterableDataset._ex_iterable, a chain of iterables whose `buffer_size` says a shuffle buffer",
             "the refusal of a shuffled stream that would lose its buffer on resume"),
    Reliance("torch", ("2.13",), "core/rendezvous.py",
             "torchrun's elastic agent gives every attempt one TCPStore (TORCHELASTIC_USE_AGENT_STORE=True, "
             "MASTER_ADDR / MASTER_PORT), so a CPU group joins through keys its attempt agreed on",
             "elastic restarts and membership changes on CPU (gloo)"),
    Reliance("torch", ("2.13",), "core/meter.py",
             "torch._C._current_graph_task_id (-1 outside a backward pass) and the FlopCounterMode custom_mapping "
             "that takes raw formulas (`_get_raw`)", "MFU's model FLOPs under --gradient_checkpointing (the "
             "recomputed forward left out)"),
    Reliance("torch", ("2.13",), "core/compiled.py",
             "torch._dynamo.utils.counters['stats']['unique_graphs'], dynamo's process-wide count of compiled graphs",
             "train_compiled_graphs in all_results.json"),
    Reliance("torch", ("2.13",), "core/meter.py",
             "dynamo marks every frame it meets under a non-infra dispatch mode (FlopCounterMode) as never to compile "
             "again, unless torch.compiler.set_stance('force_eager') keeps it from seeing the frame at all",
             "--torch_compile compiling the training steps after the first micro-batch's FLOP count"),
    Reliance("torch", ("2.13",), "tasks/text/buckets.py",
             "torch._dynamo.config.recompile_limit (8 graphs per function, then the model runs uncompiled)",
             "--length_buckets: a static graph per width in training and evaluation"),
    Reliance("torchdata", ("0.11",), "core/stream.py",
             "StatefulDataLoader._iterator and its _shutdown_workers(), called when training ends",
             "a loader's workers ended with the run rather than 5 s each inside the garbage collector"),
    Reliance("transformers", ("5.24",), "config/parsing.py",
             "HfArgumentParser._add_dataclass_arguments / _parse_dataclass_field, overridden to group --help",
             "TrainConfig's flags grouped in --help"),
    Reliance("accelerate", ("1.15", "1.16"), "tests/scripts/sharded_cpu.py (tests only)",
             "PartialState._prepare_backend and set_device, patched so gloo CPU processes take the FSDP / DeepSpeed "
             "paths", "the sharded back-ends' tests on CPU"),
    Reliance("deepspeed", ("0.19",), "tests/scripts/sharded_cpu.py (tests only)",
             "deepspeed.ops.__compatible_ops__['deepspeed_shm_comm'], set False so that no CPU collectives op is "
             "built and the collectives are torch.distributed's, as on GPUs", "the DeepSpeed tests on CPU"),
)


def installed_version(library: str) -> str | None:
    """The installed distribution's version, None when it is not installed."""
    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        return None


def minor(version: str) -> str:
    """'2.13.0+cpu' -> '2.13'."""
    return ".".join(version.split("+")[0].split(".")[:2])


def unchecked(library: str | None = None) -> list[tuple[Reliance, str]]:
    """The reliances (of `library`, or of all) whose library is installed at a version outside their `checked`."""
    out = []
    for reliance in RELIANCES:
        if library is not None and reliance.library != library:
            continue
        version = installed_version(reliance.library)
        if version is not None and minor(version) not in reliance.checked:
            out.append((reliance, version))
    return out


def unchecked_notes(include_tests: bool = False) -> list[str]:
    """One line per library outside the versions checked, naming what may behave differently (start-up report)."""
    by_library: dict[tuple[str, str], list[Reliance]] = {}
    for reliance, version in unchecked():
        if include_tests or "(tests only)" not in reliance.where:
            by_library.setdefault((reliance.library, version), []).append(reliance)
    return [f"{library} {version} is not among the versions accel_train was checked with "
            f"({', '.join(sorted({c for r in found for c in r.checked}))}) for: "
            f"{'; '.join(f'{r.feature} ({r.where})' for r in found)}. Run the test suite against it before trusting "
            "those (README, Tests)" for (library, version), found in by_library.items()]


def require_checked(where: str) -> None:
    """Refuse (SystemExit) when a reliance of `where` meets a version it was not checked with."""
    for reliance, version in unchecked():
        if reliance.where.startswith(where):
            raise SystemExit(f"{where} relies on {reliance.what} of {reliance.library}, checked with "
                             f"{', '.join(reliance.checked)}; found {version}. Re-check it against that version, then "
                             "add the version to accel_train/compat.py.")
