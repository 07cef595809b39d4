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
from collections.abc import Callable
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


UNCOMPILED = ("torch.compile: no graph compiled in {steps} training step(s): the model trains uncompiled, not as the "
              "start-up report says. On several processes Accelerate compiles the DDP wrapper, and dynamo does not "
              "compile a forward that is torch.nn's own code (a bare nn.Sequential: pytorch/pytorch#140416): give "
              "the model a class of your own whose forward calls it. On one process, dynamo may have met its "
              "recompile limit (torch._dynamo.config.recompile_limit) on this model's code earlier in the process.")


class CompileCount:
    """A hook: the graphs compiled from the first training step to the finish seam (train_compiled_graphs); at the
    first log two training steps in, a line where none was compiled (`write`: the run log's), since dynamo falls back
    to the uncompiled model without a word."""

    def __init__(self, write: Callable[[str], None] | None = None):
        self.at_start = compiled_graphs()
        self.write = write
        self.first_step: int | None = None  # the step training starts from; None once the check is done

    def on_train_start(self, state) -> None:
        self.at_start = compiled_graphs()  # after the pre-flight check, whose batches compile graphs of their own
        self.first_step = state.step

    def on_log(self, state, record) -> None:
        # two steps in: a fresh run's first micro-batch runs eager (the FLOP count, core/meter.py), so step 1 may not
        # have compiled yet; the second step's batches run the compiled model
        if self.first_step is None or state.step - self.first_step < 2:
            return
        if compiled_graphs() == self.at_start and self.write is not None:
            self.write(UNCOMPILED.format(steps=state.step - self.first_step))
        self.first_step = None

    def on_finish(self, session, metrics: dict[str, float]) -> None:
        count = compiled_graphs() - self.at_start
        metrics["train_compiled_graphs"] = count
        session.log.write(f"torch.compile: {count} graph(s) compiled from the first step on (training, evaluations)")
