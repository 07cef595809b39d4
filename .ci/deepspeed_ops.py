"""Build, once, the C++ ops DeepSpeed compiles at its first start on CPU, so that no test launch pays for it.

    timeout 900 python .ci/deepspeed_ops.py        # into $TORCH_EXTENSIONS_DIR, default .torch_extensions/

DeepSpeed installed with DS_BUILD_OPS=0 JIT-compiles its ops on first use, into TORCH_EXTENSIONS_DIR: on CPU the
shared-memory collectives (at `init_distributed`), a few minutes on 2 cores. (The shipped zero3.json asks for
torch's AdamW, "torch_adam": true; DeepSpeed's own AdamW would compile a fused Adam op as well.) A build that is
killed leaves a `lock` file there, and every later start waits on it forever. This script removes such stale locks
first (run it while no other DeepSpeed process is building), then builds; .ci/run runs it under `timeout` before the
tests, and tests/launch/test_sharded.py runs it when the ops are missing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

OPS = ("ShareMemCommBuilder",)


DEFAULT_DIR = Path(__file__).resolve().parents[1] / ".torch_extensions"  # git-ignored


def extensions_dir() -> Path:
    """TORCH_EXTENSIONS_DIR, set to the repository's .torch_extensions when unset (torch reads it at build time)."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(DEFAULT_DIR))
    return Path(os.environ["TORCH_EXTENSIONS_DIR"])


def remove_stale_locks(root: Path) -> list[Path]:
    """Delete the `lock` files a killed build left behind (torch's FileBaton waits on them forever)."""
    stale = list(root.glob("*/lock")) if root.is_dir() else []
    for lock in stale:
        lock.unlink(missing_ok=True)
    return stale


def main() -> int:
    root = extensions_dir()
    for lock in remove_stale_locks(root):
        print(f"removed a stale build lock: {lock}", flush=True)
    from deepspeed.accelerator import get_accelerator

    for name in OPS:
        builder = get_accelerator().create_op_builder(name)
        builder.load(verbose=False)
        print(f"DeepSpeed op {builder.name}: ready in {root}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
