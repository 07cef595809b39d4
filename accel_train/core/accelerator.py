"""Build the Accelerator, check that the run is the one that was asked for, and report it.

Device, precision and topology come from the launcher (`accelerate launch`, `accelerate config`, the presets
in accelerate_configs/), never from branches in a recipe. What this module adds on top of Accelerate is the
checking: the world size that is really running against the one requested, fp16 on a CPU (which Accelerate
silently runs in fp32), and a start-up report of what is actually in effect.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import InitProcessGroupKwargs, ProjectConfiguration, set_seed

from ..compat import unchecked_notes
from ..config import TrainConfig
from ..errors import ConfigError, LaunchError
from ..rundir.outdir import refuse_mixed_runs
from .deepspeed_json import json_schedule_line
from .muon import refuse_sharded_muon
from .peak import cpu_info, device_peak
from .rendezvous import join_attempt_group, reuses_agent_store
from .seeding import data_seed
from .sharded import check_accumulation_count, check_deepspeed_run, check_engine, refuse_sharded_probe

# Where every process holds the whole model and whole, already-reduced gradients (no FSDP / DeepSpeed sharding).
WHOLE_MODEL_TYPES = ("NO", "MULTI_CPU", "MULTI_GPU")
# the --report_to names accepted: Accelerate's trackers, each with an install check in accelerate.utils.imports
KNOWN_TRACKERS = ("tensorboard", "wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab", "trackio")


def build_accelerator(config: TrainConfig, kwargs_handlers: Sequence = (), static_shapes: bool = False) -> Accelerator:
    """The Accelerator for a run: accumulation, seedable data order, trackers, checked topology and precision.

    The scheduler is stepped by the loop once per optimizer step (``step_scheduler_with_optimizer=False``):
    Accelerate's default steps it once per process, which silently changes warmup and decay with world size.
    An output_dir holding an earlier run (neither resumed nor overwritten) is refused here already.
    `kwargs_handlers` go to the Accelerator unchanged, e.g. ``[DistributedDataParallelKwargs(
    find_unused_parameters=True)]`` for a model that leaves some parameters out of some steps.
    `static_shapes`: the batches come in a few fixed shapes (a recipe's --length_buckets), so --torch_compile
    compiles one static graph per shape (``dynamic=False``) instead of a dynamic-shape graph at the second shape.
    """
    defer_deepspeed_probe()
    _connect_cpu_processes()
    _join_elastic_cpu_group(config.ddp_timeout)
    dynamo = None
    if config.torch_compile:  # otherwise Accelerate takes --dynamo_backend from the launcher, as usual
        from accelerate.utils import TorchDynamoPlugin

        dynamo = TorchDynamoPlugin(backend=config.torch_compile_backend, mode=config.torch_compile_mode or "default",
                                   dynamic=False if static_shapes else None)
    accelerator = Accelerator(
        mixed_precision=resolve_precision(config.mixed_precision),
        gradient_accumulation_steps=config.gradient_accumulation_steps,
        dataloader_config=DataLoaderConfiguration(
            # a stream is read by every process, each its own shard (datasets.IterableDataset.shard), rather
            # than by the main process and sent to the others
            dispatch_batches=False,
            use_seedable_sampler=True,
            data_seed=data_seed(config),
            non_blocking=config.dataloader_pin_memory,
        ),
        log_with=resolve_trackers(config) or None,
        project_config=ProjectConfiguration(
            project_dir=config.output_dir, logging_dir=str(Path(config.output_dir) / "runs")
        ),
        step_scheduler_with_optimizer=False,
        dynamo_plugin=dynamo,
        kwargs_handlers=_with_timeout(kwargs_handlers, config.ddp_timeout),
    )
    check_world_size(accelerator, config.expected_world_size)
    check_engine(accelerator)  # FSDP / DeepSpeed asked for but not running: refused, never silent DDP
    check_accumulation_count(accelerator, config)  # the launcher's or DeepSpeed's count against the plan's
    check_deepspeed_run(accelerator, config)  # what DeepSpeed would replace or cannot weigh: refused, before a model
    refuse_sharded_probe(accelerator, config)  # --auto_find_batch_size would measure DDP's memory
    if config.optim == "muon":
        refuse_sharded_muon(accelerator)  # build_optimizer again, for an Accelerator built elsewhere
    check_precision(accelerator)
    refuse_mixed_runs(config)  # before a recipe spends minutes loading a model and tokenizing data
    _set_tf32(accelerator, config.tf32)
    set_cpu_threads(accelerator, config.cpu_threads)
    set_seed(config.seed)
    return accelerator


def defer_deepspeed_probe() -> None:
    """Accelerate's extract_model_from_parallel, behind every unwrap_model, imports DeepSpeed wherever it is installed,
    to test whether the model is a DeepSpeedEngine: 2.4 s of every run's start-up here (a toy run's process 7.5 s ->
    5.1 s), DeepSpeed or not. No object can be an instance of that class before deepspeed is imported, which
    Accelerate does itself when DeepSpeed is the engine: so the test is asked only once it is imported."""
    import sys

    import accelerate.utils.other as other

    asked = other.is_deepspeed_available
    if getattr(asked, "deferred", False):
        return

    def imported_and_available() -> bool:
        return "deepspeed" in sys.modules and asked()

    imported_and_available.deferred = True
    other.is_deepspeed_available = imported_and_available


def holds_whole_model(accelerator: Accelerator) -> bool:
    """True where each process holds the whole bare model and its whole gradients (single device, DDP); False under
    FSDP and DeepSpeed, whose parameters and gradients are sharded."""
    return accelerator.distributed_type.value in WHOLE_MODEL_TYPES


def _set_tf32(accelerator: Accelerator, wanted: bool | None) -> None:
    """TF32 matmuls and convolutions on Ampere and newer GPUs: ~same accuracy, several times faster fp32."""
    supported = accelerator.device.type == "cuda" and torch.cuda.get_device_capability(accelerator.device)[0] >= 8
    if wanted and not supported:
        raise ConfigError("--tf32 true needs an Ampere-or-newer NVIDIA GPU; leave it unset to use TF32 where "
                          "available.")
    if supported:
        enabled = wanted is not False
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def set_cpu_threads(accelerator: Accelerator, wanted: int | None) -> None:
    """Set torch's intra-op threads: `--cpu_threads` when given, else the cores for a lone CPU process that
    `accelerate launch` pinned to one thread; otherwise the launcher's choice stands.

    `accelerate launch` without `--cpu` or a config file exports OMP_NUM_THREADS=1, so a one-process CPU run
    of `accelerate launch recipe.py` used one core of many (on 2 cores MiniLM trains 1.6x faster with 2
    threads). Several processes keep the launcher's one thread each: they share the cores.
    """
    if wanted is not None:
        torch.set_num_threads(wanted)
        return
    launched_pinned = os.environ.get("OMP_NUM_THREADS") == "1" and "ACCELERATE_DYNAMO_BACKEND" in os.environ
    if accelerator.device.type != "cpu" or accelerator.num_processes != 1 or not launched_pinned:
        return
    cores = usable_cores()
    if cores > 1 and torch.get_num_threads() == 1:
        torch.set_num_threads(cores)


def usable_cores() -> int:
    """Physical cores this process may run on (CPU affinity and container limits included)."""
    import psutil

    try:
        allowed = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        allowed = os.cpu_count() or 1
    return max(1, min(allowed, psutil.cpu_count(logical=False) or allowed))


def speed_settings(accelerator: Accelerator, config: TrainConfig) -> str:
    """One line of what is on: compile, TF32, gradient checkpointing."""
    dynamo = accelerator.state.dynamo_plugin
    compiled = "off" if str(getattr(dynamo.backend, "value", dynamo.backend)).upper() == "NO" else (
        f"{str(getattr(dynamo.backend, 'value', dynamo.backend)).lower()} ({dynamo.mode or 'default'}"
        f"{', static shapes' if dynamo.dynamic is False else ''})")
    tf32 = torch.backends.cuda.matmul.allow_tf32 if accelerator.device.type == "cuda" else None
    threads = f", {torch.get_num_threads()} cpu thread(s)" if accelerator.device.type == "cpu" else ""
    return (f"compile {compiled}, tf32 {'on' if tf32 else 'off' if tf32 is False else 'n/a'}, "
            f"gradient checkpointing {'on' if config.gradient_checkpointing else 'off'}{threads}")


def _with_timeout(kwargs_handlers: Sequence, seconds: int) -> list:
    """The handlers, with the process group's timeout from the config unless the caller set one."""
    handlers = list(kwargs_handlers)
    if not any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
        handlers.append(InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=seconds)))
    return handlers


def _connect_cpu_processes() -> None:
    """`accelerate launch --multi_gpu` on a machine without GPUs starts N *unconnected* copies unless
    ACCELERATE_USE_CPU is set. When a multi-process launch finds no accelerator, join the processes
    into one gloo group instead of training N independent models."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and "ACCELERATE_USE_CPU" not in os.environ and not _has_accelerator():
        os.environ["ACCELERATE_USE_CPU"] = "1"


def _join_elastic_cpu_group(timeout: int) -> None:
    """Processes started by torchrun's elastic agent on CPU join their gloo group through keys their attempt agreed
    on (core/rendezvous.py: the agent's store keeps earlier attempts' keys, and restart counts differ between nodes
    after a membership change). A GPU group, or a launcher without an agent store, is Accelerate's as before."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 or not reuses_agent_store() or _has_accelerator() or torch.distributed.is_initialized():
        return
    join_attempt_group(timeout)


def _has_accelerator() -> bool:
    if torch.cuda.is_available():
        return True
    return any(
        getattr(torch, name, None) is not None and getattr(torch, name).is_available()
        for name in ("xpu", "mps")
        if hasattr(getattr(torch, name, None), "is_available")
    )


def requested_world_size(explicit: int | None = None) -> tuple[int | None, str]:
    """The number of processes the user asked for, and where that request was read."""
    if explicit is not None:
        return explicit, "--expected_world_size"
    if os.environ.get("ACCEL_TRAIN_EXPECTED_WORLD_SIZE"):
        return int(os.environ["ACCEL_TRAIN_EXPECTED_WORLD_SIZE"]), "ACCEL_TRAIN_EXPECTED_WORLD_SIZE"
    if os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"]), "the launcher's WORLD_SIZE"
    return _num_processes_from_parent(), "the `accelerate launch` command line"


def _num_processes_from_parent() -> int | None:
    """`accelerate launch --cpu --num_processes 2` runs ONE process and exports nothing about the 2: read it
    from the launcher's own command line (Linux), the only place it survives."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    args = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    launcher = any(a.endswith("accelerate") for a in args[:2]) and "launch" in args[:3]
    if not (launcher or "accelerate.commands.launch" in args[:3]):
        return None
    found = None  # the launcher's own flags end at the script; the last occurrence wins, as in argparse
    for i, arg in enumerate(args[1:], start=1):
        if arg.endswith(".py") and not args[i - 1].startswith("--config"):
            break
        if arg in ("--num_processes", "--num-processes") and i + 1 < len(args) and args[i + 1].isdigit():
            found = int(args[i + 1])
        elif arg.startswith(("--num_processes=", "--num-processes=")):
            found = int(arg.split("=", 1)[1])
    return found


def check_world_size(accelerator: Accelerator, explicit: int | None = None) -> None:
    """Fail loudly when the number of processes running differs from the number requested."""
    wanted, source = requested_world_size(explicit)
    running = accelerator.num_processes
    if wanted is not None and wanted != running:
        raise LaunchError(
            f"{wanted} processes were requested ({source}) but {running} joined the run "
            f"(distributed type {accelerator.distributed_type.value}). "
            "On CPU, `accelerate launch --cpu --num_processes N` starts one process and `--multi_gpu` needs "
            "ACCELERATE_USE_CPU=1 to connect the copies. Use: "
            "accel-train launch --config_file accelerate_configs/cpu_multiprocess.yaml <script>  (see README, "
            "'Choosing hardware')."
        )


def loop_steps_schedulers(accelerator: Accelerator) -> None:
    """After prepare: the prepared schedulers step once at each of the loop's calls (once per optimizer step), as
    build_accelerator's do. An Accelerator of the user's own (Accelerate's default step_scheduler_with_optimizer)
    would step each once per process at every call: warmup, decay and a plateau's patience run N times as fast."""
    for prepared in accelerator._schedulers:
        prepared.step_with_optimizer = False


def resolve_precision(requested: str | None) -> str | None:
    """--mixed_precision auto: the launcher's precision when it asked for one (ACCELERATE_MIXED_PRECISION other than
    "no"), else bf16 where this machine computes bf16 natively (`native_bf16`), else "no" (fp32). Other values are
    passed to Accelerate unchanged (None: the launcher's)."""
    if requested != "auto":
        return requested
    return launcher_precision() or ("bf16" if native_bf16() else "no")


def launcher_precision() -> str | None:
    """The mixed precision `accelerate launch` (or its config file) asked for, or None when it asked for none: its
    "no" is also what it reports when nothing was said, so it counts as none."""
    launcher = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    return None if launcher in ("", "no") else launcher


def native_bf16() -> bool:
    """Whether bf16 matmuls run natively: a GPU that supports bf16 (Ampere and newer), or a CPU with AVX512-BF16 or
    AMX-BF16 instructions (on a CPU without them bf16 is emulated, and slower than fp32)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported(including_emulation=False)
    flags = (cpu_info("flags") or "").split()  # not Linux: not detected, so not assumed
    return "avx512_bf16" in flags or "amx_bf16" in flags


def check_precision(accelerator: Accelerator) -> None:
    """Accelerate accepts fp16 on a CPU and silently trains in fp32: refuse it."""
    if accelerator.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        raise ConfigError(
            "mixed precision fp16 was requested on a CPU, where Accelerate silently trains in fp32. "
            "Use --mixed_precision bf16 (real bf16 autocast on CPU) or --mixed_precision no."
        )


def precision_in_effect(accelerator: Accelerator) -> str:
    if accelerator.distributed_type.value == "DEEPSPEED":
        return f"{accelerator.mixed_precision} (DeepSpeed engine)"
    if accelerator.mixed_precision in ("fp16", "bf16") and accelerator.native_amp:
        scaler = ", dynamic loss scaling" if accelerator.scaler is not None else ""
        return f"{accelerator.mixed_precision} autocast on {accelerator.device.type}{scaler}"
    return "fp32"


def resolve_trackers(config: TrainConfig) -> list[str]:
    """The Accelerate trackers --report_to names (`all`: every installed one of KNOWN_TRACKERS); an unknown or
    uninstalled one is a ConfigError that says what to do."""
    from accelerate.utils import imports

    trackers = config.trackers
    if [t.lower() for t in trackers] == ["all"]:  # the Hugging Face scripts' --report_to all: every installed one
        return [name for name in KNOWN_TRACKERS if getattr(imports, f"is_{name}_available", lambda: False)()]
    for name in trackers:
        check = getattr(imports, f"is_{name}_available", None)
        if name not in KNOWN_TRACKERS or check is None:
            raise ConfigError(f"--report_to {name}: unknown tracker; choose from {', '.join(KNOWN_TRACKERS)} or none.")
        if not check():
            raise ConfigError(f"--report_to {name}: the '{name}' package is not installed (pip install {name}).")
    return trackers


def startup_report(accelerator: Accelerator, config: TrainConfig, plan, num_train_samples: int | None,
                   schedule: str | None = None, objects: tuple[str, ...] = ()) -> str:
    """The numbers a user should check before trusting a run, printed once on the main process. `schedule`: the
    schedule line for a scheduler of the user's; `objects`: the optimizer and clipping lines (core/objects.py). Under
    DeepSpeed a JSON's scheduler or explicit learning rate is stated as it runs (`json_schedule_line`)."""
    schedule = schedule or json_schedule_line(accelerator, config, plan)
    epochs = (f"{plan.steps_per_epoch} per epoch, {plan.total_steps} in total ({plan.num_epochs} epoch(s))"
              if plan.steps_per_epoch is not None else f"{plan.total_steps} in total (--max_steps; a stream of "
              "unknown length: an epoch ends where it runs out)")
    lines = [
        "accel_train run",
        f"  world size       {accelerator.num_processes} process(es), {accelerator.distributed_type.value}"
        f", device {accelerator.device}",
        f"  precision        {precision_in_effect(accelerator)}{_auto_note(accelerator, config)}",
        f"  speed            {speed_settings(accelerator, config)}",
        f"  mfu peak         {device_peak(accelerator)[1]}",
        f"  batch            {_batch_line(accelerator, config, plan, num_train_samples)}",
        f"  train samples    {num_train_samples if num_train_samples is not None else 'unknown'}",
        f"  steps            {epochs}",
        f"  schedule         {schedule}" if schedule else f"  schedule         {config.lr_scheduler_type}, peak lr "
        f"{config.learning_rate * plan.lr_scale:g}{_scaled(config, plan)}, {plan.warmup_steps} warmup step(s)",
        *objects,
        f"  seed             {config.seed}",
        f"  output           {config.output_dir}",
    ]
    lines += [f"  note             {line}" for line in unchecked_notes()]  # a library's internals relied on
    duplicated = duplicated_samples(plan, config, accelerator.num_processes, num_train_samples)
    if duplicated:
        lines.append(f"  note             {duplicated} sample(s) per epoch are trained twice: Accelerate evens out the "
                     f"last batches of {accelerator.num_processes} processes with samples from the start "
                     "(even_batches); --dataloader_drop_last drops the incomplete batches instead")
    return "\n".join(lines)


def _auto_note(accelerator: Accelerator, config: TrainConfig) -> str:
    if config.mixed_precision != "auto":
        return ""
    launcher, device = launcher_precision(), accelerator.device.type
    if launcher is not None:
        return f" (--mixed_precision auto: the launcher asked for {launcher})"
    if accelerator.mixed_precision == "bf16":
        return f" (--mixed_precision auto: this {device} computes bf16 natively; --mixed_precision no for fp32)"
    return f" (--mixed_precision auto: this {device} has no native bf16, so fp32; --mixed_precision bf16 to force it)"


def duplicated_samples(plan, config: TrainConfig, num_processes: int, num_train_samples: int | None) -> int:
    """Samples each epoch trains twice because Accelerate fills every process's last batch (even_batches)."""
    if num_processes == 1 or config.dataloader_drop_last or plan.batches_per_epoch is None or not num_train_samples \
            or config.max_tokens_per_batch:  # a token budget's plan deals every example once, in whole batches
        return 0
    return max(0, plan.batches_per_epoch * num_processes * config.per_device_train_batch_size - num_train_samples)


def _scaled(config: TrainConfig, plan) -> str:
    if plan.lr_scale == 1.0:
        return ""
    return (f" (--learning_rate {config.learning_rate:g} x {plan.lr_scale:.4g}: {config.scale_lr} scaling for a global "
            f"batch of {plan.global_batch_size} against {config.scale_lr_reference_batch})")


def _batch_line(accelerator: Accelerator, config: TrainConfig, plan, num_train_samples: int | None) -> str:
    """What a step holds: a fixed number of samples, or --max_tokens_per_batch's plan (a mean number of samples)."""
    shape = f"{accelerator.num_processes} processes x {config.gradient_accumulation_steps} accumulation"
    if not config.max_tokens_per_batch:
        return (f"{config.per_device_train_batch_size} per device x {shape} = {plan.global_batch_size} samples per "
                "step")
    mean = f"{num_train_samples / plan.steps_per_epoch:.1f}" if num_train_samples and plan.steps_per_epoch else "?"
    return (f"at most {config.max_tokens_per_batch} padded tokens per micro-batch (--max_tokens_per_batch; "
            f"--per_device_train_batch_size does not bound it) x {shape} = {mean} samples per step on average")
