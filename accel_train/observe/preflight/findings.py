"""What the pre-flight checks report: findings with a level and a fix, and the helpers several checks share."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

Level = Literal["error", "warning", "ok"]
DECAY_TO_ZERO = ("linear", "cosine", "polynomial", "cosine_with_restarts", "cosine_annealing", "warmup_stable_decay")


@dataclass
class Finding:
    check: str
    level: Level
    message: str
    fix: str = ""

    def line(self) -> str:
        return f"[{self.level}] {self.check}: {self.message}" + (f" Fix: {self.fix}" if self.fix else "")


@dataclass
class PreflightResult:
    findings: list[Finding]
    schedule: dict | None = None  # {"steps": [...], "lr": [[...] per group]} simulated on a copy
    seconds: float = 0.0

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "warning"]

    def to_dict(self) -> dict:
        return {"findings": [asdict(f) for f in self.findings], "schedule": self.schedule,
                "seconds": round(self.seconds, 3)}


def loader_batch(loader) -> int | None:
    """Samples per micro-batch this process gets from a prepared loader (None: a batch sampler of its own)."""
    sampler = getattr(loader, "batch_sampler", None)
    size = getattr(sampler, "batch_size", None) or getattr(loader, "batch_size", None)
    if size is None:
        return None
    split = getattr(sampler, "split_batches", False)
    return size // getattr(sampler, "num_processes", 1) if split else size


def base_of(obj):
    """The optimizer or scheduler Accelerate wrapped, or the object itself."""
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler

    if isinstance(obj, AcceleratedScheduler):
        return obj.scheduler
    return obj.optimizer if isinstance(obj, AcceleratedOptimizer) else obj
