"""Where torch's fused AdamW kernel runs: `--optim adamw` (the default) takes it there.

torch.optim.AdamW(fused=True) updates every parameter in one pass of one kernel; its default on a CPU loops over
the tensors (on a GPU it groups them with foreach kernels). transformers' Trainer defaults to the fused kernel since
torch 2.8. On 2 CPU cores the NLP recipe's whole run trains 1.2-1.3x faster with it, on the same trajectory up to
rounding (benchmarks/time_to_quality.md). torch has it on CPU, CUDA and XPU for every floating dtype (on MPS not for
bf16: left to torch's default kernels there, as every other device).
"""

from __future__ import annotations

from typing import Any

from .muon import as_groups

FUSED_ADAMW_DEVICES = ("cpu", "cuda", "xpu")


def fused_adamw_runs(groups: list[Any], accelerator=None) -> bool:
    """Whether the fused kernel runs for these param groups (or tensors) on the device training uses: the
    accelerator's, or the parameters' own without one."""
    params = [p for g in as_groups(groups) for p in g["params"]]
    if not params:
        return False
    device = accelerator.device if accelerator is not None else params[0].device
    return device.type in FUSED_ADAMW_DEVICES and all(p.is_floating_point() for p in params)

