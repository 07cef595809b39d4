"""verify's packing check: examples packed into one row (--packing) or written as one row per micro-batch
(--padding_free) do not see each other, so a packed step computes what the same examples padded compute: step 1's
loss and gradient norm within PACKING_RTOL relative.

Relevant when the run packs: the reference run's config.yaml says `packing: true` or `padding_free: true` (the text
recipes' flags, accel_train.tasks.text.generation); before the reference has run, the user's flags (and their
--config YAML) say it. Otherwise the check is not applicable and starts nothing.

The variants, each of one step, in fp32 (`--mixed_precision no`: the tolerance is measured in fp32):

* --padding_free keeps each micro-batch's examples, so the padded side is the user's run with `--padding_free
  false`; the packed side is the reference run's step 1 when it ran in fp32, else a 1-step variant of its own.
* --packing regroups examples into rows (best-fit decreasing), so no step of B padded examples holds what a step of B
  packed rows holds. Both sides then train one step on the same N = PACKING_EXAMPLES examples (`--max_train_samples
  N`, a seeded subset the script draws before packing) in one batch of N (`--per_device_train_batch_size N`: all the
  packed rows, at most N, or all N padded examples; no accumulation; `--dataloader_drop_last false`); the padded side
  drops --max_seq_length (it shapes packed rows only). A script without --max_train_samples, or with
  --packing_split (pieces of an example are documents of their own: no padded batch holds them), makes the check
  not applicable, said: read from the reference run's config.yaml, so `--checks packing` alone runs the reference
  first (else the packed variant would be given a flag the script refuses).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import yaml

from ..rundir.layout import CONFIG
from .checks import FAILED, NOT_APPLICABLE, PASSED, Result, Runs
from .evidence import precision_of, relative_difference, train_records

# Step 1 of the same examples packed against padded, fp32, 2 shared CPU cores: the text-generation recipe's tiny Llama
# (48 date pairs) 1.0e-7 relative on the loss, 0 on the gradient norm with --packing (16 examples in one batch);
# 0 and 6.0e-8 with --padding_free (its reference run's step 1); the seeded twin's GPT-2 9.4e-8 and 8.0e-8. The
# same float32 numbers summed over other row shapes (both sides in fp32, like accumulation's fp32 noise: 1.5e-7).
# Examples that see each other moved the seeded bug's gradient norm by 3.1 % (padding-free) and 4.8 % (packing),
# its loss by 0.15 %.
PACKING_RTOL = 1e-4
PACKING_EXAMPLES = 16  # --packing: the examples both sides train their one step on
LAYOUT_FLAGS = ("packing", "padding_free")
ROWS_ONLY_FLAGS = ("max_seq_length",)  # shape packed rows; a padded run refuses them

NOT_ISOLATED = "packed examples not isolated"
ISOLATION = (
    "Likely cause: the examples packed into one row see each other, or the loss weighs a packed row otherwise than "
    "the examples in it. A packed row is the padded batch's computation only when (1) position ids restart at 0 at "
    "every example (the model's positions, and how transformers' attention finds where an example starts); (2) the "
    "batch has no attention_mask and says use_cache=False (with either, transformers builds a plain causal mask over "
    "the whole row, and the examples attend to each other); (3) the model's attention reads the restarts (sdpa, "
    "eager, flex or flash_attention_2 in transformers; a model of your own must build a block-diagonal causal mask "
    "from them); (4) each example's first label is -100 (else a row scores the prediction of one example's first "
    "token from the one before); (5) the loss is a token sum and count (a mean per row weighs a row's tokens by the "
    "row). What to change: batch with accel_train.tasks.text.generation's PackedCollator (rows of pack_examples, or "
    "flatten=True for padding-free), and call check_isolation(model, vocab_size, flag) before training: it refuses "
    "a model whose logits change when another example is packed before it.")


def packing(runs: Runs) -> Result:
    """Step 1 of packed (or padding-free) batches against the same examples padded: loss and gradient norm within
    PACKING_RTOL relative (module docstring)."""
    verify = runs.verify
    tolerance = {"loss": f"relative {PACKING_RTOL:g}", "grad_norm": f"relative {PACKING_RTOL:g}",
                 "why": "the same float32 numbers summed over other row shapes: at most 1.0e-7 relative measured "
                        "(a tiny Llama, a tiny GPT-2); examples that see each other moved the gradient norm by 3-5 %"}
    config = reference_config(runs)
    layout = layout_of(config, verify.script_args)
    if layout is None:
        source = "the reference run's config.yaml" if config is not None else "the script's flags"
        return Result(NOT_APPLICABLE, {"reason": f"the run neither packs nor goes padding-free ({source}: no "
                                       "--packing, no --padding_free): nothing to compare"}, tolerance)
    if layout == "padding_free":
        packed, padded, examples = padding_free_sides(runs)
    else:
        if config is None:  # --checks packing alone: the reference's config.yaml says whether it can be compared
            runs.finished("reference")
            config = reference_config(runs)
        refused = packing_refused(config, verify.script_args)
        if refused:
            return Result(NOT_APPLICABLE, {"reason": refused}, tolerance)
        packed, padded, examples = packing_sides(runs)
    first_packed = train_records(packed.output_dir).get(1, {})
    first_padded = train_records(padded.output_dir).get(1, {})
    measured = {"layout": layout, "examples": examples, "compared_at_step": 1,
                "loss": [first_packed.get("loss"), first_padded.get("loss")],
                "grad_norm": [first_packed.get("grad_norm"), first_padded.get("grad_norm")]}
    measured["loss_relative"] = relative_difference(*measured["loss"])
    measured["grad_norm_relative"] = relative_difference(*measured["grad_norm"])
    result = Result(PASSED, measured, tolerance, [packed.name, padded.name])
    worst = max(measured["loss_relative"], measured["grad_norm_relative"])
    if not worst <= PACKING_RTOL or math.isnan(worst):
        result.status = FAILED
        result.cause, result.diagnosis = NOT_ISOLATED, packing_cause(measured)
    return result


def padding_free_sides(runs: Runs):
    """(packed, padded, None): the reference when it ran in fp32, else a 1-step padding-free run; the padded run."""
    verify = runs.verify
    reference = runs.done.get("reference")
    usable = reference is not None and reference.returncode == 0 and \
        precision_of(reference.output_dir, verify.steps) == "fp32"
    packed = reference if usable else runs.finished("packing-packed", max_steps=1, mixed_precision="no")
    padded = runs.finished("packing-padded", ["--padding_free", "false"], max_steps=1, mixed_precision="no")
    return packed, padded, None


def packing_sides(runs: Runs):
    """(packed, padded, N): one step each over the same N examples in one batch."""
    verify = runs.verify
    examples = PACKING_EXAMPLES
    given = _flag_value(verify.script_args, "max_train_samples")
    if given is not None and given.isdigit():
        examples = min(examples, int(given))
    same = {"max_steps": 1, "mixed_precision": "no", "max_train_samples": examples,
            "per_device_train_batch_size": examples, "gradient_accumulation_steps": 1,
            "dataloader_drop_last": "false"}
    packed = runs.finished("packing-packed", **same)
    unpacked = Runs(_without_flags(verify, ROWS_ONLY_FLAGS), runs.interrupts, runs.runner)
    try:
        padded = unpacked.finished("packing-padded", ["--packing", "false"], **same)
    finally:
        runs.done.update(unpacked.done)  # the certificate lists it with the others
    return packed, padded, examples


def reference_config(runs: Runs) -> dict | None:
    """The reference run's resolved config (config.yaml) when a check ran it, else None: nothing is started here."""
    reference = runs.done.get("reference")
    path = reference.output_dir / CONFIG if reference is not None else None
    if path is None or not path.is_file():
        return None
    return yaml.safe_load(path.read_text()) or {}


def layout_of(config: dict | None, script_args: list[str]) -> str | None:
    """"packing", "padding_free" or None: from the resolved config, else from the flags (and their --config YAML)."""
    if config is None:
        config = {}
        named = _flag_value(script_args, "config")
        if named and Path(named).is_file():
            config = yaml.safe_load(Path(named).read_text()) or {}
        config = {name: config.get(name) for name in LAYOUT_FLAGS}
        for name in LAYOUT_FLAGS:
            given = _bool_flag(script_args, name)
            if given is not None:
                config[name] = given
    return next((name for name in LAYOUT_FLAGS if config.get(name) is True), None)


def packing_refused(config: dict | None, script_args: list[str]) -> str | None:
    """Why --packing cannot be compared with padded batches of the same examples, or None."""
    if config is not None and "max_train_samples" not in config:
        return ("the script has no --max_train_samples (not in its config.yaml): verify cannot give the packed and the "
                "padded run the same examples in one step")
    split = config.get("packing_split") if config is not None else _bool_flag(script_args, "packing_split")
    if split:
        return ("--packing_split cuts long examples into pieces, each trained as a document of its own: no padded "
                "batch holds the same documents")
    return None


def packing_cause(measured: dict) -> str:
    loss, norm = measured["loss"], measured["grad_norm"]
    sides = "packed rows" if measured["layout"] == "packing" else "one padding-free row per micro-batch"
    of = f" of the same {measured['examples']} examples" if measured["examples"] else " of the same examples"
    return (f"Step 1 on {sides} logs loss {loss[0]} and gradient norm {norm[0]}; padded, step 1{of} logs loss "
            f"{loss[1]} and gradient norm {norm[1]} ({measured['loss_relative']:.2e} and "
            f"{measured['grad_norm_relative']:.2e} relative, tolerance {PACKING_RTOL:g}). {ISOLATION}")


def _flag_value(args: list[str], name: str) -> str | None:
    """The value of the last `--name V` / `--name=V` in `args`, or None."""
    value = None
    for i, word in enumerate(args):
        if word == f"--{name}" and i + 1 < len(args):
            value = args[i + 1]
        elif word.startswith(f"--{name}="):
            value = word.split("=", 1)[1]
    return value


def _bool_flag(args: list[str], name: str) -> bool | None:
    """The last `--name`, `--name V`, `--name=V` or `--no_name` in `args` (parse_config's booleans), or None."""
    value = None
    for i, word in enumerate(args):
        if word == f"--no_{name}":
            value = False
        elif word == f"--{name}" or word.startswith(f"--{name}="):
            given = word.split("=", 1)[1] if "=" in word else args[i + 1] if i + 1 < len(args) else "true"
            value = True if given.startswith("--") else given.lower() in ("true", "yes", "1", "y", "t")
    return value


def _without_flags(verify, names: tuple[str, ...]):
    """A copy of `verify` whose script flags lack `--name V` / `--name=V` of each name."""
    kept, skip = [], False
    for word in verify.script_args:
        if skip:
            skip = False
            continue
        if any(word == f"--{name}" for name in names):
            skip = True
            continue
        if not any(word.startswith(f"--{name}=") for name in names):
            kept.append(word)
    return replace(verify, script_args=kept)
