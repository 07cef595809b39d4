"""Encoder-decoders export as the ONNX ecosystem exports seq2seq models: an encoder, a decoder and a decoder with
past, and greedy decoding over the loaded artifacts (the decoder alone, and the decoder with past on the cache)
gives exactly the token ids of the model's own `generate()`. Tiny bert2bert and T5 models from configs, in this
process; the text-generation recipe's run directories (a warm-started encoder-decoder, resumed, in bf16, exported
at the end of training and afterwards; and the recipe's no-flag default, slow: it warm-starts the real MiniLM) run
in this process too (`main(argv)`), and on 2 processes on the session's spawned gloo ranks (conftest's `ranks`).
"""

import json

import pytest
import text_generation
import torch
from conftest import FILLER, NEGATIVE, POSITIVE, reset_accelerate
from test_export import HAS_ONNX, ONNX_MARKS

from accel_train.cli import main as cli
from accel_train.deploy import Sample, export_model_artifacts, export_run
from accel_train.deploy.decoding import verify_generation
from accel_train.errors import ExportError

pytestmark = pytest.mark.usefixtures("one_thread")
QUIET = ["--report_to", "none", "--disable_tqdm", "--no_preflight", "--run_report", "false", "--cpu_threads", "1"]
INPUTS = {"encoder": ["input_ids", "attention_mask"],
          "decoder": ["decoder_input_ids", "encoder_hidden_states", "encoder_attention_mask"],
          "decoder_with_past": ["decoder_input_ids", "encoder_hidden_states", "encoder_attention_mask",
                                *[f"past_key_values.0.{side}.{kind}" for side in ("decoder", "encoder")
                                  for kind in ("key", "value")]]}
LOADERS = {
    "torchscript": lambda path: torch.jit.load(str(path)),
    "exported_program": lambda path: torch.export.load(str(path)).module(),
}


def tiny_seq2seq(family: str):
    from transformers import (
        BertConfig,
        EncoderDecoderConfig,
        EncoderDecoderModel,
        T5Config,
        T5ForConditionalGeneration,
    )

    torch.manual_seed(0)
    if family == "t5":
        return T5ForConditionalGeneration(T5Config(
            vocab_size=60, d_model=32, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=2, d_kv=16,
            decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)).eval()
    sizes = dict(vocab_size=60, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                 max_position_embeddings=64)
    config = EncoderDecoderConfig.from_encoder_decoder_configs(
        BertConfig(**sizes), BertConfig(**sizes, is_decoder=True, add_cross_attention=True))
    config.decoder_start_token_id, config.eos_token_id, config.pad_token_id = 2, 3, 0
    model = EncoderDecoderModel(config).eval()
    model.generation_config.decoder_start_token_id = 2
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 3, 0
    return model


def source_rows() -> Sample:
    """8 sources of 2..7 tokens, right-padded."""
    ids = torch.randint(5, 60, (8, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for row, length in enumerate([7, 5, 6, 3, 7, 4, 2, 6]):
        mask[row, length:] = 0
        ids[row, length:] = 0
    return Sample({"input_ids": ids, "attention_mask": mask}, "test rows")


def artifact(fmt, folder, name, input_names):
    """run({input name: tensor}) -> [outputs], loaded as a serving stack loads it (ONNX: by input name)."""
    if fmt == "onnx":
        import onnxruntime

        session = onnxruntime.InferenceSession(str(folder / f"{name}.onnx"), providers=["CPUExecutionProvider"])
        used = {i.name for i in session.get_inputs()}
        return lambda feed: [torch.from_numpy(out) for out in session.run(
            None, {k: v.numpy() for k, v in feed.items() if k in used})]
    module = LOADERS[fmt](folder / f"{name}{'.pt' if fmt == 'torchscript' else '.pt2'}")
    return lambda feed: list(module(*[feed[n] for n in input_names]))


def decode_with_cache(fmt, folder, input_ids, attention_mask, start, eos, steps):
    """The user's loop, written apart from the library's from export.json's names: the encoder once, the decoder
    on the start token, then the decoder with past on each chosen token and the presents so far."""
    meta = json.loads((folder / "export.json").read_text())
    names = {a["name"]: ([i["name"] for i in a["inputs"]], a["outputs"]) for a in meta["artifacts"]}
    run = {name: artifact(fmt, folder, name, inputs) for name, (inputs, _) in names.items()}
    (hidden,) = run["encoder"]({"input_ids": input_ids, "attention_mask": attention_mask})
    tokens = torch.full((input_ids.shape[0], 1), start)
    source = {"encoder_hidden_states": hidden, "encoder_attention_mask": attention_mask}
    out = dict(zip(names["decoder"][1], run["decoder"]({"decoder_input_ids": tokens, **source}), strict=True))
    past = {}
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
    for step in range(steps):
        if step:
            feed = {"decoder_input_ids": tokens[:, -1:], **source, **past}
            out = dict(zip(names["decoder_with_past"][1], run["decoder_with_past"](feed), strict=True))
        past.update({k.replace("present", "past_key_values"): v for k, v in out.items() if k != "logits"})
        chosen = out["logits"][:, -1].argmax(-1)
        chosen[done] = 0  # the pad token of both tiny models
        tokens = torch.cat([tokens, chosen[:, None]], 1)
        done |= chosen == eos
        if done.all():
            break
    return tokens, hidden


# One model per format, both structures on the cheapest: T5 (relative position bias, a decoder with its own
# embedding) in every format, BERT2BERT (EncoderDecoderModel's cross-attention wrapper) in TorchScript here; its
# exported_program and ONNX artifacts are exported and decoded against generate() from run directories below
# (test_a_resumed_bf16_warm_started_run_exports..., and the recipe's MiniLM default, slow).
CASES = [pytest.param("bert2bert", "torchscript", id="bert2bert-torchscript"),
         pytest.param("t5", "torchscript", id="t5-torchscript"),
         pytest.param("t5", "exported_program", id="t5-exported_program"),
         pytest.param("t5", "onnx", marks=ONNX_MARKS, id="t5-onnx")]


@pytest.mark.parametrize(("family", "fmt"), CASES)
def test_an_encoder_decoder_exports_artifacts_whose_greedy_loops_give_generates_tokens(family, fmt, tmp_path):
    model = tiny_seq2seq(family)
    sample = source_rows()
    results = export_model_artifacts(model, fmt, tmp_path, sample)
    assert [r.name for r in results] == ["encoder", "decoder", "decoder_with_past"]
    assert all(r.verified and r.max_abs_diff <= 1e-4 for r in results), [r.summary() for r in results]
    meta = json.loads((tmp_path / "export.json").read_text())
    source = ["encoder_hidden_states", "encoder_attention_mask"]
    past = [f"past_key_values.0.{side}.{kind}" for side in ("decoder", "encoder") for kind in ("key", "value")]
    assert [[i["name"] for i in a["inputs"]] for a in meta["artifacts"]] == [
        ["input_ids", "attention_mask"], ["decoder_input_ids", *source], ["decoder_input_ids", *source, *past]]
    assert [a["outputs"] for a in meta["artifacts"]] == [
        ["encoder_hidden_states"], ["logits", *[n.replace("past_key_values", "present") for n in past]],
        ["logits", "present.0.decoder.key", "present.0.decoder.value"]]
    axes = {i["name"]: i["dynamic_axes"] for a in meta["artifacts"][1:] for i in a["inputs"]}
    assert axes == {"decoder_input_ids": {"0": "batch"},
                    "encoder_hidden_states": {"0": "batch", "1": "encoder_sequence"},
                    "encoder_attention_mask": {"0": "batch", "1": "encoder_sequence"},
                    past[0]: {"0": "batch", "2": "past_sequence"}, past[1]: {"0": "batch", "2": "past_sequence"},
                    past[2]: {"0": "batch", "2": "encoder_sequence"}, past[3]: {"0": "batch", "2": "encoder_sequence"}}
    assert meta["artifacts"][1]["inputs"][0]["dynamic_axes"] == {"0": "batch", "1": "decoder_sequence"}
    # the checks include the first decoding step (a prefix of one token) and the first step on the cache (past of 1)
    assert any("decoder prefix of 1" in c["inputs"] for c in meta["artifacts"][1]["checks"])
    assert any("past of 1" in c["inputs"] for c in meta["artifacts"][2]["checks"])
    check = meta["generation_check"]
    assert check["tokens_equal"] and check["items"] == 8 and check["max_new_tokens"] == 16
    assert check["loops"] == ["decoder", "decoder_with_past"]
    start, eos = model.generation_config.decoder_start_token_id, model.generation_config.eos_token_id
    ids, mask = sample.tensors["input_ids"], sample.tensors["attention_mask"]
    with torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, num_beams=1, max_new_tokens=16)
        got, hidden = decode_with_cache(fmt, tmp_path, ids, mask, start, eos, 16)
    assert got.shape[1] > 2 and torch.equal(got, expected)
    assert (hidden[mask == 0] == 0).all() and (hidden[mask == 1] != 0).any()  # padding rows: zeros, nothing reads them
    assert check["generated_tokens"] == expected.shape[1] - 1
    if fmt != "onnx":  # the decoders carry the decoder's weights, not the encoder's a second time
        for result in results[1:]:
            decoder = LOADERS[fmt](result.path)
            names = [n for n, _ in decoder.named_parameters()] + [n for n, _ in decoder.named_buffers()]
            assert names and not any(".encoder." in f".{n}" and "decoder" not in n for n in names), names


def test_a_decoding_loop_that_differs_from_generate_is_an_error_naming_the_row_and_step(tmp_path):
    """The artifacts of one model checked against another model's generate(): the tokens differ, and the export
    says where instead of passing on the per-artifact checks alone."""
    model = tiny_seq2seq("bert2bert")
    sample = source_rows()
    results = export_model_artifacts(model, "torchscript", tmp_path, sample)
    other = tiny_seq2seq("bert2bert")
    with torch.no_grad():
        for parameter in other.decoder.parameters():
            parameter.add_(torch.randn_like(parameter))
    with pytest.raises(ExportError, match=r"encoder and decoder gives other tokens than the model's generate\(\) on "
                                          r"example row \d+ \(of 8\), from new token \d+"):
        verify_generation("torchscript", {r.name: r.path for r in results}, INPUTS, other, sample)


def warm_start_argv(out, tiny_bert, pairs, *extra):
    return ["--encoder_decoder_from", str(tiny_bert), "--decoder_layers", "1", "--train_file", str(pairs),
            "--text_column", "text", "--summary_column", "summary", "--validation_split", "8", "--max_source_length",
            "16", "--max_target_length", "8", "--output_dir", str(out), "--max_generate_samples", "2",
            "--generation_max_new_tokens", "4", "--mixed_precision", "bf16", "--per_device_train_batch_size", "8",
            *QUIET, *extra]


def warm_start_run(out, tiny_bert, pairs, *extra):
    reset_accelerate()
    text_generation.main(warm_start_argv(out, tiny_bert, pairs, *extra))
    reset_accelerate()


def write_pairs(folder):
    words = [*POSITIVE, *NEGATIVE, *FILLER]
    pairs = folder / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"text": " ".join(words[i % len(words):][:6]), "summary": words[i % 9]})
                             + "\n" for i in range(32)))
    return pairs


def test_a_resumed_bf16_warm_started_run_exports_at_the_end_and_afterwards(tmp_path, tiny_bert):
    """The recipe's default kind of model (an encoder-decoder warm-started from a BERT, here a tiny one): trained
    in bf16, cut after step 1 and resumed; `--export_formats` at the end and `accel-train export` of the run
    directory and of its checkpoint each give two verified artifacts whose decoding matches generate()."""
    pairs = write_pairs(tmp_path)
    out = tmp_path / "run"
    saving = ["--save_strategy", "steps", "--save_steps", "1"]
    warm_start_run(out, tiny_bert, pairs, *saving, "--max_steps", "1")
    warm_start_run(out, tiny_bert, pairs, *saving, "--max_steps", "2", "--resume_from_checkpoint", "latest",
                   "--export_formats", "torchscript")
    assert json.loads((out / "all_results.json").read_text())["train_steps"] == 2
    at_end = json.loads((out / "export" / "torchscript" / "export.json").read_text())
    assert [a["name"] for a in at_end["artifacts"]] == ["encoder", "decoder", "decoder_with_past"]
    assert at_end["generation_check"]["tokens_equal"] and at_end["example_inputs"] == "the run's evaluation data"
    later = export_run(out, "exported_program", tmp_path / "later")
    checkpoint = sorted((out / "checkpoints").glob("step-*"))[-1]
    from_checkpoint = export_run(checkpoint, "torchscript", tmp_path / "from_checkpoint")
    for folder, results in ((tmp_path / "later", later), (tmp_path / "from_checkpoint", from_checkpoint)):
        assert all(r.verified for r in results)
        assert [r.name for r in results] == ["encoder", "decoder", "decoder_with_past"]
        meta = json.loads((folder / "export.json").read_text())
        assert meta["generation_check"]["tokens_equal"] and meta["generation_check"]["items"] == 8
        # fp32 artifacts from a bf16 run: the master weights are fp32, autocast was the run's precision
        assert {i["dtype"] for i in meta["artifacts"][1]["inputs"]} == {"int64", "float32"}


def test_a_warm_started_run_on_two_processes_exports_at_the_end_and_afterwards(tmp_path, tiny_bert, ranks):
    """The same kind of run on the session's 2 spawned gloo ranks: the main process exports at the end while the other
    waits, and the saved run directory exports afterwards; both decode as generate() does."""
    pairs = write_pairs(tmp_path)
    out = tmp_path / "ddp"
    ranks.run(text_generation.main, warm_start_argv(out, tiny_bert, pairs, "--max_steps", "2", "--save_strategy",
                                                    "no", "--export_formats", "torchscript"))
    at_end = json.loads((out / "export" / "torchscript" / "export.json").read_text())
    assert at_end["generation_check"]["tokens_equal"]
    results = export_run(out, "torchscript", tmp_path / "later")
    assert [r.name for r in results] == ["encoder", "decoder", "decoder_with_past"] and all(r.verified for r in results)
    assert json.loads((tmp_path / "later" / "export.json").read_text())["generation_check"]["tokens_equal"]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_ONNX, reason="pip install 'accel_train[deploy]'")
def test_the_no_flag_text_generation_run_directory_exports_to_onnx_and_decodes_as_generate(tmp_path):
    """The recipe with no model or data flag (the encoder-decoder warm-started from all-MiniLM-L6-v2, on the demo's
    dates), two steps, then `accel-train export RUN_DIR --format onnx`. On main before issue 40 item 10 this
    failed inside transformers ("You must specify exactly one of input_ids or inputs_embeds")."""
    out = tmp_path / "run"
    reset_accelerate()
    text_generation.main(["--output_dir", str(out), *QUIET, "--max_steps", "2", "--max_train_samples", "64",
                          "--max_eval_samples", "8", "--max_generate_samples", "4", "--eval_strategy", "no",
                          "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8"])
    reset_accelerate()
    assert cli(["export", str(out), "--format", "onnx"]) == 0
    meta = json.loads((out / "export" / "onnx" / "export.json").read_text())
    assert [a["name"] for a in meta["artifacts"]] == ["encoder", "decoder", "decoder_with_past"]
    assert all(a["verified"] and a["max_abs_diff"] <= 1e-4 for a in meta["artifacts"])
    # the encoder's output at padding positions is zero: ONNX Runtime differed there by 9e-5 (the tolerance is 1e-4)
    assert meta["artifacts"][0]["max_abs_diff"] <= 2e-5
    check = meta["generation_check"]
    assert check["tokens_equal"] and check["items"] == 8 and check["decoder_start_token_id"] == 101
