"""FSDP and DeepSpeed: refuse a sharded back-end that was asked for but is not running, and adapt a run to the one
that is, before `accelerator.prepare`.

Accelerate enables FSDP and DeepSpeed only for GPU-like process groups (CUDA, XPU, NPU, ...). Launched with the
fsdp / deepspeed presets on CPU processes, it trains plain DDP and says nothing: full copies of the model on every
process, none of the memory the preset was chosen for. `check_engine` turns that into a LaunchError.

What `prepare_engine` adapts, and why:

* FSDP2 with the transformer-layer wrap: Accelerate (>= 1.14) makes every `_no_split_modules` class an FSDP unit
  and then shards the input embedding once more. Where one of those classes holds the embedding (BERT's
  BertEmbeddings), the second `fully_shard` meets parameters that are already DTensors, which torch reads as
  tensor parallelism ("DeviceMesh._concatenate ... value was None"). Such classes are left out of the per-layer
  units; the embedding still gets its own unit from Accelerate.
* DeepSpeed with an optimizer or scheduler in its JSON: Accelerate fills "auto" for the learning rate and weight
  decay only (betas and eps stay "auto" and DeepSpeed fails), clips at 1.0 whatever --max_grad_norm says, and
  divides the schedule's total steps by the number of processes (the rate reaches its end after 1/N of the run).
  Every "auto" of the optimizer, the schedule and the clipping is filled from the config and the plan, in
  optimizer steps (core/deepspeed_json.py), and so is a param the JSON leaves out where its optimizer or scheduler
  type takes it (DeepSpeed would run its own default); a flag given for a param left out that cannot be filled is
  refused (`refuse_unfilled_flags`). Accelerate only fills what is still "auto". An explicit JSON value that
  contradicts a flag the user gave is refused (the betas element by element), one beside a flag at its default is
  said (`check_explicit_values`), and the record and the start-up report state it where it runs.
  The JSON's optimizer is built in place of --optim's: an --optim that asks for another update is refused
  (`use_json_optimizer`), `adamw_torch_fused` sets its `fused`; with a scheduler in the JSON, a --lr_scheduler_type
  other than the default or --lr_scheduler_kwargs is refused (`use_json_scheduler`).
* ZeRO-3 saves the final model by gathering its shards, which DeepSpeed does only where its JSON says
  "stage3_gather_16bit_weights_on_model_save": true (its default and `accelerate config`'s: false), or the save fails
  after the whole run: a missing or "auto" key is set true and said, an explicit false refused
  (`gather_final_weights`, from `check_deepspeed_run`).
* DeepSpeed's accumulation count must be the flag's (`check_accumulation_count`) and divide each epoch's micro-batches
  (`refuse_short_windows`); --auto_find_batch_size is refused under both engines (`refuse_sharded_probe`).

`refuse_sum_loss` refuses, under DeepSpeed, a loss that returns sums, before anything is written (see there); a
recipe whose loss always returns sums calls `refuse_sums_under_deepspeed` as soon as its accelerator is built.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping

import torch
from accelerate import Accelerator
from accelerate.utils import send_to_device

from ..config import TrainConfig
from ..errors import ConfigError, LaunchError
from .data import take_examples, take_real_tokens
from .deepspeed_json import (
    GATHER_KEY,
    check_explicit_values,
    fill_deepspeed_config,
    gather_final_weights,
    refuse_unfilled_flags,
    use_json_optimizer,
    use_json_scheduler,
)

SHARDED_TYPES = ("FSDP", "DEEPSPEED")
_NAMES = {"FSDP": "FSDP", "DEEPSPEED": "DeepSpeed"}


def requested_engine() -> str | None:
    """"FSDP" or "DEEPSPEED" when the launcher (a preset, `accelerate config`, `--use_fsdp`, `--use_deepspeed`) asked
    for a sharded back-end, else None."""
    for name in SHARDED_TYPES:
        if os.environ.get(f"ACCELERATE_USE_{name}", "false").lower() in ("1", "true", "yes"):
            return name
    return None


def check_engine(accelerator: Accelerator) -> None:
    """Raise a LaunchError when FSDP or DeepSpeed was asked for and the prepared state is another type, or when the
    run is FSDP1 (see `refuse_fsdp1`)."""
    wanted, running = requested_engine(), accelerator.distributed_type.value
    if wanted is not None and running != wanted:
        name = _NAMES[wanted]
        if not _machine_has_accelerator():
            reason = (f"Accelerate enables {name} only on GPU-like devices (CUDA, XPU, NPU, ...) and this machine "
                      "has none")
        elif accelerator.device.type == "cpu":
            reason = ("ACCELERATE_USE_CPU is set (`--cpu`, `use_cpu: true` or `accel-train launch --cpu`), which runs "
                      f"the processes on the CPU, where Accelerate turns {name} off")
        else:
            reason = f"Accelerate did not enable it on {accelerator.device.type} devices"
        raise LaunchError(
            f"{name} was requested by the launcher (ACCELERATE_USE_{wanted}), but this run would be "
            f"{running} ({accelerator.num_processes} process(es), device {accelerator.device}): {reason}. It would "
            "train with a full, unsharded copy of the model on every process. On CPU, use "
            "accelerate_configs/cpu_multiprocess.yaml (DDP, the same result for a model that fits); for sharding, "
            "launch the preset on GPUs without --cpu (README, 'Choosing hardware').")
    if running == "FSDP":
        refuse_fsdp1(accelerator)


def refuse_fsdp1(accelerator: Accelerator) -> None:
    """FSDP1 is not supported: with Accelerate >= 1.7 its `load_state` restores no optimizer state in a fresh process
    (the template it loads into is built from an optimizer that has none yet), so a resumed run silently restarts
    Adam's moments; on CPU its export crashes in `get_state_dict`."""
    plugin = accelerator.state.fsdp_plugin
    if getattr(plugin, "fsdp_version", 2) == 1:
        raise LaunchError(
            "FSDP version 1 is not supported by accel_train: resuming from its checkpoints silently drops the "
            "optimizer state (Accelerate loads it into an optimizer that has no state yet), so a resumed run is not "
            "the run it continues. Use FSDP2: fsdp_version: 2 in the config (accelerate_configs/fsdp.yaml).")


def _machine_has_accelerator() -> bool:
    device_api = getattr(torch, "accelerator", None)  # torch >= 2.6
    if device_api is not None:
        return device_api.is_available()
    return torch.cuda.is_available()


def prepare_engine(accelerator: Accelerator, model: torch.nn.Module, config: TrainConfig, plan) -> None:
    """Adapt the Accelerate plugin of a sharded run to `model`, `config` and `plan` (module docstring). Call it
    before `accelerator.prepare`; for DDP or a single device it only checks the accumulation count
    (`check_accumulation_count`: an Accelerator of the user's own meets it here first)."""
    check_accumulation_count(accelerator, config)
    running = accelerator.distributed_type.value
    if running == "FSDP" and accelerator.is_fsdp2:
        carve_out_embedding(accelerator.state.fsdp_plugin, model)
    elif running == "DEEPSPEED":
        check_deepspeed_run(accelerator, config)  # as build_accelerator did; again for an Accelerator built elsewhere
        refuse_short_windows(config, plan)
        check_explicit_values(accelerator.state.deepspeed_plugin, config, plan)
        fill_deepspeed_config(accelerator.state.deepspeed_plugin, config, plan)


def check_deepspeed_run(accelerator: Accelerator, config: TrainConfig) -> None:
    """Under DeepSpeed, refuse an --optim or a schedule that its JSON config's optimizer or scheduler would replace
    (`use_json_optimizer`, `use_json_scheduler`; the optimizer's `fused` is passed on), a flag given for a param they
    leave out and that cannot be filled (`refuse_unfilled_flags`), --max_tokens_per_batch and
    --on_spike skip (the engine has applied the update when the loop judges the step); under ZeRO-3 fill, or refuse
    an explicit false, the key that lets the final model be gathered (`gather_final_weights`).
    They need only the config and the JSON: build_accelerator calls this, before a recipe loads its data or builds
    its model."""
    if accelerator.distributed_type.value != "DEEPSPEED":
        return
    if config.max_tokens_per_batch:
        raise ConfigError(
            f"--max_tokens_per_batch {config.max_tokens_per_batch} under DeepSpeed: its micro-batches hold varying "
            "numbers of examples, and DeepSpeed needs a fixed number per micro-batch (train_micro_batch_size_per_gpu) "
            "and steps inside backward, where the loop cannot weigh a step's micro-batches by their examples or "
            "tokens. Train the token budget with DDP or FSDP (a preset without DeepSpeed), or give DeepSpeed fixed "
            "batches (--per_device_train_batch_size).")
    if config.spike_window and config.on_spike == "skip":
        raise ConfigError(
            "--on_spike skip under DeepSpeed: DeepSpeed applies the update inside backward, before the loop sees the "
            "step's loss, so a spike's update would be kept in the weights and Adam's moments while the run says it "
            "was skipped. Use --on_spike rollback (it returns to the last checkpoint, undoing the update) or stop, "
            "or train with DDP or FSDP (a preset without DeepSpeed) to skip spikes.")
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    ds = plugin.deepspeed_config if plugin is not None else {}
    if "optimizer" in ds:
        use_json_optimizer(ds["optimizer"], config.optim)
    if "scheduler" in ds:
        use_json_scheduler(ds["scheduler"], config)
    refuse_unfilled_flags(ds, config)
    if gather_final_weights(ds):
        plugin.filled_gather = True  # engine_notes says it


def check_accumulation_count(accelerator: Accelerator, config: TrainConfig) -> None:
    """Refuse an accumulation count other than --gradient_accumulation_steps: the plan (steps per epoch, schedule,
    global batch, the start-up report) counts the flag's, and the loop steps on the accelerator's. Accelerate takes
    ACCELERATE_GRADIENT_ACCUMULATION_STEPS over the count it is given (`accelerate launch` exports it for DeepSpeed,
    from its --gradient_accumulation_steps or the YAML's), an Accelerator of the user's own has its own, and under
    DeepSpeed an explicit value in the JSON replaces the accelerator's at `prepare` (a JSON without the key counts as
    1): the run would train another number of epochs at another global batch than planned and reported."""
    asked = config.gradient_accumulation_steps
    running = accelerator.gradient_accumulation_steps
    env = os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if running != asked:
        source = (f"the launcher set ACCELERATE_GRADIENT_ACCUMULATION_STEPS={env} (`accelerate launch "
                  "--gradient_accumulation_steps`, or a DeepSpeed section's gradient_accumulation_steps in its YAML), "
                  f"which Accelerate takes over the script's" if env is not None and str(running) == env.strip() else
                  f"the Accelerator passed to train() accumulates {running} micro-batches")
        fix = ("drop --gradient_accumulation_steps from `accelerate launch` (and from its YAML) and give the count as "
               "the script's flag" if "launcher" in source else
               f"build it with Accelerator(gradient_accumulation_steps={asked}), or pass the count as the flag")
        raise ConfigError(f"--gradient_accumulation_steps {asked}, but {source}: the loop's plan (steps, schedule, "
                          f"global batch) would count {asked} micro-batch(es) a step and the loop step every "
                          f"{running}. Give the count in one place: {fix}.")
    if accelerator.distributed_type.value != "DEEPSPEED":
        return
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    ds = plugin.deepspeed_config if plugin is not None else {}
    json_count = ds.get("gradient_accumulation_steps", 1)  # Accelerate writes 1 into a JSON without the key
    if json_count != "auto" and json_count != asked:
        says = (f"says {json_count}" if "gradient_accumulation_steps" in ds else
                "has no \"gradient_accumulation_steps\", which Accelerate reads as 1")
        raise ConfigError(
            f"--gradient_accumulation_steps {asked}, but the DeepSpeed JSON config {says}, and DeepSpeed's count "
            "replaces the accelerator's at prepare: the loop's plan and the engine would disagree (another number "
            "of epochs, at another global batch than reported). Set \"gradient_accumulation_steps\": \"auto\" in "
            "the JSON and give the count as the script's flag.")


def refuse_short_windows(config: TrainConfig, plan) -> None:
    """Under DeepSpeed, refuse accumulation whose epoch ends in a short window. Accelerate steps at the loader's end,
    so 12 micro-batches per process with accumulation 5 end in a step of 2; the loop makes such a step the mean of its
    micro-batches by rescaling the gradients after backward (core/loss.py), but DeepSpeed divides every micro-batch by
    its full count and steps inside backward: that step would weigh 2/5 of the others. A stream's last window is
    unknown; a run that ends before its first epoch's last window is not affected."""
    gas, batches = config.gradient_accumulation_steps, plan.batches_per_epoch
    if gas == 1 or (batches is not None and (batches % gas == 0 or plan.total_steps < plan.steps_per_epoch)):
        return
    other = " or train with DDP or FSDP (a preset without DeepSpeed), which rescales a short last window."
    if batches is None:
        raise ConfigError(
            f"--gradient_accumulation_steps {gas} under DeepSpeed: the training set is a stream, whose last "
            f"accumulation window may hold fewer than {gas} micro-batches, and DeepSpeed divides each micro-batch by "
            f"{gas} inside backward, so that step would weigh less than the others. Use --gradient_accumulation_steps "
            f"1 (a larger --per_device_train_batch_size for the same global batch),{other}")
    short = batches % gas
    pairs = [(i, batches // i) for i in range(1, math.isqrt(batches) + 1) if batches % i == 0]
    divisors = sorted({d for pair in pairs for d in pair})[:12]
    choices = ", ".join(str(d) for d in divisors[:-1]) + f" or {divisors[-1]}" if len(divisors) > 1 else "1"
    raise ConfigError(
        f"--gradient_accumulation_steps {gas} under DeepSpeed: an epoch has {batches} micro-batches per process, so "
        f"its last step has {short}, and DeepSpeed divides every micro-batch by {gas} inside backward: that step would "
        f"weigh {short}/{gas} of the others. Choose --gradient_accumulation_steps {choices} (a divisor of {batches}), "
        f"or change the number of examples or the batch size so that {gas} divides the epoch's micro-batches,{other}")


def refuse_sharded_probe(accelerator: Accelerator, config: TrainConfig) -> None:
    """--auto_find_batch_size under FSDP or DeepSpeed: its probe runs before `prepare`, on the bare model with the
    whole model and two optimizer slots per parameter on each process (DDP's memory, not the sharded run's), and on
    ZeRO-3's empty partitions it crashes. build_accelerator calls this, and the probe again (an Accelerator of one's
    own)."""
    running = accelerator.distributed_type.value
    if config.auto_find_batch_size and running in SHARDED_TYPES:
        raise ConfigError(
            f"--auto_find_batch_size under {_NAMES[running]}: the probe runs the whole model, its gradients and "
            "optimizer state on each process before the engine shards them, so it measures DDP's memory, not this "
            "run's (it would halve a micro-batch that fits sharded, or give up; under ZeRO-3 the model holds only "
            "its empty partitions then). Drop --auto_find_batch_size and set --per_device_train_batch_size and "
            "--gradient_accumulation_steps for the global batch you want.")


def carve_out_embedding(plugin, model: torch.nn.Module) -> list[str] | None:
    """With the transformer-layer wrap, set the plugin's classes to wrap to the model's `_no_split_modules` (or the
    configured classes) minus those whose modules hold the input embedding; return the classes, or None when the
    plugin does not wrap by transformer layer."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    policy = plugin.auto_wrap_policy
    if getattr(policy, "func", policy) is not transformer_auto_wrap_policy:
        return None
    names = sorted(plugin.transformer_cls_names_to_wrap or getattr(model, "_no_split_modules", None) or [])
    embedding = getattr(model, "get_input_embeddings", lambda: None)()
    if embedding is None:
        return names
    holders = {type(m).__name__ for m in model.modules() if any(sub is embedding for sub in m.modules())}
    plugin.transformer_cls_names_to_wrap = [name for name in names if name not in holders]
    return plugin.transformer_cls_names_to_wrap


def engine_notes(accelerator: Accelerator) -> list[str]:
    """What the start-up report must add when a DeepSpeed JSON, not the config, chose the optimizer or schedule, or set
    values explicitly that flags left at their defaults would have given otherwise (`check_explicit_values`)."""
    if accelerator.distributed_type.value != "DEEPSPEED":
        return []
    ds, notes = accelerator.state.deepspeed_plugin.deepspeed_config, []
    if "optimizer" in ds:
        params = ds["optimizer"].get("params", {})
        kernel = (", torch's fused kernel" if params.get("fused") is True else ", torch's" if params.get("torch_adam")
                  else ", DeepSpeed's own kernel")
        notes.append(f"the optimizer is DeepSpeed's {ds['optimizer'].get('type')}{kernel}, from its JSON config "
                     "(not built from --optim; its \"auto\" values come from --learning_rate, --adam_beta1/2, "
                     "--adam_epsilon, --weight_decay)")
    if "scheduler" in ds:
        notes.append(f"the schedule is DeepSpeed's {ds['scheduler'].get('type')} from its JSON config, not "
                     "--lr_scheduler_type (the pre-flight simulates it as the engine steps it)")
    plugin = accelerator.state.deepspeed_plugin
    explicit = getattr(plugin, "explicit_json_values", {})  # check_explicit_values
    if explicit:
        values = ", ".join(f"{json.dumps(key)}: {json.dumps(value)}" for key, value in explicit.items())
        flags = ", ".join(f"--{flag}" for flag in getattr(plugin, "explicit_json_flags", []))
        notes.append(f"the DeepSpeed JSON config sets {values} explicitly: DeepSpeed runs them, not {flags} at their "
                     "defaults (set them to \"auto\" in the JSON to take the flags)")
    if getattr(plugin, "filled_gather", False):  # check_deepspeed_run
        notes.append(f"the DeepSpeed config leaves \"zero_optimization.{GATHER_KEY}\" unset (DeepSpeed's "
                     "default: false): set true, so that the final model is gathered from the ZeRO-3 shards and saved")
    return notes



def refuse_sums_under_deepspeed(accelerator: Accelerator, what: str) -> None:
    """Under DeepSpeed, a ConfigError for a loss that returns sums; `what` names the loss and how that is known.

    The loop makes a sum loss's step exact by scaling the window's gradients by its item count before the optimizer
    step (core/loss.py); DeepSpeed steps inside `backward`, so that moment never comes."""
    if accelerator.distributed_type.value == "DEEPSPEED":
        raise ConfigError(f"{what} returns sums ('loss_sum', 'num_items'), whose gradients the loop scales by the item "
                          "count of the whole accumulation window before the optimizer step, and DeepSpeed steps "
                          "inside backward: train per-token losses with DDP or FSDP (a preset without DeepSpeed), or "
                          "return the micro-batch mean as 'loss'.")


def refuse_sum_loss(accelerator: Accelerator, model: torch.nn.Module, loss_fn: Callable, train_loader) -> None:
    """Under DeepSpeed, refuse a loss that returns sums (`refuse_sums_under_deepspeed`) before anything is written.

    What a loss function returns is known only by calling it: here, once, on the training set's first micro-batch,
    read by index (no sampler, no random number drawn), the prepared model in evaluation mode, without gradients,
    the random generators put back afterwards. A stream is not read ahead (its first batch would be consumed): its
    sum loss is refused by the loop at the first micro-batch, as is a loss that switches to sums later."""
    if accelerator.distributed_type.value != "DEEPSPEED":
        return
    dataset = getattr(train_loader, "dataset", None)
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__") or not len(dataset):
        return
    size = min(getattr(train_loader, "batch_size", None) or 1, len(dataset))
    batch = train_loader.collate_fn([dataset[i] for i in range(size)])
    take_real_tokens(batch)  # a packed batch's counts of tokens and examples are no model input (as in the loop)
    take_examples(batch, 0)
    was_training = model.training
    cuda = [accelerator.device] if accelerator.device.type == "cuda" else []
    try:
        model.eval()
        with torch.random.fork_rng(devices=cuda), torch.no_grad(), accelerator.autocast():
            out = loss_fn(model, send_to_device(batch, accelerator.device))
    finally:
        model.train(was_training)
    if isinstance(out, Mapping) and "loss_sum" in out:
        refuse_sums_under_deepspeed(accelerator, "the loss function (called on the first training batch, before "
                                                 "anything was written)")
