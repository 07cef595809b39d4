"""The three formats: write an artifact from an `ExportTarget`, and load one back as a function of tensors.

* ``torchscript``: `torch.jit.trace` with `check_inputs` (the check inputs are re-traced and their graphs must
  match the example's: a graph that froze the example's shapes or a data-dependent branch fails here), saved with
  `ScriptModule.save`; loads with `torch.jit.load`. (torch.jit is deprecated upstream but still the format
  mobile and C++ runtimes load.)
* ``exported_program``: `torch.export.export` with the batch (and sequence) axes dynamic, saved with
  `torch.export.save` (.pt2); loads with `torch.export.load(path).module()`.
* ``onnx``: the same ExportedProgram translated by `torch.onnx.export` (needs onnx and onnxscript), one file
  with the weights inside, dynamic axes named batch / sequence; loads with `onnxruntime.InferenceSession`.
"""

from __future__ import annotations

import importlib
import io
import logging
import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager, redirect_stderr
from pathlib import Path
from typing import Any

import torch

from ..config import EXPORT_FORMATS as FORMATS
from ..errors import ExportError
from .explain import ModuleTrail, capture_error
from .targets import ExportTarget

SUFFIX = {"torchscript": ".pt", "exported_program": ".pt2", "onnx": ".onnx"}
INSTALL_HINT = "pip install 'accel_train[deploy]' (or: pip install onnx onnxscript onnxruntime)"
ONNX_MAX_INLINE_BYTES = 1 << 30  # protobuf's 2 GiB limit, with room: larger models keep weights beside the file

Inputs = Sequence[torch.Tensor]
Runner = Callable[[Inputs], list[torch.Tensor]]


def require(module: str, why: str) -> Any:
    """Import an optional dependency or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ExportError(f"{why} needs the optional package {module!r}: {INSTALL_HINT}.") from None


def write_artifact(fmt: str, target: ExportTarget, example: Inputs, checks: Sequence[Inputs], path: Path,
                   opset: int | None = None) -> dict[str, Any]:
    """Write `target` as `fmt` to `path`; return what export.json should add (tracer notes, ranges, opset)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "torchscript":
        return _torchscript(target, example, checks, path)
    if fmt == "exported_program":
        program = capture(target, example, fmt)
        torch.export.save(program, str(path))
        return {"dim_max": dim_max(program, target)}
    if fmt == "onnx":
        return _onnx(target, example, path, opset)
    raise ExportError(f"--format {fmt}: unknown; choose one of {', '.join(FORMATS)}.")


def _torchscript(target: ExportTarget, example: Inputs, checks: Sequence[Inputs], path: Path) -> dict[str, Any]:
    with ModuleTrail(target.module.model) as trail:
        try:
            traced = torch.jit.trace(target.module, tuple(example), check_inputs=[tuple(c) for c in checks],
                                     check_tolerance=1e-5)
        except torch.jit.TracingCheckError as err:
            notes = [n for n in trail.user_notes() if not n.in_library] or trail.user_notes()
            where = "; ".join(str(n) for n in notes[:3]) or "no tracer warning points at a module"
            raise ExportError(
                f"--format torchscript: the trace of {target.model_class} froze a decision that does not hold for "
                f"other inputs (re-tracing with other shapes gave another graph or other values). Where the tracer "
                f"warned: {where}. Use --format exported_program (it refuses what it cannot capture, naming the "
                f"line), or make that code shape- and value-independent. ({str(err).splitlines()[0][:200]})"
            ) from None
        except Exception as err:  # noqa: BLE001 - anything trace cannot handle becomes a message naming the model
            raise ExportError(f"--format torchscript: torch.jit.trace failed on {target.model_class}: "
                              f"{type(err).__name__}: {str(err).splitlines()[0][:300]}") from None
    traced.save(str(path))
    return {"tracer_warnings": [str(n) for n in trail.user_notes()]}


def capture(target: ExportTarget, example: Inputs, fmt: str = "exported_program") -> torch.export.ExportedProgram:
    """torch.export with every batch axis (and token inputs' sequence axis) dynamic."""
    axes = target.sample.dynamic_axes()
    specs = tuple({axis: torch.export.Dim.DYNAMIC for axis in axes[name]} for name in target.input_names)
    with _quiet():
        try:
            return torch.export.export(target.module, tuple(example), dynamic_shapes=(specs,))
        except Exception as err:  # noqa: BLE001 - torch raises several types; each becomes a message
            raise capture_error(err, target.module.model, target.model_class, fmt) from None


def dim_max(program: torch.export.ExportedProgram, target: ExportTarget) -> dict[str, int]:
    """{axis name: largest size the program accepts} for bounded dynamic axes (e.g. sequence: 512 positions)."""
    found: dict[str, int] = {}
    placeholders = [n for n in program.graph.nodes if n.op == "placeholder" and n.name in
                    program.graph_signature.user_inputs]
    axes = target.sample.dynamic_axes()
    for node, name in zip(placeholders, target.input_names, strict=True):
        shape = getattr(node.meta.get("val"), "shape", ())
        for axis, label in axes[name].items():
            size = shape[axis] if axis < len(shape) else None
            bound = program.range_constraints.get(getattr(getattr(size, "node", None), "expr", None))
            upper = getattr(bound, "upper", None)
            if getattr(upper, "is_Integer", False):  # int_oo: unbounded
                found[label] = int(upper)
    return found


def _onnx(target: ExportTarget, example: Inputs, path: Path, opset: int | None) -> dict[str, Any]:
    require("onnxscript", "--format onnx")
    onnx = require("onnx", "--format onnx")
    program = capture(target, example, "onnx")
    inline = sum(p.numel() * p.element_size() for p in target.module.parameters()) < ONNX_MAX_INLINE_BYTES
    with _quiet():
        try:
            onnx_program = torch.onnx.export(program, tuple(example), input_names=target.input_names,
                                              output_names=target.output_names, opset_version=opset, dynamo=True,
                                              external_data=not inline, verbose=False)
        except Exception as err:  # noqa: BLE001
            raise capture_error(err, target.module.model, target.model_class, "onnx") from None
    onnx_program.save(str(path), external_data=not inline)
    model = onnx.load(str(path), load_external_data=False)
    _name_dynamic_axes(model, target)
    onnx.save(model, str(path))
    return {"opset": next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None),
            "dim_max": dim_max(program, target), "onnx_version": onnx.__version__}


def _name_dynamic_axes(model: Any, target: ExportTarget) -> None:
    """Rename the exporter's symbols (s18, s41) to batch / sequence wherever they appear as a whole dimension."""
    axes = target.sample.dynamic_axes()
    names: dict[str, str] = {}
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        for axis, label in axes.get(value.name, {}).items():
            if axis < len(dims) and dims[axis].dim_param:
                names[dims[axis].dim_param] = label
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in names:
                dim.dim_param = names[dim.dim_param]


@contextmanager
def _quiet():
    """torch.export / torch.onnx log their progress and optional-dependency notes (torchvision ops), and a failed
    torch.export prints its partial graph: keep the export's own output readable. Errors still raise."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "torch._export",
                                                    "torch.fx.experimental.symbolic_shapes", "torch._dynamo")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def load_artifact(fmt: str, path: Path, input_names: Sequence[str]) -> Runner | None:
    """The artifact as `run(inputs) -> [outputs]`, loaded the way a serving stack loads it; None for ONNX when
    onnxruntime is not installed (the file is then only checked with onnx.checker)."""
    if fmt == "torchscript":
        module = torch.jit.load(str(path), map_location="cpu")
        return lambda inputs: _as_list(module(*inputs))
    if fmt == "exported_program":
        module = torch.export.load(str(path)).module()
        return lambda inputs: _as_list(module(*inputs))
    try:
        import onnxruntime
    except ImportError:
        require("onnx", "--format onnx").checker.check_model(str(path))
        return None
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    used = {i.name for i in session.get_inputs()}  # an input the graph does not read is not one of its inputs

    def run(inputs: Inputs) -> list[torch.Tensor]:
        feed = {n: t.numpy() for n, t in zip(input_names, inputs, strict=True) if n in used}
        return [torch.from_numpy(out) for out in session.run(None, feed)]

    return run


def _as_list(out: Any) -> list[torch.Tensor]:
    return [out] if isinstance(out, torch.Tensor) else list(out)
