"""verify's precision check: the first steps' losses in low precision (bf16 autocast; fp16 on a GPU without bf16)
against fp32 stay within a bound measured on runs without a bug.

The reference run is one side: in fp32 the variant runs in bf16 (`--mixed_precision bf16`), in bf16 / fp16 (the
user's flags, or `--mixed_precision auto` on hardware with native bf16) it runs in fp32 (`--mixed_precision no`).
The variant runs the first PRECISION_STEPS steps only. The precision each run trained in is read from its
checkpoint (the loop records the precision in effect): a script that forces its own (an Accelerator built with a
fixed mixed_precision, a model cast by hand) trains in the same precision whatever the flag says, and the check is
then not applicable.
"""

from __future__ import annotations

import math

import torch

from .checks import FAILED, NOT_APPLICABLE, PASSED, Result, Runs
from .diagnose import precision_cause
from .evidence import precision_of, relative_difference, train_records

# bf16 keeps 8 bits of mantissa: each rounding moves a number by up to 2^-9 = 2.0e-3 relative. Measured over the
# first 3 steps (2 shared CPU cores, bf16 autocast against fp32): toy_train's losses 6.5e-4 relative at most, the main
# job's MiniLM (recipes/nlp_finetune.py, 64 examples; its classifier's logits start near 0, where the loss hardly
# depends on them) 4.6e-5. 1e-2 leaves a margin of 15 over the larger and room for about five roundings' worth in a
# deeper model; the causes meant (a loss reduced in low precision over many items, an epsilon the format rounds to
# 0, an fp16 overflow) move the loss by several percent or make it non-finite.
PRECISION_RTOL = 1e-2
PRECISION_STEPS = 3


def low_precision() -> str:
    """The precision to compare fp32 with: bf16, but fp16 on a GPU that does not compute bf16."""
    return "fp16" if torch.cuda.is_available() and not torch.cuda.is_bf16_supported() else "bf16"


def precision(runs: Runs) -> Result:
    """The reference run against a run in the other precision: the first PRECISION_STEPS logged losses within
    PRECISION_RTOL relative, all finite."""
    verify = runs.verify
    steps = min(verify.steps, PRECISION_STEPS)
    tolerance = {"loss": f"relative {PRECISION_RTOL:g}, steps 1-{steps}, finite",
                 "why": "bf16 rounds each number to 2^-9 relative: 6.5e-4 (toy_train) and 4.6e-5 (MiniLM) measured"}
    reference = runs.finished("reference")
    had = precision_of(reference.output_dir, verify.steps)
    ask = "no" if had and had != "fp32" else low_precision()
    variant = runs.finished("precision", mixed_precision=ask, max_steps=steps)
    got = precision_of(variant.output_dir, steps)
    if had is None or got is None or got == had:
        return Result(NOT_APPLICABLE, {"reason": f"the script forces its precision: asked --mixed_precision {ask}, "
                                       f"the run trained in {got or 'an unrecorded precision'} as the reference "
                                       f"did ({had or 'unrecorded'}); nothing to compare"}, tolerance)
    fp32, low = (reference, variant) if had == "fp32" else (variant, reference)
    records = train_records(fp32.output_dir), train_records(low.output_dir)
    losses = {step: [records[0].get(step, {}).get("loss"), records[1].get(step, {}).get("loss")]
              for step in range(1, steps + 1)}
    relative = {step: relative_difference(*pair) for step, pair in losses.items()}
    measured = {"precision": ["fp32", had if fp32 is variant else got], "steps_compared": steps,
                "losses_by_step": losses, "relative_by_step": relative,
                "loss_relative": max(relative.values(), default=0.0)}
    finite = all(value is not None and math.isfinite(value) for pair in losses.values() for value in pair)
    result = Result(PASSED, measured, tolerance, [fp32.name, low.name])
    if not finite or not measured["loss_relative"] <= PRECISION_RTOL:
        result.status = FAILED
        result.cause, result.diagnosis = precision_cause(measured, finite)
    return result
