"""verify's evaluation check: the evaluation's metrics are a function of the weights and the evaluation set alone, not
of the evaluation batch size, the number of processes or the evaluation run before.

It trains nothing of its own: the weights are the reference run's at its last step (checkpoint N; with
--load_best_model_at_end the best checkpoint, which the reference restored before its final evaluation), and each
variant resumes from that checkpoint with --max_steps at its step, so it goes straight to the final evaluation (the
resume check proves that loading it is exact). Compared, each metric of all_results.json named eval_*:

    again       two evaluations of the same weights in one process (ACCEL_TRAIN_EVAL_AGAIN=1:
                observe/eval_again.py evaluates a second time at the finish seam, eval_again_*)
    batch_size  the reference run's final evaluation (1 process, per-device evaluation batch E) against the
                variant's at another E (half of E or of the set, whichever is smaller; 2 when that is 1): other
                batches, other padding, another last one
    world_size  the reference's against 2 processes launched at E each (resumed from the same checkpoint, at half the
                per-device training batch: the global batch of the checkpoint)

A script with no evaluation set (no eval_* in the reference's all_results.json) makes the check not applicable.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from ..observe.eval_again import PREFIX as AGAIN
from ..observe.eval_again import VARIABLE as AGAIN_VARIABLE
from ..rundir.checkpoint import load_train_state
from ..rundir.layout import CONFIG, RESULTS, checkpoint_step
from .checks import FAILED, NOT_APPLICABLE, PASSED, Result, Runs, accumulation_refused
from .diagnose import evaluation_cause
from .evidence import checkpoint_dir, relative_difference
from .runs import launch_refused

# Measured (2 CPU cores): bitwise in all three comparisons on toy_train (fp32) and on the main job's MiniLM
# (recipes/nlp_finetune.py, 32 evaluation examples, evaluation batch 64 against 16, each padded to its own longest
# row) at seed 42. Not bitwise in general, because other shapes may take other kernels (a GPU's matmul chooses its
# algorithm, and so its reduction order, by shape) and gathering from 2 processes sums in another order: in fp32 that
# moves a number by about 1e-7, but a metric made from a small difference of such numbers moves more (the text
# generation recipe's source_reliance, in fp32: 1.04e-5 across world sizes). In bf16 autocast (the main job's default)
# each rounding is 2^-9: at seeds 1 and 3 the main job's eval_loss moved by 2.2e-5 and 1.2e-5 across the two
# evaluation batch sizes (every other metric equal). 1e-4 in every precision leaves a margin of 5 over the largest
# (1e-5 in fp32 was a false alarm on the text generation recipe until 2026-12-04; in bf16 until 2026-12-03). The seeded
# bugs move a metric by 1.8e-3 at least (18 times 1e-4): a model that ignores the attention mask 1.8e-3, a metric
# before gathering 1.8e-2, dropout in evaluation 7.7e-2.
EVALUATION_RTOL = 1e-4
COMPARISONS = ("again", "batch_size", "world_size")


def read_metrics(run_dir: Path, prefix: str = "eval") -> dict[str, float]:
    """The numbers named `prefix`_* in a run's all_results.json (eval_again_* apart from eval_*), by their name after
    the prefix; {} when the run wrote none."""
    path = Path(run_dir) / RESULTS
    if not path.is_file():
        return {}
    results = json.loads(path.read_text())
    others = () if prefix == AGAIN else (f"{AGAIN}_",)
    return {key.removeprefix(f"{prefix}_"): float(value) for key, value in results.items()
            if key.startswith(f"{prefix}_") and not key.startswith(others) and isinstance(value, (int, float))}


def compare_metrics(a: dict[str, float], b: dict[str, float], rtol: float = EVALUATION_RTOL) -> dict:
    """Each metric both hold, its two values and their relative difference; the worst; those past `rtol`; the names
    one lacks."""
    common = sorted(set(a) & set(b))
    rows = {name: {"values": [a[name], b[name]], "relative": relative_difference(a[name], b[name])}
            for name in common}
    worst = max((row["relative"] for row in rows.values()), default=0.0)
    differing = [name for name, row in rows.items() if not row["relative"] <= rtol]  # NaN differs
    return {"relative": worst, "metrics": rows, "differing": differing, "missing": sorted(set(a) ^ set(b))}


def evaluation(runs: Runs) -> Result:
    """The reference run's weights evaluated again, at another evaluation batch size and on 2 processes (module
    docstring): every eval_* metric within EVALUATION_RTOL relative."""
    verify = runs.verify
    reference = runs.finished("reference")
    tolerance = {"metrics": f"relative {EVALUATION_RTOL:g}, each eval_* metric",
                 "why": "the same weights and examples: only the rounding of kernels chosen by shape, and of sums "
                        "gathered in another order, may move a metric (bitwise on toy_train and MiniLM at seed 42; "
                        "MiniLM's eval_loss 2.2e-5 at most in bf16 autocast across evaluation batch sizes, seeds 1 "
                        "and 3; the text generation recipe's source_reliance, a small difference, 1.04e-5 in fp32 "
                        "across world sizes)"}
    first = read_metrics(reference.output_dir)
    if not first:
        return Result(NOT_APPLICABLE, {"reason": "the script has no evaluation set: the reference run's "
                                       f"{RESULTS} holds no eval_* metric (give train() an eval_loader)"}, tolerance)
    config = yaml.safe_load((reference.output_dir / CONFIG).read_text()) or {}
    step = evaluated_step(reference.output_dir, config, verify.steps)
    checkpoint = checkpoint_dir(reference.output_dir, step)
    if not checkpoint.is_dir():
        return Result(NOT_APPLICABLE, {"reason": f"the reference run saved no checkpoint at its last step "
                                       f"({checkpoint}): no weights to evaluate again"}, tolerance)
    size = int(config.get("per_device_eval_batch_size") or 0)
    span = min(size, int(first.get("samples", size)))  # a batch larger than the set is the set: halve what is batched
    other = span // 2 if span > 1 else 2
    resumed = {"resume_from_checkpoint": checkpoint.resolve(), "max_steps": step}  # nothing left to train
    variant = runs.finished("evaluation", env={AGAIN_VARIABLE: "1"}, per_device_eval_batch_size=other, **resumed)
    measured: dict = {"metrics": first, "eval_batch_size": [size, other], "weights_of_step": step, "not_compared": []}
    again = read_metrics(variant.output_dir, AGAIN)
    if again:
        measured["again"] = compare_metrics(read_metrics(variant.output_dir), again)
    else:
        measured["not_compared"].append(f"again: no {AGAIN}_* metric (the evaluation is not train()'s eval_loader)")
    measured["batch_size"] = compare_metrics(first, read_metrics(variant.output_dir))
    variants = ["reference", "evaluation"]
    two = _two_processes(runs, config, resumed)
    if isinstance(two, str):
        measured["not_compared"].append(f"world size: {two}")
    else:
        measured["world_size"] = compare_metrics(first, read_metrics(two.output_dir))
        variants.append(two.name)
    if _loss_alone_differs(measured):
        said = accumulation_refused(runs)
        if said is not None:  # a loss over the whole batch: its value depends on the evaluation batch by design
            for name in COMPARISONS:
                if name in measured:
                    measured[name]["differing"] = [m for m in measured[name]["differing"] if m != "loss"]
            measured["loss_not_judged"] = (
                "the loss couples the examples of a batch (the script refuses gradient accumulation: "
                f"{said.removeprefix('accel_train config error: ')}): its value depends on the evaluation batch and "
                "the processes by design; every other metric is judged")
            variants.append("accumulation-micro")
    result = Result(PASSED, measured, tolerance, variants)
    if any(measured[name]["differing"] for name in COMPARISONS if name in measured):
        result.status = FAILED
        result.cause, result.diagnosis = evaluation_cause(measured)
    return result


def _loss_alone_differs(measured: dict) -> bool:
    """Two evaluations in one process agree, and eval_loss is the only metric that differs elsewhere: the signature of
    a loss over the batch (a contrastive loss's negatives are the batch's), or of a loss that depends on padding."""
    compared = [measured[name] for name in COMPARISONS if name in measured]
    differing = {metric for comparison in compared for metric in comparison["differing"]}
    return differing == {"loss"} and not measured.get("again", {}).get("differing")


def evaluated_step(run_dir: Path, config: dict, last: int) -> int:
    """The step whose weights the run's final evaluation evaluated: the last, or with --load_best_model_at_end the
    best checkpoint's, which the run restored before it (as its last checkpoint's state names it)."""
    path = checkpoint_dir(run_dir, last)
    if not config.get("load_best_model_at_end") or not path.is_dir():
        return last
    best = load_train_state(path).get("best_checkpoint")
    step = checkpoint_step(best) if best else None
    return step if step is not None and checkpoint_dir(run_dir, step).is_dir() else last


def _two_processes(runs: Runs, config: dict, resumed: dict):
    """The 2-process evaluation variant, or why it cannot run (a string)."""
    refused = launch_refused(runs.verify.launch_args)
    if refused:
        return refused
    if config.get("max_tokens_per_batch"):
        return (f"the run batches by a token budget (--max_tokens_per_batch {config['max_tokens_per_batch']}): its "
                "checkpoint resumes on the number of processes it trained on only (the plan is dealt in rounds of one "
                "micro-batch per process), so no 2-process evaluation can start from it")
    batch = int(config.get("per_device_train_batch_size") or 0)
    if batch % 2 or config.get("auto_find_batch_size"):
        return (f"the per-device training batch ({batch}) cannot be halved, and resuming the checkpoint on 2 "
                "processes needs its global batch")
    return runs.finished("evaluation-two", processes=2, per_device_train_batch_size=batch // 2, **resumed)

