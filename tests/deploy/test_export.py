"""Export for inference: TorchScript, torch.export and ONNX artifacts of each recipe's kind of model,
loaded back the way a serving stack loads them and compared with the model at shapes other than the example's.

The ONNX cases need the optional packages (pip install 'accel_train[deploy]') and are skipped without them. Runs are
in this process; 2 processes are the session's spawned gloo ranks (conftest's `ranks`).
"""

import importlib.util
import json
import re
import subprocess
import sys

import image_classification
import nlp_finetune
import numpy as np
import pytest
import torch
from conftest import FILLER, NEGATIVE, POSITIVE, ROOT, make_rows, printed_per_rank, printing_to_a_file, reset_accelerate
from PIL import Image
from torch import nn

from accel_train import ConfigError, TrainConfig
from accel_train.cli import main as cli
from accel_train.deploy import (
    FORMATS,
    ModelFactory,
    Sample,
    describe_model,
    export_formats_at_end,
    export_model_artifacts,
    sample_from_batch,
    synthetic_sample,
)
from accel_train.errors import ExportError
from accel_train.tasks.multimodal.dual_encoder import DualEncoder
from accel_train.tasks.vision.models import SmallResNet

HAS_ONNX = all(importlib.util.find_spec(m) for m in ("onnx", "onnxscript", "onnxruntime"))
# ONNX: the optional packages, and the slowest exporter (several seconds even for a tiny model)
ONNX_MARKS = [pytest.mark.skipif(not HAS_ONNX, reason="pip install 'accel_train[deploy]'"), pytest.mark.slow]
FORMAT_CASES = [pytest.param(f, marks=ONNX_MARKS if f == "onnx" else ()) for f in FORMATS]
QUIET = ["--report_to", "none", "--disable_tqdm", "--no_preflight", "--run_report", "false", "--cpu_threads", "1"]
WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(
    "the a delivery arrived two days late and box was damaged great service i am not sure how feel about new "
    "update some parts are better others clearly worse thanks for quick reply battery lasts all day even with "
    "screen at full brightness ever experience it works but instructions could have been written more first "
    "time users absolutely love".split()))]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import BertTokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    BertTokenizer(vocab={token: i for i, token in enumerate(WORDS)}).save_pretrained(path)
    return BertTokenizer.from_pretrained(path)


def tiny_bert_config(vocab_size=None, **extra):
    from transformers import BertConfig

    return BertConfig(vocab_size=vocab_size or len(WORDS), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=64, **extra)


def text_classifier():
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(tiny_bert_config(num_labels=3)).eval()


def image_model(kind):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    if kind == "small_resnet":
        return SmallResNet(3, widths=(4, 8), blocks_per_stage=1).eval()
    config = ViTConfig(image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=32, num_labels=3)
    return ViTForImageClassification(config).eval()


def dual_encoder():
    from transformers import BertModel

    torch.manual_seed(0)
    return DualEncoder(BertModel(tiny_bert_config(), add_pooling_layer=False),
                       SmallResNet(0, widths=(4, 8), blocks_per_stage=1), embed_dim=8).eval()


def run_artifact(fmt, path, names, inputs):
    """Load and run an artifact with the runtime alone (not accel_train's loader): what a serving stack does."""
    if fmt == "torchscript":
        out = torch.jit.load(str(path))(*inputs)
    elif fmt == "exported_program":
        out = torch.export.load(str(path)).module()(*inputs)
    else:
        import onnxruntime

        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        feed = dict(zip(names, (t.numpy() for t in inputs), strict=True))
        out = [torch.from_numpy(o) for o in session.run(None, {i.name: feed[i.name] for i in session.get_inputs()})]
    return [out] if isinstance(out, torch.Tensor) else list(out)


def assert_round_trip(result, fmt, names, inputs, expected, tolerance=1e-5):
    """Verified at three shapes by the exporter, and equal on a fourth one here."""
    meta = json.loads((result.path.parent / "export.json").read_text())
    record = next(a for a in meta["artifacts"] if a["file"] == result.path.name)
    assert result.verified and result.max_abs_diff <= tolerance and record["max_abs_diff"] == result.max_abs_diff
    shapes = [c["shapes"] for c in record["checks"]]
    assert len(set(shapes)) == 3 and shapes[0] == record["example_shapes"]  # other rows; 2 more shapes
    assert [i["name"] for i in record["inputs"]] == names and meta["torch_version"] == torch.__version__
    assert meta["format"] == fmt and ("opset" in record) == (fmt == "onnx")
    got = run_artifact(fmt, result.path, names, inputs)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and (g - e).abs().max().item() <= tolerance


# ------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("fmt", FORMAT_CASES)
def test_a_tiny_text_classifier_round_trips_with_dynamic_batch_and_sequence(fmt, tokenizer, tmp_path):
    model = text_classifier()
    sample = synthetic_sample(tokenizer)
    (result,) = export_model_artifacts(model, fmt, tmp_path, sample, tolerance=1e-5)
    record = json.loads((tmp_path / "export.json").read_text())["artifacts"][0]
    assert record["outputs"] == ["logits"]
    assert all(i["dynamic_axes"] == {"0": "batch", "1": "sequence"} for i in record["inputs"])
    assert [c["shapes"].split()[0] for c in record["checks"]][1:] == ["3x29", "1x6"]  # batch 3 longer; 1 unpadded
    batch = tokenizer(["great service", "the box was damaged and late", "love it", "not sure", "thanks"],
                      padding=True, return_tensors="pt")  # batch 5: a shape no check used
    names = ["input_ids", "attention_mask", "token_type_ids"]
    with torch.no_grad():
        expected = [model(**batch).logits]
    assert_round_trip(result, fmt, names, [batch[n] for n in names], expected)


@pytest.mark.parametrize("fmt", FORMAT_CASES)
@pytest.mark.parametrize("kind", ["small_resnet", "vit"])
def test_a_tiny_image_classifier_round_trips_with_a_dynamic_batch(kind, fmt, tmp_path):
    model = image_model(kind)
    (result,) = export_model_artifacts(model, fmt, tmp_path, synthetic_sample(image_size=16), tolerance=1e-5)
    record = json.loads((tmp_path / "export.json").read_text())["artifacts"][0]
    assert record["inputs"][0]["dynamic_axes"] == {"0": "batch"} and record["example_shapes"] == "2x3x16x16"
    images = torch.randn(5, 3, 16, 16)
    with torch.no_grad():
        out = model(pixel_values=images)
    assert_round_trip(result, fmt, ["pixel_values"], [images], [getattr(out, "logits", out)])


@pytest.mark.parametrize("fmt", FORMAT_CASES)
def test_the_contrastive_towers_export_alone_and_give_the_models_embeddings(fmt, tokenizer, tmp_path):
    model = dual_encoder()
    results = export_model_artifacts(model, fmt, tmp_path, synthetic_sample(tokenizer, image_size=16))
    assert [r.name for r in results] == ["text_tower", "vision_tower"]
    batch = tokenizer(["great service", "the box was damaged", "thanks"], padding=True, return_tensors="pt")
    images = torch.randn(4, 3, 16, 16)
    with torch.no_grad():
        out = model(pixel_values=images, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    text, vision = results
    assert_round_trip(text, fmt, ["input_ids", "attention_mask"], [batch["input_ids"], batch["attention_mask"]],
                      [out["text_embeds"]])
    assert_round_trip(vision, fmt, ["pixel_values"], [images], [out["image_embeds"]])
    meta = json.loads((tmp_path / "export.json").read_text())
    assert [a["outputs"] for a in meta["artifacts"]] == [["text_embeds"], ["image_embeds"]]
    if fmt != "onnx":  # each artifact carries its own tower's weights only (ONNX prunes unused ones itself)
        assert saved_parts(fmt, text.path) == {"text", "text_projection", "logit_scale"}
        assert saved_parts(fmt, vision.path) == {"vision", "vision_projection", "logit_scale"}


def saved_parts(fmt, path):
    """The DualEncoder attributes whose weights an artifact holds."""
    if fmt == "torchscript":
        names = [n for n, _ in torch.jit.load(str(path)).named_parameters()]
    else:
        names = list(torch.export.load(str(path)).state_dict)
    return {n.split(".")[1] for n in names}


# ------------------------------------------------------------------------------------------- what fails


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: no graph holds both branches
            return x * 2
        return x - 1


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, pixel_values):
        return self.gate(self.proj(pixel_values))


@pytest.mark.parametrize("fmt", FORMAT_CASES)
def test_data_dependent_control_flow_is_a_clear_error_naming_the_module(fmt, tmp_path):
    model = Gated()
    with torch.no_grad():
        model.proj.weight.copy_(torch.eye(4))
        model.proj.bias.zero_()
    rows = torch.rand(8, 4)
    rows[2:] *= -1  # the example (rows 0-1) takes one branch, the checks the other
    with pytest.raises(ExportError) as err:
        export_model_artifacts(model, fmt, tmp_path, Sample({"pixel_values": rows}, "test rows"))
    message = str(err.value)
    assert f"--format {fmt}" in message and "gate (Gate)" in message and "test_export.py" in message
    if fmt != "torchscript":
        assert "`if x.sum() > 0:`" in message and "data-dependent" in message
    assert not (tmp_path / "export.json").exists()


def test_an_artifact_that_differs_from_the_model_is_refused_and_leaves_the_previous_export(tmp_path, monkeypatch):
    """A refused artifact was written over the previous one first, beside that one's export.json (verified, its
    figures): the folder said verified of an unverified model. The previous export stays as it was, nothing added."""
    import accel_train.deploy.verify as verify

    real = verify.load_artifact
    sample = synthetic_sample(image_size=16)
    export_model_artifacts(image_model("small_resnet"), "torchscript", tmp_path / "out", sample)
    before = {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    def drifting(*args):
        run = real(*args)
        return lambda inputs: [t + 1e-3 for t in run(inputs)]

    monkeypatch.setattr(verify, "load_artifact", drifting)
    with pytest.raises(ExportError, match=r"differs from the trained model by 0\.001 .* above the tolerance 0\.0001"):
        export_model_artifacts(image_model("vit"), "torchscript", tmp_path / "out", sample)
    assert {p.name: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_missing_optional_dependency_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # import onnxscript -> ImportError
    with pytest.raises(ExportError, match=re.escape("pip install 'accel_train[deploy]'")):
        export_model_artifacts(image_model("small_resnet"), "onnx", tmp_path, synthetic_sample(image_size=16))


def test_export_formats_flag_is_validated():
    assert TrainConfig(export_formats=["onnx", "torchscript"]).export_formats == ["onnx", "torchscript"]
    with pytest.raises(ConfigError, match="--export_formats='tflite'.*torchscript, exported_program, onnx"):
        TrainConfig(export_formats=["tflite"])


# ------------------------------------------------------------------------------------- rebuilding a model


def test_plain_models_describe_a_factory_that_rebuilds_their_architecture():
    for model in (SmallResNet(5, widths=(4, 8, 16), blocks_per_stage=2, stem_stride=2), dual_encoder()):
        factory = describe_model(model)
        again = ModelFactory(**json.loads(json.dumps(factory.__dict__))).build()  # through JSON, as in the file
        shapes = {k: v.shape for k, v in model.state_dict().items()}
        assert {k: v.shape for k, v in again.state_dict().items()} == shapes
    assert describe_model(nn.Linear(2, 2)) is None
    with pytest.raises(ExportError, match="expected 'package.module:callable'"):
        ModelFactory("accel_train.tasks.vision.models.SmallResNet")


def test_first_caption_of_an_image_text_batch_feeds_the_text_tower():
    batch = {"pixel_values": torch.randint(0, 256, (3, 3, 8, 8), dtype=torch.uint8),
             "caption_input_ids": torch.arange(18).view(3, 2, 3), "caption_attention_mask": torch.ones(3, 2, 3),
             "image_ids": torch.arange(3), "labels": torch.zeros(3)}
    sample = sample_from_batch(batch)
    assert torch.equal(sample.tensors["input_ids"], batch["caption_input_ids"][:, 0])
    assert sample.tensors["pixel_values"].dtype == torch.float32 and "labels" not in sample.tensors
    pixels = sample.tensors["pixel_values"]
    assert pixels.mean(dim=(0, 2, 3)).abs().max() < 1e-5  # standardised per channel without a processor


# ---------------------------------------------------------------------- real recipe runs, the CLI, the docs


def test_the_export_at_the_end_of_a_bf16_run_is_an_fp32_graph(tmp_path):
    from accelerate import Accelerator

    reset_accelerate()
    accelerator = Accelerator(mixed_precision="bf16", cpu=True)
    model = accelerator.prepare(image_model("small_resnet"))
    loader = [{"pixel_values": torch.randn(2, 3, 16, 16)}]
    (result,) = export_formats_at_end(accelerator, model, tmp_path, ["exported_program"], eval_loader=loader)
    assert result.verified and "bfloat16" not in str(torch.export.load(result.path).graph), \
        "the exported graph runs the class's fp32 forward, not Accelerate's autocast wrapper"
    assert "forward" in model.__dict__, "the training model keeps its autocast wrapper"
    reset_accelerate()


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    """A real nlp_finetune run of a tiny BERT that exports every available format at the end."""
    from transformers import BertForSequenceClassification, BertTokenizer

    root = tmp_path_factory.mktemp("text_run")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *sorted(set(POSITIVE + NEGATIVE + FILLER))]
    BertTokenizer(vocab={t: i for i, t in enumerate(vocab)}).save_pretrained(root / "model")
    torch.manual_seed(0)
    BertForSequenceClassification(tiny_bert_config(len(vocab))).save_pretrained(root / "model")
    for split, n, seed in (("train", 32, 0), ("dev", 16, 1)):
        (root / f"toy.{split}").write_text("".join(f"{y} {t}\n" for y, t in make_rows(n, seed)))
    out = root / "run"
    formats = [f for f in FORMATS if f != "onnx" or HAS_ONNX]
    reset_accelerate()
    nlp_finetune.main(["--model_name_or_path", str(root / "model"), "--train_file", str(root / "toy.train"),
                       "--validation_file", str(root / "toy.dev"), "--output_dir", str(out), *QUIET,
                       "--max_steps", "2", "--per_device_train_batch_size", "8", "--max_seq_length", "32",
                       "--save_strategy", "no", "--load_best_model_at_end", "false", "--export_formats", *formats])
    reset_accelerate()
    return out, formats


@pytest.mark.slow
def test_export_formats_at_the_end_of_a_text_run_use_its_evaluation_data(text_run):
    out, formats = text_run
    from safetensors.torch import load_file

    kept = load_file(out / "export" / "example_inputs.safetensors")
    assert set(kept) == {"input_ids", "attention_mask", "token_type_ids"} and kept["input_ids"].shape[0] == 8
    for fmt in formats:
        meta = json.loads((out / "export" / fmt / "export.json").read_text())
        assert meta["example_inputs"] == "the run's evaluation data"
        (record,) = meta["artifacts"]
        assert record["verified"] and record["max_abs_diff"] <= 1e-5
        assert (out / "export" / fmt / record["file"]).is_file()


@pytest.mark.slow
def test_cli_exports_a_text_run_with_texts_from_a_file(text_run, tmp_path, capsys):
    out, _ = text_run
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(t for _, t in make_rows(8, 5)))
    assert cli(["export", str(out), "--format", "torchscript", "--output", str(tmp_path / "ts"), "--inputs",
                str(texts)]) == 0
    meta = json.loads((tmp_path / "ts" / "export.json").read_text())
    assert meta["example_inputs"] == "texts.txt (8 texts)" and "BertForSequenceClassification" in meta["source"]
    assert "max |difference|" in capsys.readouterr().out


@pytest.mark.slow
def test_the_docs_load_each_artifact_without_accel_train(text_run, tmp_path):
    out, formats = text_run
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "deploy.md").read_text(), re.S)
    script = ["import sys", "sys.modules['accel_train'] = None  # the snippets must not need it"]
    for fmt in formats:  # each snippet as the docs show it, in one process (one torch import)
        code = next(b for b in blocks if f"export/{fmt}/" in b and "outputs/nlp_finetune" in b)  # the classifier's
        code = code.replace("outputs/nlp_finetune", str(out))
        script += [f"def load_{fmt}():", *("    " + line for line in code.splitlines()), "    return logits",
                   f"print({fmt!r}, tuple(load_{fmt}().shape))"]
    (tmp_path / "snippets.py").write_text("\n".join(script) + "\n")
    proc = subprocess.run([sys.executable, "snippets.py"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:len(formats)] == [f"{fmt} (2, 2)" for fmt in formats]


@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    """A real image_classification run of a tiny SmallResNet, with a checkpoint per epoch."""
    root = tmp_path_factory.mktemp("image_run")
    rng = np.random.default_rng(0)
    for split, n in {"train": 6, "test": 3}.items():
        for cls, colour in zip(("red", "green", "blue"), [(220, 40, 40), (40, 220, 40), (40, 40, 220)], strict=True):
            folder = root / "data" / split / cls
            folder.mkdir(parents=True)
            for i in range(n):
                pixels = np.clip(np.array(colour) + rng.normal(0, 25, (16, 16, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")
    out = root / "run"
    reset_accelerate()
    image_classification.main(["--data_dir", str(root / "data"), "--output_dir", str(out), *QUIET,
                               "--config_overrides", '{"widths": [4, 8], "blocks_per_stage": 1}',
                               "--num_train_epochs", "2", "--per_device_train_batch_size", "6",
                               "--export_formats", "torchscript"])
    reset_accelerate()
    return out


@pytest.mark.slow
def test_cli_exports_an_image_run_and_its_checkpoint_from_the_recorded_factory(image_run, capsys):
    factory = json.loads((image_run / "model_factory.json").read_text())
    assert factory == {"factory": "accel_train.tasks.vision.models:SmallResNet", "kwargs": {
        "num_labels": 3, "widths": [4, 8], "blocks_per_stage": 1, "in_channels": 3, "stem_stride": 1}}
    assert json.loads((image_run / "export" / "torchscript" / "export.json").read_text())["artifacts"][0]["verified"]
    fmt = "onnx" if HAS_ONNX else "exported_program"
    assert cli(["export", str(image_run), "--format", fmt]) == 0
    meta = json.loads((image_run / "export" / fmt / "export.json").read_text())
    assert meta["example_inputs"] == "the run's evaluation data"  # kept by the end-of-training export
    checkpoint = sorted((image_run / "checkpoints").iterdir())[0]
    assert cli(["export", str(checkpoint), "--format", "exported_program"]) == 0
    assert (image_run / "export" / checkpoint.name / "exported_program" / "model.pt2").is_file()
    # weights of another architecture: refused, naming the parameter
    assert cli(["export", str(checkpoint), "--format", "torchscript", "--factory",
                "accel_train.tasks.vision.models:SmallResNet", "--factory_kwargs", '{"num_labels": 3}']) == 2
    assert "do not fit the rebuilt SmallResNet: size mismatch for stem.0.weight" in capsys.readouterr().err


def test_cli_on_a_directory_without_a_model_says_what_is_missing(tmp_path, capsys):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert cli(["export", str(tmp_path), "--format", "torchscript"]) == 2
    err = capsys.readouterr().err
    assert "accel-train export error" in err and "no config.json and no model_factory.json" in err
    assert "--factory" in err


def test_export_formats_under_two_processes_export_once_on_the_main_process(image_run, tmp_path, ranks):
    out = tmp_path / "run"
    ranks.run(printing_to_a_file, image_classification.main,
              ["--data_dir", str(image_run.parent / "data"), "--output_dir", str(out), *QUIET,
               "--config_overrides", '{"widths": [4, 8], "blocks_per_stage": 1}', "--num_train_epochs", "1",
               "--per_device_train_batch_size", "3", "--save_strategy", "no", "--export_formats", "torchscript"])
    printed = printed_per_rank(out)
    assert [p.count("accel-train export: torchscript") for p in printed] == [1, 0]  # the main process, once
    (record,) = json.loads((out / "export" / "torchscript" / "export.json").read_text())["artifacts"]
    assert record["verified"] and record["max_abs_diff"] <= 1e-5
