"""Test-only shim: run a script under Accelerate's real FSDP / DeepSpeed code paths on CPU processes over gloo.

    accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 2 tests/scripts/sharded_cpu.py \
        recipes/nlp_finetune.py --model_name_or_path ...

Accelerate turns FSDP and DeepSpeed on only for GPU-like process groups (MULTI_GPU, MULTI_XPU, ...): on a machine
without an accelerator the presets train plain DDP, and accel_train refuses that (core/sharded.py). CI has no GPU, so
to test the sharded paths this shim tells Accelerate's `PartialState` that the launched processes form a GPU-like
group whose backend is gloo and whose device is the CPU. Everything after that (fully_shard, DeepSpeed's engine,
sharded checkpoints, state-dict gathering) is the code a GPU run takes, on CPU tensors.

It patches two private methods of `accelerate.state.PartialState`, so it refuses an Accelerate version it was not
checked with (accel_train/compat.py lists them): re-check `_prepare_backend` and `set_device` before adding one. Under
DeepSpeed it also marks DeepSpeed's CPU shared-memory collectives op unavailable (`without_cpu_collectives_op`). It
lives under tests/ and is applied only by the test launches; the package never imports it.

After the script returns, the process leaves with os._exit, a second guard beside the pause of
`end_training_safely`: a gloo group torn down while a worker thread still holds a finished collective can abort the
process ("terminate called without an active exception", exit -6) or hang it, after a run that finished and wrote
everything (seen in CI on a resumed FSDP2 run and on plain DDP runs; the failure mode pytorch/pytorch#179291
describes). A GPU run uses NCCL and never reaches this shim.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback

import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType

from accel_train.compat import require_checked


def apply() -> None:
    """Patch PartialState so that a launched process without an accelerator joins a GPU-like gloo group on CPU."""
    require_checked("tests/scripts/sharded_cpu.py")
    if torch.cuda.is_available():
        raise SystemExit("tests/scripts/sharded_cpu.py is for machines without a GPU; launch the script directly on "
                         "GPUs.")
    prepare_backend, set_device = PartialState._prepare_backend, PartialState.set_device

    def gloo_as_gpu(self, cpu=False, sagemaker_dp=False, backend=None):
        if not cpu and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", DistributedType.MULTI_GPU
        return prepare_backend(self, cpu, sagemaker_dp, backend)

    def cpu_device(self):
        if self.device is None and self.backend == "gloo" and self.distributed_type == DistributedType.MULTI_GPU:
            self.device = torch.device("cpu")
            return
        set_device(self)

    PartialState._prepare_backend = gloo_as_gpu
    PartialState.set_device = cpu_device
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        without_cpu_collectives_op()
    # accel_train joins GPU-less launches into a MULTI_CPU group unless the launcher said otherwise
    os.environ["ACCELERATE_USE_CPU"] = "false"


def without_cpu_collectives_op() -> None:
    """Send DeepSpeed's collectives through torch.distributed, as on GPUs.

    On a CPU accelerator DeepSpeed routes its collectives through a shared-memory C++ op it compiles at its first start
    (about 150 s on 2 cores, again for every new virtual environment; a killed build leaves a lock that hangs every
    later start). A GPU run never loads that op: its collectives are torch.distributed's (NCCL). Marked unavailable,
    the op is neither built nor used, and the launched processes' collectives are torch.distributed's, over gloo."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


if __name__ == "__main__":
    apply()
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        if not isinstance(stop.code, int | None):
            print(stop.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
