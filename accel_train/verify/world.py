"""verify's world-size check: 1 process against 2 at the same global batch make the same training run.

The 1-process side is the determinism check's reference run (per-device batch B); the 2-process side is launched with
`accel-train launch --num_processes 2` (gloo processes on CPU where there is no GPU) and per-device batch B/2, so both
take global batches of B. Accelerate's seedable sampler draws one order for every process and deals consecutive
micro-batches out to the processes, so both sides train on the same examples at every step. An odd B cannot be
halved: the 1-process side is then a run of its own at 2B, against 2 processes at B (one more run).
"""

from __future__ import annotations

import torch
import yaml

from ..rundir.layout import CONFIG
from .checks import FAILED, NOT_APPLICABLE, PASSED, PROPERTY, Result, Runs
from .diagnose import world_size_cause
from .evidence import final_weights, relative_difference, tensor_differences, train_records

# 1 process against 2 at the same global batch adds the same float32 numbers in another order (two half-batch means,
# all-reduced and averaged, against one mean). Measured over 6 steps (2 shared CPU cores, gloo): toy_train's losses
# 8.4e-8 relative at most, its final weights bitwise equal; world_data.py's twin (LayerNorm) 6.1e-8 and 2.2e-7 of the
# largest weight. 1e-5 leaves a margin of 45 over the larger; the causes meant (BatchNorm's per-process statistics,
# a per-process mean over variable-length rows, data not sharded, a schedule counted in processes) move the loss by
# 1e-3 or more (BatchNorm in world_data.py: 7.4e-2 at step 1).
WORLD_SIZE_RTOL = 1e-5
BATCH_NORM_BUFFERS = ("running_mean", "running_var")  # a BatchNorm layer's state (SyncBatchNorm's too)


def world_size(runs: Runs) -> Result:
    """The reference run (1 process) against 2 processes at the same global batch: every logged loss and learning
    rate, and the final weights, within WORLD_SIZE_RTOL."""
    verify = runs.verify
    tolerance = {"loss": f"relative {WORLD_SIZE_RTOL:g}, every logged step",
                 "weights": f"max |difference| / max |weight| per tensor {WORLD_SIZE_RTOL:g}",
                 "learning_rate": f"relative {WORLD_SIZE_RTOL:g}",
                 "why": "the same float32 numbers added in another order (two half-batch means all-reduced against "
                        "one mean): up to 8.4e-8 (losses) and 2.2e-7 (weights) measured on toy_train and a "
                        "LayerNorm model"}
    refused = _launch_refused(verify.launch_args)
    if refused:
        return Result(NOT_APPLICABLE, {"reason": refused}, tolerance)
    reference = runs.finished("reference")
    config = yaml.safe_load((reference.output_dir / CONFIG).read_text()) or {}
    batch = int(config.get("per_device_train_batch_size", 0))
    if batch < 1 or config.get("auto_find_batch_size"):
        return Result(NOT_APPLICABLE, {"reason": "the run chooses its batch size by itself (--auto_find_batch_size, or "
                                       "the script sets it): no global batch to hold equal"}, tolerance)
    if batch % 2 == 0:
        one, per_device = reference, batch // 2
    else:
        one, per_device = runs.finished("world-size-one", per_device_train_batch_size=2 * batch), batch
    two = runs.finished("world-size", processes=2, per_device_train_batch_size=per_device)
    measured = compare_world_sizes(one.output_dir, two.output_dir)
    measured.update(global_batch=2 * per_device, per_device=[2 * per_device, per_device], processes=[1, 2])
    result = Result(PASSED, measured, tolerance, [one.name, two.name])
    worst = max(measured["loss_relative"], measured["weights_relative"], measured["learning_rate_relative"])
    if not worst <= WORLD_SIZE_RTOL:  # NaN fails too
        result.status = FAILED
        result.cause, result.diagnosis = world_size_cause(measured)
        if measured["batch_norm_layers"]:
            result.status = PROPERTY
    return result


def compare_world_sizes(one, two) -> dict:
    """The two runs' logged losses and learning rates at every step both logged, and their final weights."""
    records_one, records_two = train_records(one), train_records(two)
    steps = sorted(set(records_one) & set(records_two))
    losses = {s: relative_difference(records_one[s].get("loss"), records_two[s].get("loss")) for s in steps}
    rates = {s: relative_difference(records_one[s].get("learning_rate"), records_two[s].get("learning_rate"))
             for s in steps if records_one[s].get("learning_rate") is not None}
    first = next((s for s in steps if not losses[s] <= WORLD_SIZE_RTOL), None)
    first_rate = next((s for s in steps if not rates.get(s, 0.0) <= WORLD_SIZE_RTOL), None)
    weights_one, weights_two = final_weights(one), final_weights(two)
    rows = tensor_differences(weights_one, weights_two) if weights_one is not None and weights_two is not None \
        else []
    return {"steps_compared": len(steps), "steps_missing": sorted(set(records_one) ^ set(records_two)),
            "loss_relative": max(losses.values(), default=0.0), "losses_by_step": losses,
            "first_loss_difference": None if first is None else {
                "step": first, "loss": [records_one[first].get("loss"), records_two[first].get("loss")],
                "relative": losses[first]},
            "learning_rate_relative": max(rates.values(), default=0.0),
            "first_learning_rate_difference": None if first_rate is None else {
                "step": first_rate, "learning_rate": [records_one[first_rate].get("learning_rate"),
                                                      records_two[first_rate].get("learning_rate")]},
            "weights_compared": weights_one is not None and weights_two is not None,
            "weights_relative": max((row["relative"] for row in rows), default=0.0),
            "largest_differences": rows[:3],
            "batch_norm_layers": batch_norm_layers(weights_one or {})}


def batch_norm_layers(weights: dict) -> list[str]:
    """The layers whose state holds a batch norm's running statistics (read from the saved weights' names)."""
    return sorted({name.rsplit(".", 1)[0] for name in weights if name.rsplit(".", 1)[-1] in BATCH_NORM_BUFFERS})


def _launch_refused(launch_args: list[str]) -> str | None:
    """Why the world-size check cannot run with these launcher flags (or on this machine), or None."""
    if torch.cuda.device_count() == 1 and "--cpu" not in launch_args:
        return ("one GPU: two processes cannot share it; rerun verify with --launch_args '--cpu' to compare 1 and 2 "
                "processes on CPU (every variant then runs on CPU)")
    named = [a for a in launch_args if a.split("=")[0] in ("--num_processes", "--num-processes", "--config_file",
                                                            "--config-file", "--preset")]
    if named:
        return (f"--launch_args {' '.join(launch_args)} choose the processes ({named[0]}): the check compares 1 "
                "process with 2 by itself; give --launch_args without them (e.g. '--cpu', '--mixed_precision no')")
    return None
