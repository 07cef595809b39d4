"""A variant whose run failed for a cause verify recognises in its log: the check that ran it fails with that cause
named (which parameters, what to change), instead of verify stopping on "a run that fails cannot be verified".

Recognised:

    unused parameters  DDP's "Expected to have finished reduction in the prior iteration": a trainable parameter got
                       no gradient in a step's backward, so the gradient all-reduce never finished. Only processes > 1
                       run DDP: on 1 process the same parameters silently never train. The names come from DDP's
                       message when TORCH_DISTRIBUTED_DEBUG is INFO or DETAIL (verify sets INFO on the world-size
                       check's 2 processes), else its indices of the trainable parameters.
"""

from __future__ import annotations

import re
from pathlib import Path

from .runs import Variant, VerifyError

UNUSED_PARAMETERS = "unused parameters (no gradient, DDP's reduction never finished)"
DEBUG_VARIABLE = "TORCH_DISTRIBUTED_DEBUG"  # INFO: DDP names the parameters without a gradient in its error
REDUCTION_UNFINISHED = "Expected to have finished reduction in the prior iteration"
NAMES = re.compile(r"Parameters which did not receive grad for rank \d+: ([^\n]*)")
INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")


class VariantCrashed(VerifyError):
    """A variant's run failed for a recognised cause: the check that asked for it fails with this finding (`measured`,
    `cause`, `diagnosis`) and verify goes on with the other checks."""

    def __init__(self, variant: Variant, cause: str, diagnosis: str, measured: dict):
        super().__init__(f"variant {variant.name} failed: {cause}")
        self.variant, self.cause, self.diagnosis, self.measured = variant, cause, diagnosis, measured


def recognised_crash(variant: Variant) -> VariantCrashed | None:
    """The finding of a variant that failed (exit code neither 0 nor 2) for a cause its log names, or None."""
    if variant.returncode in (0, 2, None) or not variant.attempts:
        return None
    log = variant.attempts[-1].get("log")
    try:
        text = Path(log).read_text(errors="replace") if log else ""
    except OSError:
        return None
    if REDUCTION_UNFINISHED in text:
        return _unused_parameters(variant, text, log)
    return None


def _unused_parameters(variant: Variant, text: str, log: str) -> VariantCrashed:
    names = sorted({name.strip() for match in NAMES.finditer(text) for name in match.group(1).split(",")
                    if name.strip()})
    indices = sorted({int(i) for match in INDICES.finditer(text) for i in match.group(1).split()})
    measured = {"crashed_variant": variant.name, "processes": variant.processes, "parameters_without_gradient": names,
                "parameter_indices": indices, "log": log}
    which = (", ".join(names) if names else
             f"the trainable parameters at indices {' '.join(map(str, indices)) or '(not printed)'} of "
             f"model.parameters() (rerun with {DEBUG_VARIABLE}=INFO for their names)")
    diagnosis = (
        f"The run on {variant.processes} processes failed: DDP's gradient all-reduce waits for a gradient of every "
        f"trainable parameter, and {which} got none in a step's backward, so the reduction never finished "
        f"(\"{REDUCTION_UNFINISHED} before starting a new one\"). On 1 process nothing fails: these parameters "
        "silently never train. Likely cause: an unused parameter: a module built and never called in forward (a "
        "head kept from another task, a branch a flag turned off), or an output computed and left out of the loss. "
        "What to change: remove the module, or freeze it (requires_grad_(False)) if it is not meant to train; if "
        "some steps leave it out on purpose (a tower frozen for a while, a stage that idles part of the model), "
        "declare it so that DDP looks for unused parameters (find_unused_parameters): set "
        "`loss_fn.leaves_parameters_unused = True` on the loss function given to train(), or build the "
        "accelerator with build_accelerator(config, kwargs_handlers=[DistributedDataParallelKwargs("
        "find_unused_parameters=True)]).")
    return VariantCrashed(variant, UNUSED_PARAMETERS, diagnosis, measured)
