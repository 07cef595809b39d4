"""verify's world-size check: 1 process against 2 at the same global batch make the same training run.

The 1-process side is the determinism check's reference run (per-device batch B); the 2-process side is launched with
`accel-train launch --num_processes 2` (gloo processes on CPU where there is no GPU) and per-device batch B/2, so both
take global batches of B. Accelerate's seedable sampler draws one order for every process and deals consecutive
micro-batches out to the processes, so both sides train on the same examples at every step. An odd B cannot be
halved: the 1-process side is then a run of its own at 2B, against 2 processes at B (one more run); so it is with
--world_size_args (more of the script's flags for both sides: dropout off, as each process draws its own masks).
"""

from __future__ import annotations

import yaml

from ..rundir.layout import CONFIG
from .checks import (
    FAILED,
    FP32_GRADIENT_RTOL,
    FP32_RTOL,
    NOT_APPLICABLE,
    PASSED,
    PROPERTY,
    Result,
    Runs,
    bounds,
    budget_reason,
)
from .crashes import DEBUG_VARIABLE
from .diagnose import direction_cause, world_size_cause
from .evidence import (
    batch_norm_layers,
    final_weights,
    first_step_lengths,
    relative_difference,
    tensor_differences,
    train_records,
)
from .gradients import gradient_direction
from .runs import launch_refused, one_process_side

# 1 process against 2 at the same global batch computes the same numbers over other shapes and in another order (two
# half-batch means all-reduced against one mean; each half padded to its own longest row). Measured over 6 steps
# (2 shared CPU cores, gloo): toy_train 8.4e-8 relative at most (losses); the main job's MiniLM (recipes/
# nlp_finetune.py, 64 examples, dropout off) step 1's loss bitwise and its gradient norm 9.7e-5, the losses of the
# later steps up to 7.2e-5 (Adam turns reduction-order noise in gradients that are zero in exact arithmetic, the
# attention key biases', into updates of about the learning rate: those tensors differ by 0.34 of their largest
# value after 6 steps, so the weights are reported, not judged). 1e-3 leaves a margin of 10 over the larger; the causes
# meant (BatchNorm's per-process statistics, a per-process mean over variable-length rows, data not sharded) move the
# loss by a percent or more (BatchNorm in world_data.py: 7.4e-2 at step 1). The learning rate is a function of the
# step alone: equal within 1e-6, or the schedule counts processes.
WORLD_SIZE_RTOL = 1e-3
LEARNING_RATE_RTOL = 1e-6
# Step 1's whole gradient (observe/gradient_record.py: all-reduced, before clipping), 2 processes against 1:
# ||g_two - g_one|| / ||g_one|| over every parameter. Measured: toy_train 5.7e-8; the main job's MiniLM (dropout off,
# the recipe's default bf16 autocast on this CPU) 2.1e-3, bf16's rounding over other shapes, as in the accumulation
# check (there 2.0e-3; 1.8e-7 in fp32); with verify's unequal step 1 (process 0 the shortest rows, process 1 the
# longest) 2.8e-3 to 3.3e-3 on the main job and 5.1e-3 on the NLP recipe at per-device batch 8. 2e-2 leaves a margin of
# 4 (1e-2 until 2026-12-04: 2); labels left unsorted by a collator that sorts each process's rows (sorted_rows.py) turn
# it by 0.9 with the losses and the norm equal.
WORLD_GRADIENT_RTOL = 2e-2


def world_size(runs: Runs) -> Result:
    """The reference run (1 process) against 2 processes at the same global batch: every logged loss and step 1's
    gradient norm within WORLD_SIZE_RTOL, step 1's whole gradient within WORLD_GRADIENT_RTOL (relative L2: its
    direction), every learning rate within LEARNING_RATE_RTOL; the final weights reported."""
    verify = runs.verify
    tolerance = world_tolerance(WORLD_SIZE_RTOL, WORLD_GRADIENT_RTOL, "bf16 / fp16")
    refused = launch_refused(verify.launch_args)
    if refused:
        return Result(NOT_APPLICABLE, {"reason": refused}, tolerance)
    reference = runs.finished("reference")
    config = yaml.safe_load((reference.output_dir / CONFIG).read_text()) or {}
    budget = budget_reason(config, "1 process and 2 (a step is a round of one micro-batch per process)")
    if budget is not None:
        return Result(NOT_APPLICABLE, {"reason": budget}, tolerance)
    batch = int(config.get("per_device_train_batch_size", 0))
    if batch < 1 or config.get("auto_find_batch_size"):
        return Result(NOT_APPLICABLE, {"reason": "the run chooses its batch size by itself (--auto_find_batch_size, or "
                                       "the script sets it): no global batch to hold equal"}, tolerance)
    own = verify.world_size_args  # e.g. dropout off: then the 1-process side is a run of its own
    name, per_device = one_process_side(verify, batch)
    # the accumulation check may have run it already, as its one batch of kB (checks.accumulation_sides)
    one = runs.finished(name, own, per_device_train_batch_size=2 * per_device)
    # INFO: should DDP fail for a parameter without a gradient, its error names the parameters (crashes.py)
    two = runs.finished("world-size", own, processes=2, env={DEBUG_VARIABLE: "INFO"},
                        per_device_train_batch_size=per_device)
    rtol, gradient_rtol, precision = bounds((WORLD_SIZE_RTOL, WORLD_GRADIENT_RTOL), one.output_dir, two.output_dir)
    measured = compare_world_sizes(one.output_dir, two.output_dir, rtol)
    measured.update(global_batch=2 * per_device, per_device=[2 * per_device, per_device], processes=[1, 2],
                    precision=precision, process_lengths=first_step_lengths(two.output_dir))
    result = Result(PASSED, measured, world_tolerance(rtol, gradient_rtol, precision), [one.name, two.name])
    worst = max(measured["loss_relative"], measured["grad_norm_relative"])
    agree = worst <= rtol and measured["learning_rate_relative"] <= LEARNING_RATE_RTOL  # NaN fails too
    if not (agree and measured.get("gradient_relative", 0.0) <= gradient_rtol):
        result.status = FAILED
        result.cause, result.diagnosis = world_size_cause(measured)
        first = measured["first_loss_difference"]
        step_one = (first is None or first["step"] > 1) and measured["grad_norm_relative"] <= rtol
        turned = not measured.get("gradient_relative", 0.0) <= gradient_rtol
        if step_one and turned and measured["learning_rate_relative"] <= LEARNING_RATE_RTOL \
                and not measured["batch_norm_layers"]:  # step 1's totals equal, another direction: what came after
            result.cause, result.diagnosis = direction_cause(measured, "1 process and 2")
        if measured["batch_norm_layers"]:
            result.status = PROPERTY
    return result


def world_tolerance(rtol: float, gradient_rtol: float, precision: str) -> dict:
    """The world-size check's tolerance, as the certificate states it, for runs in `precision`."""
    return {"loss": f"relative {rtol:g}, every logged step ({precision})",
            "grad_norm": f"relative {rtol:g}, step 1 (before any update)",
            "gradient": f"relative L2 {gradient_rtol:g}, step 1's whole gradient (its direction)",
            "learning_rate": f"relative {LEARNING_RATE_RTOL:g}, every logged step",
            "why": "the same numbers over other shapes, in another order: in fp32 up to 1.1e-7 (MiniLM's losses over "
                   f"6 steps, its whole gradient 4.9e-7) and 8.4e-8 (toy_train) measured, hence {FP32_RTOL:g} and "
                   f"{FP32_GRADIENT_RTOL:g}; in bf16 "
                   "autocast 1.2e-4 (MiniLM's losses) and 5.1e-3 (its whole gradient: bf16's rounding over other "
                   f"shapes), hence {WORLD_SIZE_RTOL:g} and {WORLD_GRADIENT_RTOL:g}; the weights are reported, not "
                   "judged: Adam turns the noise in gradients that are zero in exact arithmetic into updates of about "
                   "the learning rate"}


def compare_world_sizes(one, two, rtol: float = WORLD_SIZE_RTOL) -> dict:
    """The two runs' logged losses and learning rates at every step both logged, and their final weights; the first
    step whose loss differs by more than `rtol`."""
    records_one, records_two = train_records(one), train_records(two)
    steps = sorted(set(records_one) & set(records_two))
    losses = {s: relative_difference(records_one[s].get("loss"), records_two[s].get("loss")) for s in steps}
    rates = {s: relative_difference(records_one[s].get("learning_rate"), records_two[s].get("learning_rate"))
             for s in steps if records_one[s].get("learning_rate") is not None}
    first = next((s for s in steps if not losses[s] <= rtol), None)
    first_rate = next((s for s in steps if not rates.get(s, 0.0) <= LEARNING_RATE_RTOL), None)
    norms = [records.get(1, {}).get("grad_norm") for records in (records_one, records_two)]
    weights_one, weights_two = final_weights(one), final_weights(two)
    rows = tensor_differences(weights_one, weights_two) if weights_one is not None and weights_two is not None \
        else []
    return {"steps_compared": len(steps), "steps_missing": sorted(set(records_one) ^ set(records_two)),
            "loss_relative": max(losses.values(), default=0.0), "losses_by_step": losses,
            "first_loss_difference": None if first is None else {
                "step": first, "loss": [records_one[first].get("loss"), records_two[first].get("loss")],
                "relative": losses[first]},
            "grad_norm": norms, "grad_norm_relative": relative_difference(*norms) if None not in norms else 0.0,
            "learning_rate_relative": max(rates.values(), default=0.0),
            "first_learning_rate_difference": None if first_rate is None else {
                "step": first_rate, "learning_rate": [records_one[first_rate].get("learning_rate"),
                                                      records_two[first_rate].get("learning_rate")]},
            "weights_compared": weights_one is not None and weights_two is not None,
            "weights_relative": max((row["relative"] for row in rows), default=0.0),
            "largest_differences": rows[:3],
            "batch_norm_layers": batch_norm_layers(weights_one or {}),
            **gradient_direction(two, one)}  # step 1's whole gradient, against the 1-process side's
