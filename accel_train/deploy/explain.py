"""Name the module behind an export failure.

torch.export reports the source line it could not capture ("The following call raised this error: File ...,
line N"); torch.jit.trace warns ("Converting a tensor to a Python boolean ...") from the line whose decision it
froze. Either way the user needs the *module*: `modules_at` maps a source line to the submodules whose class
defines it, and `ModuleTrail` remembers which submodule was running when a tracer warning fired.
"""

from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..errors import ExportError

_CALL = re.compile(r'File "([^"]+)", line (\d+), in (\w+)\n\s*(.*)')
_DATA_DEPENDENT = ("data-dependent", "GuardOnDataDependent", "Could not guard", "Could not extract specialized")
ADVICE = ("A Python `if`/`for`/`int()` on a tensor's values (data-dependent control flow) has no graph form: "
          "write it with tensor operations (torch.where, masks), torch.cond, or move it out of forward.")


def modules_at(model: nn.Module, filename: str, lineno: int) -> list[str]:
    """'name (Class)' of each submodule whose class defines the code at filename:lineno (innermost classes
    first, at most 3)."""
    found: dict[type, list[str]] = {}
    target = Path(filename).resolve()
    for name, module in model.named_modules():
        cls = type(module)
        if cls not in found:
            found[cls] = [] if _defines(cls, target, lineno) else None  # type: ignore[assignment]
        if found[cls] is not None:
            found[cls].append(name or "<root>")
    hits = [f"{names[0]} ({cls.__name__})" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
            for cls, names in found.items() if names]
    return hits[::-1][:3]


def _defines(cls: type, target: Path, lineno: int) -> bool:
    for klass in cls.__mro__:
        if klass in (nn.Module, object):
            continue
        try:
            if Path(inspect.getsourcefile(klass) or "").resolve() != target:
                continue
            lines, start = inspect.getsourcelines(klass)
        except (OSError, TypeError):
            continue
        if start <= lineno < start + len(lines):
            return True
    return False


def capture_error(err: Exception, model: nn.Module, what: str, fmt: str) -> ExportError:
    """An ExportError for a failed torch.export / ONNX capture: the reason's first line, the module and the
    source line that could not be captured, and what to do."""
    text = str(err)
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__)
    calls = _CALL.findall(text)
    where = ""
    if calls:
        filename, lineno, function, code = calls[-1]
        modules = ", ".join(modules_at(model, filename, int(lineno))) or function
        code = code.split("  #")[0].strip()  # the line without its comment
        where = f"; in module {modules}, {Path(filename).name}:{lineno}: `{code}`"
    advice = ADVICE if any(mark in text for mark in _DATA_DEPENDENT) else (
        "Try another --format (torchscript traces Python control flow into one path, checked on other inputs).")
    return ExportError(f"--format {fmt}: cannot capture {what}: {first[:300].rstrip('.')}{where}. {advice}")


@dataclass(frozen=True)
class TracerNote:
    module: str
    filename: str
    lineno: int
    message: str

    @property
    def in_library(self) -> bool:
        return any(f"{sep}{lib}{sep}" in self.filename for lib in ("torch", "transformers") for sep in "/\\")

    def __str__(self) -> str:
        return f"{self.module} at {Path(self.filename).name}:{self.lineno}: {self.message}"


@dataclass
class ModuleTrail:
    """While tracing: which submodule is running (forward pre/post hooks) and the tracer warnings it raised."""

    model: nn.Module
    notes: list[TracerNote] = field(default_factory=list)
    _stack: list[str] = field(default_factory=list)
    _handles: list = field(default_factory=list)
    _catcher: warnings.catch_warnings | None = None

    def __enter__(self) -> ModuleTrail:
        for name, module in self.model.named_modules():
            label = f"{name or '<root>'} ({type(module).__name__})"
            self._handles.append(module.register_forward_pre_hook(lambda *_, label=label: self._stack.append(label)))
            self._handles.append(module.register_forward_hook(lambda *_: self._stack.pop() and None))
        self._catcher = warnings.catch_warnings()
        self._catcher.__enter__()
        warnings.simplefilter("ignore")  # deprecation notices of torch.jit and of transformers: not the user's
        warnings.simplefilter("always", torch.jit.TracerWarning)
        warnings.showwarning = self._record
        return self

    def __exit__(self, *exc) -> None:
        self._catcher.__exit__(*exc)
        for handle in self._handles:
            handle.remove()

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if issubclass(category, torch.jit.TracerWarning):
            text = str(message).split(". ")[0]
            module = self._stack[-1] if self._stack else "<root>"
            note = TracerNote(module, str(filename), int(lineno), text)
            if all((n.filename, n.lineno) != (note.filename, note.lineno) for n in self.notes):
                self.notes.append(note)  # the first module that ran the line; its twins would repeat it

    def user_notes(self) -> list[TracerNote]:
        """Warnings from the user's code first: those from torch and transformers are usually benign."""
        return sorted(self.notes, key=lambda n: n.in_library)
