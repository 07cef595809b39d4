"""A DeepSpeed JSON config against the run's flags: what its "auto" values mean for this run (filled here, in optimizer
steps), and its explicit values, optimizer and scheduler where a flag asked for something else (refused by name).

DeepSpeed runs what its JSON says, and its own defaults for a param the JSON leaves out. Accelerate fills only some
"auto" values (the learning rate and weight decay; betas and eps stay "auto" and DeepSpeed fails), clips at 1.0
whatever --max_grad_norm says, and divides a scheduler's total steps by the number of processes; the values it does
not fill, those left out, and the JSON's explicit ones, it never compares with the flags. core/sharded.py calls
these before `accelerator.prepare`; `engine_clipping`, `engine_schedule` and `json_schedule_line` give the record of
what ran (config.yaml's what_ran) and the start-up report the values the engine runs.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..config import TrainConfig
from ..errors import ConfigError


def deepspeed_values(config: TrainConfig, plan) -> dict[str, Any]:
    """What each "auto" of a DeepSpeed JSON's optimizer, scheduler and clipping means for this run, in optimizer
    steps. DeepSpeed's warmup needs at least one step (it rejects 0)."""
    peak = config.learning_rate * plan.lr_scale
    return {
        "optimizer.params.lr": peak,
        "optimizer.params.betas": [config.adam_beta1, config.adam_beta2],
        "optimizer.params.eps": config.adam_epsilon,
        "optimizer.params.weight_decay": config.weight_decay,
        "optimizer.params.momentum": config.sgd_momentum,
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": peak,
        "scheduler.params.warmup_num_steps": max(1, plan.warmup_steps),
        "scheduler.params.total_num_steps": plan.total_steps,
        "gradient_clipping": config.max_grad_norm if config.max_grad_norm > 0 else 0.0,
    }


# The flags each value of `deepspeed_values` (and the micro-batch Accelerate fills) stands for, the one named first;
# the peak rate is --learning_rate scaled by --scale_lr, so an explicit rate replaces both.
PEAK = ("learning_rate", "scale_lr")
JSON_FLAGS = {
    "optimizer.params.lr": PEAK, "optimizer.params.betas": ("adam_beta1", "adam_beta2"),
    "optimizer.params.eps": ("adam_epsilon",), "optimizer.params.weight_decay": ("weight_decay",),
    "optimizer.params.momentum": ("sgd_momentum",), "scheduler.params.warmup_max_lr": PEAK,
    "scheduler.params.warmup_num_steps": ("warmup_steps", "warmup_ratio"),
    "scheduler.params.total_num_steps": ("max_steps", "num_train_epochs"), "gradient_clipping": ("max_grad_norm",),
    "train_micro_batch_size_per_gpu": ("per_device_train_batch_size",),
}
# Values that are a list of one flag's value per element (the others stand for the whole value, any flag named):
# compared element by element, so that a JSON's [0.8, 0.99] runs beside --adam_beta1 0.8 and --adam_beta2 unset.
PER_ELEMENT = ("optimizer.params.betas",)
# Values the run takes from elsewhere, so that an explicit one other than the flag's never runs, the flag given or not
# (flag, what runs instead): every param group accel_train builds carries its decay (0.0 for biases and norms) and
# Accelerate hands DeepSpeed the groups, whose own values override the JSON's optimizer params; each process trains
# the prepared loader's batches, and DeepSpeed, which batches no data here, counts samples with its micro-batch only
# (train_batch_size = micro-batch x accumulation x processes, its throughput and sample counters).
NEVER_RUN = {
    "optimizer.params.weight_decay": ("weight_decay", "accel_train's param groups carry --weight_decay ({value}; 0.0 "
                                      "for biases and norms) and DeepSpeed builds its optimizer from them, a group's "
                                      "own value before the JSON's"),
    "train_micro_batch_size_per_gpu": ("per_device_train_batch_size", "each process trains the loader's batches of "
                                       "--per_device_train_batch_size ({value}), and DeepSpeed only counts samples "
                                       "with its micro-batch (its train_batch_size, throughput and sample counters)"),
}


def check_explicit_values(plugin, config: TrainConfig, plan) -> dict[str, Any]:
    """A DeepSpeed JSON's explicit values run, not the flags' (only "auto" is filled): one that contradicts a flag the
    user gave (`config.given`) is refused, naming both (a pair such as the betas element by element: --adam_beta1
    against the first); those beside a flag left at its default are returned and kept on the plugin as
    `explicit_json_values`, with the flags they replace as `explicit_json_flags`, which `engine_notes` reports. A
    value the run takes from elsewhere (NEVER_RUN: the weight decay the param groups carry, the loader's micro-batch)
    never runs, so an explicit one other than the flag's is refused whether the flag was given or not."""
    wanted = {**deepspeed_values(config, plan), "train_micro_batch_size_per_gpu": config.per_device_train_batch_size}
    differ: dict[str, Any] = {}
    replaced: list[str] = []
    for key in JSON_FLAGS:
        node, leaf = plugin.hf_ds_config.find_config_node(key)
        if node is None or node.get(leaf, "auto") == "auto" or _same(node[leaf], wanted[key]):
            continue
        stand_for = _flags_replaced(key, node[leaf], wanted[key])
        if key in NEVER_RUN:
            _refuse_never_run(key, node[leaf], config)
        given = _asked(stand_for, config)
        if given:
            raise ConfigError(
                f"--{given[0]} {getattr(config, given[0])}, but the DeepSpeed JSON config sets \"{key}\": "
                f"{json.dumps(node[leaf])}, which DeepSpeed would run instead (the flags give {json.dumps(wanted[key])}"
                "; accel_train fills only \"auto\" values), while config.yaml and the start-up report would record "
                f"the flag. Set \"{key}\" to \"auto\" in the JSON to take the flag, or drop --{given[0]} to run the "
                "JSON's value.")
        differ[key] = node[leaf]
        replaced += stand_for if key in PER_ELEMENT else stand_for[:1]  # the one named first
    plugin.explicit_json_values = differ
    plugin.explicit_json_flags = list(dict.fromkeys(replaced))
    return differ


def _asked(flags: tuple[str, ...], config: TrainConfig, zero_asks: bool = True) -> list[str]:
    """Those of `flags` the user gave (`config.given`) that ask for something: --scale_lr none asks for no scaling,
    and where `zero_asks` is False a 0 (no warmup) asks for nothing either."""
    return [flag for flag in flags if flag in config.given and getattr(config, flag) != "none"
            and (zero_asks or bool(getattr(config, flag)))]


def _refuse_never_run(key: str, value: Any, config: TrainConfig) -> None:
    flag, why = NEVER_RUN[key]
    raise ConfigError(
        f"the DeepSpeed JSON config sets \"{key}\": {json.dumps(value)}, which would not run: "
        f"{why.format(value=getattr(config, flag))}. Set \"{key}\" to \"auto\" in the JSON and give --{flag} "
        f"{json.dumps(value)}.")


def _flags_replaced(key: str, value: Any, wanted: Any) -> tuple[str, ...]:
    """The flags a JSON value other than `wanted` replaces: for a per-element value, those of the elements that
    differ; else all the flags the value stands for."""
    flags = JSON_FLAGS[key]
    if key in PER_ELEMENT and isinstance(value, list) and len(value) == len(flags) == len(wanted):
        return tuple(flag for flag, theirs, ours in zip(flags, value, wanted, strict=True) if not _same(theirs, ours))
    return flags


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9)
    return a == b


# The params of `deepspeed_values` that each optimizer / scheduler type takes, filled where the JSON leaves them out as
# where it says "auto": DeepSpeed (or torch) would build them with its own defaults whatever the flags say (lr 1e-3,
# betas (0.9, 0.999), a warmup of 1000 steps, WarmupDecayLR's peak 0.001; WarmupDecayLR and WarmupCosineLR fail
# without a total). Every optimizer takes a rate (any other type: "lr" only); the --adam_* flags are Adam's and
# AdamW's, --sgd_momentum is SGD's. WarmupLR's peak is not filled: its default is each param group's own rate (the
# JSON's "lr", filled from the flags or set, or a group's own such as --layerwise_lr_decay's). The weight decay is
# the groups' own (NEVER_RUN), and warmup_min_lr's default, 0, is the value "auto" takes.
OPTIMIZER_TAKES = {"adam": ("lr", "betas", "eps"), "adamw": ("lr", "betas", "eps"), "sgd": ("lr", "momentum")}
SCHEDULER_TAKES = {"WarmupLR": ("warmup_num_steps",),
                   "WarmupDecayLR": ("warmup_max_lr", "warmup_num_steps", "total_num_steps"),
                   "WarmupCosineLR": ("warmup_num_steps", "total_num_steps")}
# DeepSpeed's schedulers that set every group's rate from their own params, whatever the optimizer's rate
OWN_RATES = {"OneCycle": "cycle_min_lr, cycle_max_lr", "LRRangeTest": "lr_range_test_min_lr"}


def filled_when_missing(ds: dict[str, Any]) -> set[str]:
    """The keys of `deepspeed_values` that `fill_deepspeed_config` fills where the JSON `ds` leaves them out."""
    keys = {"gradient_clipping"}  # DeepSpeed's default is 1.0, and Accelerate fills only "auto"
    if "optimizer" in ds:
        kind = str(ds["optimizer"].get("type", "")).lower()
        keys |= {f"optimizer.params.{leaf}" for leaf in OPTIMIZER_TAKES.get(kind, ("lr",))}
    if "scheduler" in ds:
        keys |= {f"scheduler.params.{leaf}" for leaf in SCHEDULER_TAKES.get(ds["scheduler"].get("type"), ())}
    return keys


def fill_deepspeed_config(plugin, config: TrainConfig, plan) -> dict[str, Any]:
    """Replace the "auto" values `deepspeed_values` knows in the plugin's DeepSpeed config, and those its optimizer or
    scheduler type takes that the JSON leaves out (`filled_when_missing`, "gradient_clipping" too); return what was
    filled. Values the JSON sets explicitly are left as they are (`check_explicit_values` compares them)."""
    ds = plugin.hf_ds_config.config
    missing_too = filled_when_missing(ds)
    for section in ("optimizer", "scheduler"):
        if section in ds and any(key.startswith(f"{section}.") for key in missing_too):
            ds[section].setdefault("params", {})
    filled = {}
    for key, value in deepspeed_values(config, plan).items():
        node, leaf = plugin.hf_ds_config.find_config_node(key)
        missing = "auto" if key in missing_too else None
        if node is not None and node.get(leaf, missing) == "auto":
            node[leaf] = value
            filled[key] = value
    return filled


# DeepSpeed's key that lets `accelerator.get_state_dict` gather the ZeRO-3 shards into the final model's weights.
GATHER_KEY = "stage3_gather_16bit_weights_on_model_save"


def gather_final_weights(ds: dict[str, Any]) -> bool:
    """Under ZeRO-3 (or DeepSpeed's tensor parallelism) the final model is saved by gathering the shards, which
    DeepSpeed does only where `zero_optimization.stage3_gather_16bit_weights_on_model_save` is true; its default is
    false (so is `accelerate config`'s), and Accelerate fills neither a missing key nor "auto" with anything else.
    The save would then fail after the whole run (Accelerate's "Cannot get 16bit model weights"), with no model
    written. A missing or "auto" key is set true here, True returned (the start-up report says so); an explicit false
    is refused before training: Accelerate has no other way to gather the weights into a model file."""
    zero = ds.get("zero_optimization") or {}
    sharded = zero.get("stage") == 3 or (ds.get("tensor_parallel") or {}).get("autotp_size", 0) > 1
    if not sharded or zero.get(GATHER_KEY, "auto") is True:
        return False
    if zero.get(GATHER_KEY, "auto") == "auto":
        ds.setdefault("zero_optimization", zero)[GATHER_KEY] = True
        return True
    raise ConfigError(
        f"the DeepSpeed config sets \"zero_optimization.{GATHER_KEY}\": {json.dumps(zero[GATHER_KEY])} under ZeRO-3: "
        "the final model is saved by gathering the sharded weights, which DeepSpeed then refuses, so the run would "
        "fail after training with no model saved. Set it to true in the DeepSpeed JSON config (or leave it out: "
        "accel_train fills true), or, with an Accelerate YAML without a JSON file, set "
        "`zero3_save_16bit_model: true` under its deepspeed_config (`accelerate config`: save 16-bit weights, yes).")


def _engine_config(state) -> dict[str, Any] | None:
    """The DeepSpeed config a run under DeepSpeed prepared its engine with; None for a run without DeepSpeed.
    `state`: Accelerate's AcceleratorState, or None."""
    if state is None or getattr(state.distributed_type, "value", None) != "DEEPSPEED":
        return None
    return state.deepspeed_plugin.deepspeed_config


def engine_clipping(state) -> float | None:
    """The norm a DeepSpeed engine clips the gradients to (0: not at all): its config's "gradient_clipping", the JSON's
    explicit value or the one `fill_deepspeed_config` filled from --max_grad_norm; None for a run without DeepSpeed (the
    loop clips at --max_grad_norm). `state`: Accelerate's AcceleratorState, or None."""
    ds = _engine_config(state)
    return None if ds is None else float(ds.get("gradient_clipping", 1.0))  # DeepSpeed's default


def engine_schedule(state, scheduler) -> dict[str, Any] | None:
    """What the record says of a schedule a DeepSpeed JSON's "scheduler" built (None: no such schedule): who built it
    and each param group's peak rate as that scheduler holds it ("peaks"; None where the groups' `initial_lr` says it,
    as a torch scheduler's). DeepSpeed's WarmupLR, WarmupDecayLR and OneCycle keep theirs in `max_lrs`,
    WarmupCosineLR in `org_lrs`: built, they set every group's rate to the warmup's start (0 by default) and keep no
    `initial_lr`. `state`: Accelerate's AcceleratorState, or None; `scheduler`: the one inside the wrappers."""
    ds = _engine_config(state)
    if ds is None or "scheduler" not in ds:
        return None
    peaks = getattr(scheduler, "max_lrs", None) or getattr(scheduler, "org_lrs", None)
    return {"given": "DeepSpeed's JSON config (\"scheduler\"; --lr_scheduler_type does not apply)",
            "peaks": [float(peak) for peak in peaks] if peaks else None}


def json_schedule_line(accelerator, config: TrainConfig, plan) -> str | None:
    """The start-up report's schedule line where a DeepSpeed JSON decides the schedule or its peak, in the values the
    engine runs (None: the line built from the flags is true): the JSON's scheduler with its own peak and warmup, or
    accel_train's schedule over an optimizer "lr" the JSON sets explicitly (the flags' "auto" values are filled)."""
    if getattr(accelerator.distributed_type, "value", None) != "DEEPSPEED":
        return None
    plugin = accelerator.state.deepspeed_plugin
    ds = plugin.deepspeed_config
    explicit = getattr(plugin, "explicit_json_values", {})  # check_explicit_values
    if "scheduler" in ds:
        params = ds["scheduler"].get("params", {})
        said = [f"DeepSpeed's {ds['scheduler'].get('type')} (its JSON config's scheduler)"]
        if "warmup_max_lr" in params:
            said.append(f"peak lr {params['warmup_max_lr']}")
        if "warmup_num_steps" in params:
            said.append(f"{params['warmup_num_steps']} warmup step(s)")
        return ", ".join(said)
    if "optimizer.params.lr" in explicit:
        return (f"{config.lr_scheduler_type}, peak lr {explicit['optimizer.params.lr']:g} (the DeepSpeed JSON config's "
                f"\"optimizer.params.lr\"; --learning_rate does not apply), {plan.warmup_steps} warmup step(s)")
    return None


def use_json_optimizer(ds_optimizer: dict[str, Any], optim: str) -> None:
    """--optim against the optimizer a DeepSpeed JSON names, which DeepSpeed builds in place of --optim's: the same
    update runs as asked, another one is refused (the JSON's would replace it without a word). `adamw_torch_fused`
    with the JSON's `torch_adam` AdamW sets its `fused` (DeepSpeed passes its params to torch.optim.AdamW); without
    `torch_adam` DeepSpeed builds its own Adam kernels, fused already."""
    kind = str(ds_optimizer.get("type", "")).lower()
    params = ds_optimizer.setdefault("params", {})
    builds = {"adamw": "adamw", "adam": "adamw" if params.get("adam_w_mode", True) else "adam"}.get(kind, kind)
    same = {"adamw": ("adamw", "adamw_torch", "adamw_torch_fused"), "adam": ("adam",)}.get(builds, ())
    json_name = f"{ds_optimizer.get('type')}{' (decoupled weight decay)' if builds == 'adamw' else ''}"
    if optim not in same and optim != "adamw":  # the default asks for nothing: the JSON's choice stands, and is said
        raise ConfigError(
            f"--optim {optim} asks for another update than the DeepSpeed JSON config's optimizer, {json_name}, "
            "which DeepSpeed would build instead. Remove the \"optimizer\" section from the JSON (accel_train then "
            "builds --optim and DeepSpeed shards its state) or drop --optim.")
    if optim == "adamw_torch_fused" and params.get("torch_adam"):
        if params.get("fused", True) is not True:
            raise ConfigError(f"--optim adamw_torch_fused, but the DeepSpeed JSON config's optimizer sets \"fused\": "
                              f"{json.dumps(params['fused'])}: drop one of the two.")
        params["fused"] = True


def refuse_unfilled_flags(ds: dict[str, Any], config: TrainConfig) -> None:
    """A flag the user gave for a param the JSON's optimizer or scheduler leaves out and `fill_deepspeed_config` does
    not fill would not run: --adam_beta1/2 or --adam_epsilon beside an optimizer other than Adam, AdamW or SGD without
    "betas" / "eps" (--sgd_momentum without "momentum"), whose param accel_train cannot tell it takes; --warmup_steps
    or --warmup_ratio beside a scheduler with no "warmup_num_steps" to fill; --learning_rate or --scale_lr beside one
    that sets every rate itself (OWN_RATES). Refused, with what to do (a flag of another optimizer, such as
    --sgd_momentum beside AdamW, asks nothing of it, as without DeepSpeed)."""
    optimizer, scheduler = ds.get("optimizer"), ds.get("scheduler")
    if optimizer is not None and str(optimizer.get("type", "")).lower() not in OPTIMIZER_TAKES:
        kind, params = optimizer.get("type"), optimizer.get("params") or {}
        for leaf, flags in (("betas", ("adam_beta1", "adam_beta2")), ("eps", ("adam_epsilon",)),
                            ("momentum", ("sgd_momentum",))):
            given = _asked(flags, config) if leaf not in params else []
            if given:
                raise ConfigError(
                    f"--{given[0]} {getattr(config, given[0])}, but the DeepSpeed JSON config's optimizer, {kind}, "
                    f"has no \"{leaf}\", and accel_train fills it from the flags only for Adam, AdamW and SGD: "
                    f"DeepSpeed would build {kind} with its own default, and --{given[0]} would not run. Set "
                    f"\"{leaf}\" in its params (\"auto\" takes the flag's value) if {kind} takes it, or drop "
                    f"--{given[0]}.")
    if scheduler is None:
        return
    kind, params = scheduler.get("type"), scheduler.get("params") or {}
    takes = "WarmupLR, WarmupDecayLR or WarmupCosineLR"
    warmup = _asked(("warmup_steps", "warmup_ratio"), config, zero_asks=False)
    if warmup and kind not in SCHEDULER_TAKES and "warmup_num_steps" not in params:
        raise ConfigError(
            f"--{warmup[0]} {getattr(config, warmup[0])}, but the DeepSpeed JSON config's scheduler, {kind}, has no "
            f"warmup accel_train can set (it fills \"warmup_num_steps\" for {takes}): DeepSpeed would step it "
            f"without the warmup asked for. Use one of those (its warmup is filled from the flag), or drop "
            f"--{warmup[0]}.")
    peak = _asked(PEAK, config)
    if peak and kind in OWN_RATES:
        raise ConfigError(
            f"--{peak[0]} {getattr(config, peak[0])}, but the DeepSpeed JSON config's scheduler, {kind}, sets every "
            f"rate from its own params ({OWN_RATES[kind]}) over the optimizer's, so --{peak[0]} would not run. Set "
            f"the rates in its params and drop --{peak[0]}, or use {takes}, whose peak comes from the flags.")


def use_json_scheduler(ds_scheduler: dict[str, Any], config: TrainConfig) -> None:
    """A DeepSpeed JSON's scheduler, which DeepSpeed steps in place of the schedule accel_train builds: with
    --lr_scheduler_type at its default and no --lr_scheduler_kwargs nothing else was asked for, and the JSON's stands
    (the start-up report says so); a schedule asked for by name or with arguments is refused (the JSON's would
    replace it without a word): by `check_deepspeed_run`, before a recipe has loaded anything."""
    default = TrainConfig.__dataclass_fields__["lr_scheduler_type"].default
    asked = [f"--lr_scheduler_type {config.lr_scheduler_type}"] if config.lr_scheduler_type != default else []
    asked += ["--lr_scheduler_kwargs"] if config.lr_scheduler_kwargs else []
    if asked:
        raise ConfigError(
            f"{' and '.join(asked)} (given, or the recipe's or its config's default) asks for a schedule, and the "
            f"DeepSpeed JSON config has a scheduler, {ds_scheduler.get('type')}, which DeepSpeed would step instead. "
            "Remove the \"scheduler\" section from the JSON (accel_train then builds the schedule asked for, over "
            f"DeepSpeed's optimizer), or pass --lr_scheduler_type {default} and no --lr_scheduler_kwargs to train "
            "with the JSON's.")
