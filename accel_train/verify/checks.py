"""The checks of `accel-train verify`, each a comparison of variants of the user's run (docs/verify.md).

Each returns a result: status (passed / failed / not applicable), what was measured, the tolerance and why, the
variants it ran, and for a failure one paragraph: the likely cause and what to change in the user's code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..errors import ConfigError
from ..rundir.layout import CONFIG
from ..sweep.trial import Interrupts
from ..testing.faults import VARIABLE as FAULT_VARIABLE
from .crashes import VariantCrashed, recognised_crash
from .diagnose import accumulation_cause, accumulation_examples_cause, determinism_cause, direction_cause, resume_cause
from .evidence import (
    batch_norm_layers,
    checkpoint_dir,
    final_weights,
    first_loss_difference,
    first_step_lengths,
    largest_loss_difference,
    optimizer_tensors,
    random_states,
    relative_difference,
    run_config,
    step_examples,
    tensor_differences,
    train_records,
    trained_precision,
)
from .gradients import RECORD_ENV, gradient_direction
from .runs import Variant, Verify, killed, launch_refused, one_process_side, require_finished, run_variant

PASSED, FAILED, NOT_APPLICABLE = "passed", "failed", "not applicable"
# A difference the model makes by design, not a bug (BatchNorm's per-process batch statistics under world_size): the
# check did not pass, the run is not wrong; the exit code is 0 and the certificate lists it under "properties".
PROPERTY = "property"
# k micro-batches against one batch add the same numbers in another order, over other shapes (each micro-batch padded
# to its own longest row). Measured on step 1 (2 CPU cores; the main job's MiniLM, recipes/nlp_finetune.py, 64
# examples, dropout off, seeds 1-3, 2 x 16 against 32 and 2 x 32 against 64): in fp32 the gradient norm 1.5e-7 and the
# loss 2.2e-7 at most (toy_train 8e-8); with the recipe's default bf16 autocast the norm 4.3e-5 to 1.8e-4 and the loss
# 1.1e-5 (bf16 rounds to 2^-8, and the rounding of other shapes does not average out of one number). 1e-3, the
# world-size check's, leaves a margin of 5 over bf16's worst; the bugs meant (a loss scaled by 1/k: 0.50, a token mean
# per micro-batch: 0.16 on the norm) move the loss or the norm by a tenth or more. (1e-4, the tolerance until
# 2026-12-03, failed the main job in bf16 at seed 1: 1.84e-4.)
ACCUMULATION_RTOL = 1e-3
# Step 1's whole gradient (observe/gradient_record.py: accumulated, before clipping), k micro-batches against one
# batch: ||g_micro - g_full|| / ||g_full|| over every parameter. The norm averages rounding out, the whole vector keeps
# it: measured 6.9e-8 on toy_train and 1.8e-7 on the main job's MiniLM in fp32 (dropout off), but 2.0e-3 with the
# recipe's default --mixed_precision auto, which computes in bf16 on a CPU that has it: bf16 matmuls round to 2^-8,
# over other shapes (the norm: 4.5e-6). With verify's unequal step 1 (the shortest rows in one micro-batch, the
# longest in the other: more unequal shapes) the main job measured 2.8e-3 to 3.5e-3 (seeds 42, 1, 3) and the NLP
# recipe at per-device batch 8 (micro-batches of 4 rows) 5.0e-3. 2e-2 leaves a margin of 4 over that (1e-2, the bound
# until 2026-12-04, left 2); the bugs meant turn the gradient by far more (labels left unsorted by a sorting
# collator, sorted_rows.py: 0.90, cosine 0.59, with the loss and the norm equal; a per-micro-batch token mean: 1.04;
# a loss divided by k: 0.50, cosine 1).
ACCUMULATION_GRADIENT_RTOL = 2e-2
# In fp32 (both sides' checkpoints record fp32: no autocast, no cast by hand) the same comparisons are about 1e-7
# (measured on the main job's MiniLM with --mixed_precision no, seeds 42 and 3: accumulation's loss and norm 1.1e-7 at
# most, step 1's whole gradient 1.6e-7 and 4.9e-7; world size's losses over 6 steps 1.1e-7 at most; the earlier fp32
# runs 2.2e-7; toy_train 8e-8). The bf16 bounds above would let an fp32 run differ by 10,000 times its rounding, enough
# to hide a bug that touches one example in a thousand. 1e-5 on the loss and the norm leaves a margin of 45 over the
# largest; 1e-4 on the whole gradient a margin of 200 (the whole vector keeps the rounding the norm averages out, and
# grows with depth: a larger model than MiniLM measures more).
FP32_RTOL = 1e-5
FP32_GRADIENT_RTOL = 1e-4
# The variants whose step-1 gradients the accumulation and world-size checks compare (gradients.py): they record it
# (one file each); the reference only when it may be the world-size check's 1-process side (Runs.reference_compared).
GRADIENT_VARIANTS = ("accumulation-micro", "accumulation-full", "reference", "world-size-one", "world-size")


def bounds(low: tuple[float, float], *run_dirs: Path) -> tuple[float, float, str]:
    """The bounds (loss and norm, the gradient's direction) for comparing `run_dirs`: FP32_RTOL and FP32_GRADIENT_RTOL
    when every side recorded fp32, else `low`, the bounds set by bf16's rounding (an unrecorded precision gets them
    too: a looser bound rather than a false alarm); and the precision in words, for the certificate."""
    trained = [trained_precision(run_dir) for run_dir in run_dirs]
    if trained and all(precision == "fp32" for precision in trained):
        return FP32_RTOL, FP32_GRADIENT_RTOL, "fp32"
    return (*low, ", ".join(sorted({precision or "unrecorded precision" for precision in trained})))


@dataclass
class Result:
    status: str
    measured: dict = field(default_factory=dict)
    tolerance: dict = field(default_factory=dict)
    variants: list[str] = field(default_factory=list)
    cause: str | None = None  # the cause class of a failure
    diagnosis: str | None = None  # one paragraph: the likely cause and what to change

    def as_dict(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if value is not None}

    @classmethod
    def of_crash(cls, crash: VariantCrashed) -> Result:
        """A check failed by a variant that crashed for a recognised cause (crashes.py)."""
        return cls(FAILED, crash.measured, {"run": "finishes"}, [crash.variant.name], crash.cause, crash.diagnosis)


class Runs:
    """The variants run so far, by name: a check reuses those another check ran (the reference run). `runner` runs
    one (run_variant: processes of their own; a test may run a variant whose process is not its subject in-process,
    with the same signature)."""

    def __init__(self, verify: Verify, interrupts: Interrupts, runner: Callable[..., Variant] = run_variant):
        self.verify, self.interrupts, self.runner = verify, interrupts, runner
        self.done: dict[str, Variant] = {}
        self.crashed: dict[str, VariantCrashed] = {}

    def reference_compared(self) -> bool:
        """Whether the reference may be the world-size check's 1-process side (runs.one_process_side: not with
        --world_size_args, which give that side a run of its own): then it records its step-1 gradient too."""
        return "world_size" in self.verify.checks and not self.verify.world_size_args

    def finished(self, name: str, script_args: Sequence[str] = (), processes: int = 1,
                 env: dict[str, str] | None = None, **more: object) -> Variant:
        """The variant `name`, run once to its end. A run that failed for a cause its log names raises
        VariantCrashed (each time it is asked for: the check that asks fails with it); any other failure, the
        error require_finished gives."""
        if name in self.crashed:
            raise self.crashed[name]
        if name in GRADIENT_VARIANTS and (name != "reference" or self.reference_compared()):
            env = {**RECORD_ENV, **(env or {})}
        if name not in self.done:
            self.done[name] = self.runner(self.verify, name, self.interrupts, env=env, script_args=script_args,
                                          processes=processes, **more)
            crash = recognised_crash(self.done[name])
            if crash is not None:
                self.crashed[name] = crash
                raise crash
            require_finished(self.done[name], self.verify)
        return self.done[name]


def bitwise_comparison(a: Path, b: Path, after: int = 0) -> dict:
    """Two runs' logged losses (steps > after) and final weights, compared bitwise."""
    records_a, records_b = train_records(a), train_records(b)
    first = first_loss_difference(records_a, records_b, after)
    weights_a, weights_b = final_weights(a), final_weights(b)
    differing = tensor_differences(weights_a, weights_b) if weights_a is not None and weights_b is not None else None
    return {"steps_compared": len([s for s in records_a if s > after]), "first_loss_difference": first,
            "largest_loss_relative": largest_loss_difference(records_a, records_b, after),
            "weights_compared": differing is not None, "tensors_differing": len(differing or []),
            "weights_max_abs": max((row["max_abs"] for row in differing or []), default=0.0),
            "largest_differences": (differing or [])[:3]}


def states_differ(a: Path, b: Path) -> list[str]:
    """The generators whose states differ between two checkpoints (python random, numpy, torch)."""
    states_a, states_b = random_states(a), random_states(b)
    if states_a is None or states_b is None:
        return []
    return [name for name in states_a if states_a.get(name) != states_b.get(name)]


def determinism(runs: Runs) -> Result:
    """The same run twice: logged losses and final weights bitwise equal."""
    verify = runs.verify
    a, b = runs.finished("reference"), runs.finished("repeat")
    measured = bitwise_comparison(a.output_dir, b.output_dir)
    step = verify.save_steps
    measured["generators_differing_at_checkpoint"] = states_differ(checkpoint_dir(a.output_dir, step),
                                                                   checkpoint_dir(b.output_dir, step))
    result = Result(PASSED, measured, {"loss": "bitwise", "weights": "bitwise"}, ["reference", "repeat"])
    if measured["first_loss_difference"] or measured["tensors_differing"]:
        result.status = FAILED
        result.cause, result.diagnosis = determinism_cause(measured)
    return result


def resume(runs: Runs, determinism_result: Result | None) -> Result:
    """Killed (SIGKILL) after step K, past a checkpoint at S < K, resumed from it: equal to the uninterrupted run."""
    verify = runs.verify
    tolerance = {"loss": f"bitwise, steps after {verify.save_steps}", "weights": "bitwise",
                 "optimizer_state": "bitwise", "generators": "equal"}
    if determinism_result is not None and determinism_result.status == FAILED:
        return Result(NOT_APPLICABLE, {"reason": "the run is not deterministic (see determinism): a resumed run "
                                       "cannot be compared with it bitwise; fix determinism first"}, tolerance)
    reference = runs.finished("reference")
    fault = f"kill_after_step:{verify.kill_step}"
    cut = run_variant(verify, "resumed", runs.interrupts, env={FAULT_VARIABLE: fault})
    if not killed(cut, verify):
        require_finished(cut, verify)
        return Result(NOT_APPLICABLE, {"reason": f"{FAULT_VARIABLE}={fault} did not stop the run (it ended by "
                                       "itself): the script does not train with accel_train.train()"}, tolerance)
    if not checkpoint_dir(cut.output_dir, verify.save_steps).is_dir():
        return Result(FAILED, {"reason": f"no checkpoint at step {verify.save_steps} before the kill"}, tolerance,
                      ["resumed"], "no checkpoint", f"The run was asked to save every {verify.save_steps} steps "
                      "(--save_strategy steps) and wrote no checkpoint before the kill: nothing can resume it. "
                      "Check that the script passes the parsed TrainConfig to train() unchanged.")
    again = run_variant(verify, "resumed", runs.interrupts, resume=True)
    cut.attempts += again.attempts
    cut.returncode = again.returncode
    runs.done["resumed"] = cut
    require_finished(cut, verify)
    measured = bitwise_comparison(reference.output_dir, cut.output_dir, after=verify.save_steps)
    measured.update(_final_checkpoints(reference.output_dir, cut.output_dir, verify.steps))
    measured["killed_after_step"], measured["resumed_from_step"] = verify.kill_step, verify.save_steps
    result = Result(PASSED, measured, tolerance, ["reference", "resumed"])
    if (measured["first_loss_difference"] or measured["tensors_differing"] or measured["optimizer_differing"]
            or measured["generators_differing"]):
        result.status = FAILED
        result.cause, result.diagnosis = resume_cause(measured)
    return result


def _final_checkpoints(a: Path, b: Path, step: int) -> dict:
    """The optimizer state and generator states of both runs' checkpoints at the last step."""
    optimizer_a = optimizer_tensors(checkpoint_dir(a, step))
    optimizer_b = optimizer_tensors(checkpoint_dir(b, step))
    compared = optimizer_a is not None and optimizer_b is not None
    differing = tensor_differences(optimizer_a, optimizer_b) if compared else []
    return {"optimizer_compared": compared, "optimizer_differing": [row["tensor"] for row in differing[:5]],
            "generators_differing": states_differ(checkpoint_dir(a, step), checkpoint_dir(b, step))}


def budget_reason(config: dict, compared: str) -> str | None:
    """Why a check that compares batchings does not apply to a run of a token budget (its config.yaml `config`): its
    micro-batches are a plan of padded tokens, so `compared` hold other examples by design. None without a budget."""
    budget = config.get("max_tokens_per_batch")
    if not budget:
        return None
    return (f"the run batches by a token budget (--max_tokens_per_batch {budget}): a micro-batch is the plan's, not "
            f"--per_device_train_batch_size examples, so {compared} hold other examples by design. The budget's "
            "exactness under accumulation and 2 processes is proven in accel_train's own tests "
            "(tests/core/test_token_batches.py); rerun verify with --max_tokens_per_batch 0 to check the rest of the "
            "script with batches of examples")


def accumulation(runs: Runs) -> Result:
    """k micro-batches of B (accumulated) against one batch of kB: the same first step, within ACCUMULATION_RTOL. A
    script that refuses accumulation (a loss over the whole batch) makes it not applicable; a BatchNorm model differs
    by design (each micro-batch normalised by its own statistics): a property."""
    verify = runs.verify
    k = verify.accumulation
    own = verify.accumulation_args
    tolerance = accumulation_tolerance(ACCUMULATION_RTOL, ACCUMULATION_GRADIENT_RTOL, "bf16 / fp16")
    said = accumulation_refused(runs)
    if said is not None:
        return Result(NOT_APPLICABLE, {"reason": f"the script refuses --gradient_accumulation_steps {k}: {said}"},
                      tolerance, ["accumulation-micro"])
    compared = f"{k} micro-batches of B and one batch of kB"
    reference = runs.done.get("reference")  # its config says a budget before any run of this check's own
    budget = budget_reason(run_config(reference.output_dir), compared) if reference and not reference.returncode \
        else None
    if budget is not None:
        return Result(NOT_APPLICABLE, {"reason": budget}, tolerance, ["reference"])
    micro_flags, shared = accumulation_sides(runs)
    micro = runs.finished("accumulation-micro", own, **micro_flags)
    config = yaml.safe_load((micro.output_dir / CONFIG).read_text()) or {}
    budget = budget_reason(config, compared)
    if budget is not None:
        return Result(NOT_APPLICABLE, {"reason": budget}, tolerance, ["accumulation-micro"])
    batch = int(config.get("per_device_train_batch_size", 0))
    asked = micro_flags.get("per_device_train_batch_size", batch)
    if config.get("gradient_accumulation_steps") != k or not 1 <= batch == asked or config.get("auto_find_batch_size"):
        return Result(NOT_APPLICABLE, {"reason": "the run changed its micro-batch or accumulation by itself "
                                       "(--auto_find_batch_size, or the script sets them)"}, tolerance)
    if shared is None:
        full = runs.finished("accumulation-full", own, max_steps=1, per_device_train_batch_size=k * batch,
                             gradient_accumulation_steps=1)
    else:  # the world-size check's 1-process run: one batch of kB, compared at its step 1
        full = runs.finished(shared[0], own, **shared[1])
    measured = _first_steps(micro.output_dir, full.output_dir, batch, k, weights=shared is None)
    rtol, gradient_rtol, measured["precision"] = bounds((ACCUMULATION_RTOL, ACCUMULATION_GRADIENT_RTOL),
                                                        micro.output_dir, full.output_dir)
    tolerance = accumulation_tolerance(rtol, gradient_rtol, measured["precision"])
    measured["micro_batch_lengths"] = first_step_lengths(micro.output_dir)  # None: the script's own order
    result = Result(PASSED, measured, tolerance, ["accumulation-micro", full.name])
    worst = max(measured["loss_relative"], measured["grad_norm_relative"])
    turned = not measured.get("gradient_relative", 0.0) <= gradient_rtol  # NaN fails too
    if not (worst <= rtol) or math.isnan(worst) or turned:
        result.status = FAILED
        result.cause, result.diagnosis = accumulation_cause(measured)
        if worst <= rtol and not measured["batch_norm_layers"]:  # equal totals, another direction
            result.cause, result.diagnosis = direction_cause(measured, f"{k} accumulated micro-batches and one batch")
        if measured["batch_norm_layers"]:
            result.status = PROPERTY
    examples = step_examples(micro.output_dir, 1, 1), step_examples(full.output_dir, 1, 1)
    if None not in examples:  # recorded (ACCEL_TRAIN_RECORD_FED): the two sides' step 1 held the same examples?
        only = sorted(set(examples[0]) - set(examples[1])), sorted(set(examples[1]) - set(examples[0]))
        measured["same_examples"] = examples[0] == examples[1]
        if not measured["same_examples"]:  # the figures compare other data: that is the finding, not the loss
            measured["examples_only_in"] = {"micro-batches": only[0][:10], "one batch": only[1][:10]}
            result.status = FAILED
            result.cause, result.diagnosis = accumulation_examples_cause(measured)
    return result


def accumulation_tolerance(rtol: float, gradient_rtol: float, precision: str) -> dict:
    """The accumulation check's tolerance, as the certificate states it, for runs in `precision`."""
    return {"loss": f"relative {rtol:g} ({precision})", "grad_norm": f"relative {rtol:g} ({precision})",
            "gradient": f"relative L2 {gradient_rtol:g}, step 1's whole gradient (its direction)",
            "why": "the same numbers added in another order, over other padded shapes: in fp32 up to 2.2e-7 relative "
                   "on MiniLM's loss and norm and 4.9e-7 on step 1's whole gradient measured (toy_train 8e-8), hence "
                   f"{FP32_RTOL:g} and {FP32_GRADIENT_RTOL:g}; in bf16 autocast the norm 3.1e-4 and the whole "
                   f"gradient 5.0e-3, bf16's rounding over other shapes, hence {ACCUMULATION_RTOL:g} and "
                   f"{ACCUMULATION_GRADIENT_RTOL:g}; the weights after one step are reported, not judged: Adam's "
                   "first update is about lr * sign(gradient), blind to a gradient's scale"}


def accumulation_sides(runs: Runs) -> tuple[dict, tuple[str, dict] | None]:
    """The accumulation check's k micro-batches (the flags of its 1-step variant) and, where it can be shared, its one
    batch of kB: the world-size check's 1-process run (runs.one_process_side) when both checks run with the same
    flags of their own, the reference ran with a batch G that k divides and no accumulation of its own: then k
    micro-batches of G/k against that run's step 1, and one variant fewer. Else (None) k micro-batches of the user's
    B against a 1-step run at kB, accumulation-full."""
    verify = runs.verify
    k = verify.accumulation
    micro = {"max_steps": 1, "gradient_accumulation_steps": k}
    reference = runs.done.get("reference")
    if ("world_size" not in verify.checks or verify.accumulation_args != verify.world_size_args
            or launch_refused(verify.launch_args) or reference is None or reference.returncode != 0):
        return micro, None
    config = yaml.safe_load((reference.output_dir / CONFIG).read_text()) or {}
    batch = int(config.get("per_device_train_batch_size") or 0)
    if batch < 1 or config.get("auto_find_batch_size") or (config.get("gradient_accumulation_steps") or 1) != 1:
        return micro, None
    name, per_device = one_process_side(verify, batch)
    whole = 2 * per_device
    if whole % k:
        return micro, None
    return {**micro, "per_device_train_batch_size": whole // k}, (name, {"per_device_train_batch_size": whole})


def accumulation_refused(runs: Runs) -> str | None:
    """What the script said when it refused the accumulation check's first variant (k micro-batches): its loss couples
    the whole batch (a contrastive loss: core/loss.py's refuse_accumulation) and run_cli's status names
    --gradient_accumulation_steps; None when the variant ran. Runs that variant if no check did yet; a refusal of
    something else is the error require_finished gives."""
    verify = runs.verify
    if "accumulation-micro" not in runs.done:
        try:
            runs.finished("accumulation-micro", verify.accumulation_args, **accumulation_sides(runs)[0])
        except ConfigError:
            if "--gradient_accumulation_steps" not in _said(runs.done.get("accumulation-micro")):
                raise
    variant = runs.done["accumulation-micro"]
    said = _said(variant)
    return said.strip() if variant.returncode != 0 and "--gradient_accumulation_steps" in said else None


def _said(variant: Variant | None) -> str:
    """The message of a variant's last run (run_cli's status), or ''."""
    if variant is None or not variant.attempts:
        return ""
    return str(variant.attempts[-1].get("status", {}).get("message") or "")


def _first_steps(micro: Path, full: Path, batch: int, k: int, weights: bool = True) -> dict:
    """Step 1's loss and gradient norm of both runs, their relative differences, the weights after it (`weights`:
    both runs ended at step 1), the model's batch-norm layers."""
    first_micro = train_records(micro).get(1, {})
    first_full = train_records(full).get(1, {})
    measured = {"micro_batch": batch, "accumulation_steps": k, "compared_at_step": 1,
                "loss": [first_micro.get("loss"), first_full.get("loss")],
                "grad_norm": [first_micro.get("grad_norm"), first_full.get("grad_norm")]}
    measured["loss_relative"] = relative_difference(*measured["loss"])
    measured["grad_norm_relative"] = relative_difference(*measured["grad_norm"])
    weights_micro, weights_full = final_weights(micro), final_weights(full)
    if weights and weights_micro is not None and weights_full is not None:
        rows = tensor_differences(weights_micro, weights_full)
        measured["weights_max_abs"] = max((row["max_abs"] for row in rows), default=0.0)
    measured["batch_norm_layers"] = batch_norm_layers(weights_micro or {})
    measured.update(gradient_direction(micro, full))  # the whole gradient: its direction too
    return measured
