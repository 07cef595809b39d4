"""Deployment: export a trained model as TorchScript, a torch.export ExportedProgram or ONNX, verified against it.

    accel-train export RUN_DIR --format onnx                 # or torchscript, exported_program
    accel-train export RUN_DIR/checkpoints/step-00000120 --format exported_program --output my_export/

    from accel_train.deploy import export_run
    results = export_run("outputs/nlp_finetune", "onnx")      # [ExportResult(path, bytes, max_abs_diff, ...)]

The model is rebuilt from what the run saved (`rebuild.py`: config.json for transformers models,
model_factory.json for plain modules, `factory.py`), traced or exported with example inputs from the run's own
evaluation data where it kept them (`inputs.py`), with the batch and sequence axes dynamic, written with an
export.json, loaded back the way a serving stack loads it, and compared with the model on held-out inputs at
other shapes (`verify.py`); a difference above the tolerance is an `ExportError`. A dual encoder is exported
as a text tower and a vision tower (`targets.py`); an encoder-decoder as an encoder, a decoder and a decoder with
past, whose greedy decoding loops must give the tokens of the model's `generate()` (`seq2seq.py`, `decoding.py`).
`export_formats_at_end` is what `--export_formats` runs. Submodules: api, formats, targets, seq2seq, decoding,
inputs, rebuild, factory, factories, verify, explain.
"""

from .api import DEFAULT_TOLERANCE, ExportResult, export_formats_at_end, export_model_artifacts, export_run
from .factory import FACTORY_FILE, PACKAGE_FACTORIES, ModelFactory, RecordModelFactory, describe_model
from .formats import FORMATS
from .inputs import Sample, sample_from_batch, sample_from_file, sample_from_texts, synthetic_sample
from .rebuild import TrainedModel, load_trained_model
from .targets import check_exportable

__all__ = [
    "FORMATS",
    "DEFAULT_TOLERANCE",
    "export_run",
    "export_model_artifacts",
    "export_formats_at_end",
    "check_exportable",
    "ExportResult",
    "load_trained_model",
    "TrainedModel",
    "ModelFactory",
    "RecordModelFactory",
    "describe_model",
    "FACTORY_FILE",
    "PACKAGE_FACTORIES",
    "Sample",
    "sample_from_batch",
    "sample_from_file",
    "sample_from_texts",
    "synthetic_sample",
]
