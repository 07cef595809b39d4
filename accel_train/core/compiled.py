"""How many graphs torch.compile compiled in a run: `train_compiled_graphs` in all_results.json, and a line in the log.

Each new input shape (a batch of another sequence length) can make dynamo trace and compile the model again. With
automatic dynamic shapes (torch.compile's default) the second shape compiles one dynamic-shape graph that serves every
later length; with static shapes (a recipe's --length_buckets: `build_accelerator(..., static_shapes=True)`) each
shape compiles a graph of its own, and dynamo falls back to running the model uncompiled once it has compiled
`torch._dynamo.config.recompile_limit` (8) graphs for it. The count is dynamo's own (`counters["stats"]
["unique_graphs"]`, process-wide), from the first training step to the finish seam: the training steps and the
evaluations (a model in eval mode without gradients compiles graphs of its own; the final evaluation included), not
the pre-flight check's (it runs the model on a training batch before training). It is the
main process's count: each process compiles for the shapes it was given. Under DDP dynamo splits a graph at the
gradient buckets (DDPOptimizer), so a compile can count more than one graph.
"""

from __future__ import annotations

import sys
from typing import Any


def compiled_graphs() -> int:
    """The graphs dynamo has compiled in this process so far (0 while nothing imported dynamo: importing it takes a
    second or more, which every run that does not compile would pay at start-up)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compiling(accelerator: Any) -> bool:
    """Whether the prepared model is compiled (--torch_compile, or the launcher's --dynamo_backend)."""
    dynamo = accelerator.state.dynamo_plugin
    return str(getattr(dynamo.backend, "value", dynamo.backend)).upper() != "NO"


class CompileCount:
    """A hook: the graphs compiled from the first training step to the finish seam (train_compiled_graphs)."""

    def __init__(self):
        self.at_start = compiled_graphs()

    def on_train_start(self, state) -> None:
        self.at_start = compiled_graphs()  # after the pre-flight check, whose batches compile graphs of their own

    def on_finish(self, session, metrics: dict[str, float]) -> None:
        count = compiled_graphs() - self.at_start
        metrics["train_compiled_graphs"] = count
        session.log.write(f"torch.compile: {count} graph(s) compiled from the first step on (training, evaluations)")
