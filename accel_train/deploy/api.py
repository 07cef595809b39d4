"""Export a trained model, verify the artifact, write export.json: from a live model, a run directory, or at the
end of training."""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import ExportError
from ..rundir.layout import EXPORT_DIR
from .decoding import generation_summary, verify_generation
from .factory import ModelFactory, describe_model
from .formats import FORMATS, SUFFIX, write_artifact
from .inputs import Sample, first_samples, sample_from_batch, sample_from_file, shape_text, synthetic_sample, views
from .rebuild import load_trained_model
from .seq2seq import is_encoder_decoder, seq2seq_plans
from .targets import export_targets
from .verify import verify_artifact

DEFAULT_TOLERANCE = 1e-4
SAMPLE_FILE = "example_inputs.safetensors"  # the run's own evaluation inputs, kept for later exports


@dataclass
class ExportResult:
    """One written artifact: its path and size, and the verification (max |artifact - model| over the checks)."""

    format: str
    name: str
    path: Path
    size_bytes: int
    max_abs_diff: float | None
    verified: bool

    def summary(self) -> str:
        check = (f"max |difference| {self.max_abs_diff:.2e} vs the trained model" if self.verified
                 else "not verified (onnxruntime not installed)")
        return f"{self.format}: {self.path} ({self.size_bytes / 1e6:.2f} MB), {check}"


def export_model_artifacts(model: nn.Module, fmt: str, output_dir: str | Path, sample: Sample, *,
                           tolerance: float = DEFAULT_TOLERANCE, opset: int | None = None,
                           source: str = "a live model") -> list[ExportResult]:
    """Export `model` (one artifact, or one per tower of a dual encoder) as `fmt` into `output_dir`, verify each
    against the model on held-out rows of `sample` at other shapes, and write ``output_dir/export.json``.

        results = export_model_artifacts(model, "onnx", "runs/demo/export/onnx", sample)
        print(results[0].max_abs_diff)

    The model is exported in eval mode; pass it in fp32 on the CPU for a portable artifact. Raises ExportError
    when the model cannot be captured (naming the module) or an artifact differs by more than `tolerance`.
    """
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt}: unknown; choose one of {', '.join(FORMATS)}.")
    output_dir = Path(output_dir)
    training = model.training
    model.eval()
    results, records, inputs = [], [], {}
    generation = None
    # written and verified in a folder beside output_dir, moved in only when every check passed: a failed export
    # leaves the previous artifacts and their export.json as they were
    with staged(output_dir) as staging:
        try:
            plans = (seq2seq_plans(model, sample) if is_encoder_decoder(model)
                     else [(target, *views(target.sample)) for target in export_targets(model, sample)])
            for target, example, checks in plans:
                path = staging / f"{target.name}{SUFFIX[fmt]}"
                with torch.no_grad():
                    info = write_artifact(fmt, target, example, [c for _, c in checks], path, opset)
                verdict = verify_artifact(fmt, path, target, checks, tolerance)
                result = ExportResult(fmt, target.name, output_dir / path.name, path.stat().st_size,
                                      verdict["max_abs_diff"], verdict["verified"])
                results.append(result)
                inputs[target.name] = target.input_names
                records.append(_record(target, example, result, verdict, info))
            if is_encoder_decoder(model):  # the artifacts together: their decoding loops against generate()
                paths = {r.name: staging / r.path.name for r in results}
                generation = verify_generation(fmt, paths, inputs, model, sample)
        finally:
            model.train(training)
        _write_metadata(staging, fmt, source, sample, tolerance, records, generation)
        output_dir.mkdir(exist_ok=True)
        for path in sorted(staging.iterdir(), key=lambda p: p.name == "export.json"):  # export.json last
            os.replace(path, output_dir / path.name)
    for result in results:
        print(f"accel-train export: {result.summary()}", flush=True)
    if generation is not None:
        print(f"accel-train export: {generation_summary(generation)}", flush=True)
    return results


@contextmanager
def staged(output_dir: Path) -> Iterator[Path]:
    """A new folder beside `output_dir` (the same file system: os.replace moves its files in whole), removed with
    whatever is left in it however the block ends."""
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.staging-", dir=output_dir.parent))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _record(target, example, result: ExportResult, verdict: dict, info: dict) -> dict[str, Any]:
    axes = target.sample.dynamic_axes()
    return {
        "name": target.name, "file": result.path.name, "bytes": result.size_bytes, "model_class": target.model_class,
        "inputs": [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "example_shape": list(t.shape),
                    "dynamic_axes": {str(a): label for a, label in axes[n].items()}}
                   for n, t in zip(target.input_names, example, strict=True)],
        "outputs": target.output_names, "example_shapes": shape_text(example), **verdict, **info,
    }


def _write_metadata(output_dir: Path, fmt: str, source: str, sample: Sample, tolerance: float,
                    records: list[dict], generation: dict | None) -> None:
    meta = {"format": fmt, "source": source, "example_inputs": sample.source, "torch_version": torch.__version__,
            "tolerance": tolerance, "artifacts": records, "generation_check": generation}
    try:
        import onnxruntime

        meta["onnxruntime_version"] = onnxruntime.__version__ if fmt == "onnx" else None
    except ImportError:
        pass
    (output_dir / "export.json").write_text(json.dumps({k: v for k, v in meta.items() if v is not None}, indent=2))


def export_run(path: str | Path, fmt: str, output: str | Path | None = None, *,
               factory: ModelFactory | None = None, inputs: str | Path | None = None,
               tolerance: float = DEFAULT_TOLERANCE, opset: int | None = None,
               trust_factory: bool = False) -> list[ExportResult]:
    """`accel-train export`: rebuild the model a run saved (run directory or checkpoint, see `rebuild.py`), export
    it as `fmt` and verify it. Output: `output`, default ``RUN_DIR/export/FORMAT`` (a checkpoint's:
    ``RUN_DIR/export/step-N/FORMAT``). `factory` builds the architecture as given; `trust_factory` lets the run's
    model_factory.json name a builder other than the package's own (it runs that code: only for runs you trust).

    Example inputs, best first: `inputs` (.safetensors of named input tensors, or a text file with one text per
    line), the evaluation inputs the run kept (``RUN_DIR/export/example_inputs.safetensors``, written when it
    ended with --export_formats), else inputs made from the run's tokenizer / image processor.
    """
    trained = load_trained_model(path, factory, trust_factory)
    default = trained.run_dir / EXPORT_DIR / (trained.checkpoint.name if trained.checkpoint else "") / fmt
    kept = trained.run_dir / EXPORT_DIR / SAMPLE_FILE
    if inputs:
        sample = sample_from_file(Path(inputs), trained.tokenizer)
    elif kept.is_file():
        sample = sample_from_file(kept)
    else:
        channels = getattr(getattr(trained.model, "config", None), "num_channels", 3)
        wants_images = trained.image_processor is not None or trained.tokenizer is None
        sample = synthetic_sample(trained.tokenizer, trained.image_size if wants_images else None, channels,
                                  trained.image_processor)
    source = f"{trained.checkpoint or trained.run_dir} ({trained.built_by})"
    return export_model_artifacts(trained.model, fmt, Path(output) if output else default, sample,
                                  tolerance=tolerance, opset=opset, source=source)


def export_formats_at_end(accelerator, model: nn.Module, output_dir: str | Path, formats: Sequence[str],
                          processing_class: Any = None, eval_loader: Any = None,
                          tolerance: float = DEFAULT_TOLERANCE, train_loader: Any = None) -> list[ExportResult]:
    """--export_formats: after the final safetensors export, export the trained model in each format into
    ``output_dir/export/FORMAT`` and verify it, on the main process (every process calls this; the others wait).

    The example inputs are the first evaluation batch (kept as export/example_inputs.safetensors for later
    `accel-train export` runs), else made from `processing_class`, else (neither given) the training set's first
    samples from `train_loader`. A plain module's factory is recorded too.
    Sharded models (FSDP, DeepSpeed) are skipped with a note: export them from the run directory afterwards.
    """
    if not formats:
        return []
    results: list[ExportResult] = []
    error: Exception | None = None
    if accelerator.is_main_process:
        if accelerator.distributed_type.value in ("FSDP", "DEEPSPEED"):
            print(f"accel-train export: skipped under {accelerator.distributed_type.value} (sharded weights); run "
                  f"`accel-train export {output_dir} --format FORMAT` after training.", flush=True)
        else:
            try:
                loaders = (eval_loader, train_loader)
                results = _export_at_end(accelerator, model, Path(output_dir), formats, processing_class, loaders,
                                         tolerance)
            except Exception as err:  # noqa: BLE001 - raised below, after the barrier every process reaches
                error = err
    accelerator.wait_for_everyone()  # the other processes must not tear down the group while the main exports
    if isinstance(error, ExportError):
        raise ExportError(f"{error} The trained model is saved in {output_dir}; retry with `accel-train export "
                          f"{output_dir} --format FORMAT` once fixed.") from None
    if error is not None:
        raise error
    return results


def _export_at_end(accelerator, model, output_dir: Path, formats, processing_class, loaders, tolerance):
    bare = accelerator.unwrap_model(model, keep_torch_compile=False)
    exported = copy.deepcopy(bare).to("cpu", torch.float32).eval()  # a portable fp32 CPU artifact
    # Under mixed precision Accelerate replaces the model's forward with an autocast wrapper (an instance attribute,
    # `_original_forward` keeping the old one): the copy drops both and runs its class's forward, so the graph is
    # fp32 (a bf16 MatMul has no ONNX Runtime CPU kernel) while the training model keeps its wrapper.
    for name in ("forward", "_original_forward"):
        exported.__dict__.pop(name, None)
    factory = describe_model(exported)
    if factory is not None:
        factory.save(output_dir)
    sample = _end_sample(*loaders, processing_class, exported)
    sample.save(output_dir / EXPORT_DIR / SAMPLE_FILE)
    results = []
    for fmt in formats:
        results += export_model_artifacts(exported, fmt, output_dir / EXPORT_DIR / fmt, sample, tolerance=tolerance,
                                          source=f"{output_dir} (the trained model at the end of training)")
    return results


def _end_sample(eval_loader: Any, train_loader: Any, processing_class: Any, model: nn.Module) -> Sample:
    """The first evaluation batch (read from the loader Accelerate wraps: no collective; a tuple batch's inputs named
    after `model`'s forward), else made-up inputs, else (nothing to make them from) the training set's first
    samples."""
    processor = processing_class if hasattr(processing_class, "image_mean") else None
    tokenizer = None if processor is not None else processing_class
    pad = int(getattr(tokenizer, "pad_token_id", None) or 0)
    if eval_loader is not None:
        batch = next(iter(getattr(eval_loader, "base_dataloader", eval_loader)), None)
        if isinstance(batch, (Mapping, tuple, list)):  # a dict, transformers' BatchEncoding, (inputs..., target)
            return sample_from_batch(batch, image_processor=processor, pad_token_id=pad, model=model)
    batch = first_samples(train_loader) if processing_class is None and train_loader is not None else None
    if batch is not None:
        return sample_from_batch(batch, model=model, source="the run's training data (its first samples)")
    size = (processor.size or {}).get("height") if processor is not None else None
    return synthetic_sample(tokenizer, size, 3, processor)
