"""A run directory is data, not code: exporting or resuming from one that someone else crafted runs nothing.

`accel-train export RUN_DIR` builds the model that model_factory.json names only when the package registers that
builder (the recipes' models), or the class config.json names when it is a transformers model class; anything else
needs the user's own `--factory` or `--trust_factory`. A checkpoint's stream position loads with
`torch.load(weights_only=True)`: a pickle that would call a function is refused. Every crafted file here would
create a marker file if it ran; the tests assert the refusal and that the marker does not exist.

An unmerged LoRA run is a third case of a run directory the exporter cannot take: its message names the real remedy
(--merge_lora, or the merge command it prints), and that command is run here to show it works.
"""

import json
import re
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from accel_train.cli import main as cli
from accel_train.core.stream import StreamPosition
from accel_train.deploy import PACKAGE_FACTORIES, ModelFactory, describe_model, export_run, load_trained_model
from accel_train.errors import CheckpointError, ExportError
from accel_train.rundir.layout import stream_position_file
from accel_train.tasks.multimodal.dual_encoder import DualEncoder
from accel_train.tasks.multimodal.fusion_model import FusionEncoder
from accel_train.tasks.vision.dense.detection import CenterNet
from accel_train.tasks.vision.dense.segmentation import UNet
from accel_train.tasks.vision.models import SmallResNet

pytestmark = pytest.mark.usefixtures("one_thread")


def small_resnet_run(run_dir, factory: dict) -> None:
    """A run directory whose weights are a real SmallResNet's, and whose model_factory.json is `factory`."""
    torch.manual_seed(0)
    save_file(SmallResNet(3, widths=(4,), blocks_per_stage=1).state_dict(), run_dir / "model.safetensors")
    (run_dir / "model_factory.json").write_text(json.dumps(factory))


def own_module(tmp_path, monkeypatch, name: str, body: str) -> None:
    """A user's module `name` on sys.path (dropped from sys.modules at the end of the test)."""
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)


# ------------------------------------------------------------------------------------- model_factory.json


@pytest.mark.parametrize("target,kwargs", [
    ("os:system", lambda marker: {"command": f"touch {marker}"}),
    ("subprocess:check_call", lambda marker: {"args": ["touch", str(marker)]}),
    # a registered module, but another attribute reached through it
    ("accel_train.deploy.factories:nn.functional.torch.save", lambda marker: {"obj": 1, "f": str(marker)}),
])
def test_a_model_factory_naming_other_code_is_refused_and_runs_nothing(tmp_path, capsys, target, kwargs):
    marker = tmp_path / "ran"
    run = tmp_path / "run"
    run.mkdir()
    small_resnet_run(run, {"factory": target, "kwargs": kwargs(marker)})
    assert cli(["export", str(run), "--format", "torchscript"]) == 2
    err = capsys.readouterr().err
    assert f"model_factory.json names {target}" in err and "--trust_factory" in err
    assert not marker.exists()
    with pytest.raises(ExportError, match="trust_factory"):
        load_trained_model(run)
    assert not marker.exists()


def test_an_unregistered_factory_module_is_not_even_imported(tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    own_module(tmp_path, monkeypatch, "crafted_models_import", f"""
        import pathlib
        pathlib.Path({str(marker)!r}).touch()
        def build():
            raise AssertionError("never called")
    """)
    run = tmp_path / "run"
    run.mkdir()
    small_resnet_run(run, {"factory": "crafted_models_import:build", "kwargs": {}})
    with pytest.raises(ExportError, match="crafted_models_import:build"):
        load_trained_model(run)
    assert not marker.exists() and "crafted_models_import" not in sys.modules


def test_the_users_own_factory_builds_when_trusted_or_given_explicitly(tmp_path, monkeypatch):
    own_module(tmp_path, monkeypatch, "own_models_trusted", """
        from torch import nn

        class Net(nn.Module):
            def __init__(self, width):
                super().__init__()
                self.conv = nn.Conv2d(3, width, 3)

            def forward(self, pixel_values):
                return self.conv(pixel_values).mean((2, 3))

        def build(width):
            return Net(width)
    """)
    import own_models_trusted

    torch.manual_seed(0)
    model = own_models_trusted.build(4)
    run = tmp_path / "run"
    run.mkdir()
    save_file(model.state_dict(), run / "model.safetensors")
    ModelFactory("own_models_trusted:build", {"width": 4}).save(run)  # what RecordModelFactory(factory=...) writes
    inputs = tmp_path / "inputs.safetensors"
    save_file({"pixel_values": torch.randn(4, 3, 8, 8)}, inputs)

    with pytest.raises(ExportError, match="own_models_trusted:build"):
        export_run(run, "torchscript", tmp_path / "refused", inputs=inputs)
    (trusted,) = export_run(run, "torchscript", tmp_path / "trusted", inputs=inputs, trust_factory=True)
    assert trusted.verified and trusted.max_abs_diff <= 1e-6
    assert cli(["export", str(run), "--format", "torchscript", "--output", str(tmp_path / "cli"), "--inputs",
                str(inputs), "--trust_factory"]) == 0
    (run / "model_factory.json").unlink()
    assert cli(["export", str(run), "--format", "torchscript", "--output", str(tmp_path / "explicit"), "--inputs",
                str(inputs), "--factory", "own_models_trusted:build", "--factory_kwargs", '{"width": 4}']) == 0
    rebuilt = torch.jit.load(str(tmp_path / "explicit" / "model.pt"))
    x = torch.randn(2, 3, 8, 8)
    assert torch.equal(rebuilt(x)[0], model.eval()(x))


def test_every_model_the_package_records_is_registered():
    from transformers import BertConfig, BertModel

    text = BertModel(BertConfig(vocab_size=12, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=16, max_position_embeddings=16), add_pooling_layer=False)
    vision = SmallResNet(0, widths=(4,), blocks_per_stage=1)
    models = [SmallResNet(3, widths=(4,), blocks_per_stage=1), CenterNet(2, widths=(4, 8, 8), blocks_per_stage=1),
              UNet(2, widths=(4, 8), blocks_per_stage=1), DualEncoder(text, vision, embed_dim=8),
              FusionEncoder(text, vision, embed_dim=8, fusion_layers=1, fusion_dim=8, fusion_heads=2)]
    assert sorted(describe_model(m).target for m in models) == sorted(PACKAGE_FACTORIES)



@pytest.mark.parametrize("recorded, build", [
    ("accel_train.tasks.vision.detection:CenterNet", lambda: CenterNet(2, widths=(4, 8, 8), blocks_per_stage=1)),
    ("accel_train.tasks.vision.segmentation:UNet", lambda: UNet(2, widths=(4, 8), blocks_per_stage=1)),
])
def test_a_run_recorded_before_the_dense_kit_moved_still_rebuilds(tmp_path, recorded, build):
    """CenterNet and UNet moved from tasks/vision/ to tasks/vision/dense/ (issue 39): the model_factory.json of a run
    trained before names the old module, and that run still exports, as the model it trained."""
    torch.manual_seed(0)
    trained = build().eval()
    run = tmp_path / "run"
    run.mkdir()
    save_file(trained.state_dict(), run / "model.safetensors")
    (run / "model_factory.json").write_text(json.dumps({"factory": recorded, "kwargs": trained.factory_kwargs}))
    rebuilt = load_trained_model(run)
    assert rebuilt.built_by == describe_model(trained).target
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected, got = trained(x), rebuilt.model(x)
    expected, got = (expected, got) if isinstance(expected, dict) else ({"out": expected}, {"out": got})
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)

# ------------------------------------------------------------------------------------------- config.json


def test_a_config_naming_remote_code_or_a_non_model_builds_nothing(tmp_path, capsys):
    marker = tmp_path / "ran"
    run = tmp_path / "run"
    run.mkdir()
    (run / "model.safetensors").write_bytes(b"")
    (run / "crafted_config.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                                           "from transformers import PretrainedConfig\n"
                                           "class Crafted(PretrainedConfig):\n    model_type = 'crafted'\n")
    (run / "config.json").write_text(json.dumps({"model_type": "crafted", "architectures": ["Crafted"],
                                                 "auto_map": {"AutoConfig": "crafted_config.Crafted"}}))
    assert cli(["export", str(run), "--format", "torchscript"]) == 2
    assert "runs no code" in capsys.readouterr().err and not marker.exists()

    (run / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["set_seed"]}))
    with pytest.raises(ExportError, match=r"architectures \['set_seed'\] names no transformers model class"):
        load_trained_model(run)


# ---------------------------------------------------------------------------------------- stream position


class Crafted:
    """Pickles as a call that would create `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (torch.save, (1, str(self.marker)))


class Loader:
    def __init__(self):
        self.loaded = []

    def load_state_dict(self, state):
        self.loaded.append(state)


def test_a_crafted_stream_position_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    folder = tmp_path / "checkpoints" / "step-00000002"
    folder.mkdir(parents=True)
    torch.save({"_num_yielded": 2, "dataset_state": Crafted(marker)}, folder / stream_position_file(0))
    position = StreamPosition()
    position.loader = Loader()
    with pytest.raises(CheckpointError, match="stream_position_rank0.pt.*not a loader position"):
        position.restore(folder, num_processes=1, batch_in_epoch=2)
    assert not marker.exists() and position.loader.loaded == []


def test_a_saved_stream_position_still_loads(tmp_path):
    from datasets import Dataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    stream = Dataset.from_dict({"x": list(range(32))}).to_iterable_dataset(num_shards=2)
    loader = StatefulDataLoader(stream, batch_size=4)
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    saved = StreamPosition()
    saved.loader = loader
    saved.save(tmp_path)
    resumed = StreamPosition()
    resumed.loader = StatefulDataLoader(stream, batch_size=4)
    assert resumed.restore(tmp_path, num_processes=1, batch_in_epoch=3)
    assert [b["x"].tolist() for b in resumed.loader] == [b["x"].tolist() for b in batches]


# -------------------------------------------------------------------------------------------- LoRA


def test_an_unmerged_lora_run_says_how_to_merge_and_that_merge_exports(tmp_path):
    import peft
    from transformers import BertTokenizer, LlamaConfig, LlamaForCausalLM

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "a", "film", "great", "dull"]
    base = tmp_path / "base"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(words), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
                     ).save_pretrained(base)
    tokenizer = BertTokenizer(vocab={w: i for i, w in enumerate(words)}, model_input_names=["input_ids",
                                                                                             "attention_mask"])
    model = peft.get_peft_model(LlamaForCausalLM.from_pretrained(base), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM", init_lora_weights=False))
    run = tmp_path / "run"
    model.save_pretrained(run)  # what a --lora_r run leaves in output_dir: the adapter, no config.json
    tokenizer.save_pretrained(run)

    with pytest.raises(ExportError) as refused:
        export_run(run, "torchscript")
    message = str(refused.value)
    assert "LoRA adapter" in message and "--merge_lora" in message and "--factory" not in message
    (code,) = re.findall(r'python -c "(.*?)"', message)
    exec(code, {})  # the command the message gives, run as the user would
    merged = run / "export" / "merged"
    assert f"accel-train export {merged}" in message

    (result,) = export_run(merged, "torchscript")
    assert result.verified
    ids = torch.tensor([[5, 7, 8, 6]])
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits
        got = torch.jit.load(str(result.path))(ids, torch.ones_like(ids))[0]
    assert (got - expected).abs().max().item() < 1e-5
