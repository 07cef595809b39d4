"""Every recipe's run directory exports: `accel-train export RUN_DIR` rebuilds the model from what the run saved
(config.json, or the model_factory.json that train() records for a model that describes itself), exports it in
each format and verifies it against the model. nlp_finetune, image_classification and the contrastive towers are
in test_export.py; here the detector, the segmenter (with their preprocessing saved beside the model), the fusion
model (its two towers and its ITM scorer) and a causal LM of text_generation; its encoder-decoders (encoder and
decoder artifacts, decoded against generate()) in test_export_seq2seq.py. An unmerged LoRA adapter is refused before
training (test_text_generation.py)."""

import json

import multimodal_fusion
import object_detection
import pytest
import semantic_segmentation
import text_generation
import torch
from conftest import CAPTION_WORDS, TINY_FUSION, TINY_VISION, caption_folder, reset_accelerate, text_tower_config
from test_export import FORMAT_CASES

from accel_train.deploy import export_run, load_trained_model

pytestmark = pytest.mark.usefixtures("one_thread")
QUIET = ["--report_to", "none", "--disable_tqdm", "--save_strategy", "no", "--no_preflight", "--run_report", "false",
         "--cpu_threads", "1"]
DENSE = ["--num_train_canvases", "16", "--num_test_canvases", "4", "--max_steps", "1",
         "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "4"]
# what each run directory exports: artifact names and their outputs
EXPECTED = {
    "object_detection": [("model", ["heatmap", "box"])],
    "semantic_segmentation": [("model", ["output"])],
    "multimodal_fusion": [("text_tower", ["text_embeds"]), ("vision_tower", ["image_embeds"]),
                          ("itm_scorer", ["itm_logits"])],
    "text_generation": [("model", ["logits"])],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from transformers import BertModel, BertTokenizer

    root = tmp_path_factory.mktemp("runs")
    text = root / "tiny_text"
    BertTokenizer(vocab={t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *CAPTION_WORDS])}
                  ).save_pretrained(text)
    torch.manual_seed(0)
    BertModel(text_tower_config()).save_pretrained(text)
    pairs = root / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"text": f"item {i} of the list", "summary": f"answer {i}"}) + "\n"
                             for i in range(24)))
    out = {name: root / name for name in EXPECTED}
    reset_accelerate()
    object_detection.main(["--output_dir", str(out["object_detection"]), *QUIET, *DENSE, "--config_overrides",
                           '{"widths": [8, 16, 16], "blocks_per_stage": 1, "head_width": 8}'])
    reset_accelerate()
    semantic_segmentation.main(["--output_dir", str(out["semantic_segmentation"]), *QUIET, *DENSE,
                                "--config_overrides", '{"widths": [8, 16, 16], "blocks_per_stage": 1}'])
    reset_accelerate()
    multimodal_fusion.main(["--data_dir", str(caption_folder(root / "captions", {"train": 4, "test": 2})),
                            "--output_dir", str(out["multimodal_fusion"]), "--text_model_name_or_path", str(text),
                            *QUIET, *TINY_FUSION, *TINY_VISION, "--max_steps", "1", "--per_device_train_batch_size",
                            "6"])
    reset_accelerate()
    text_generation.main(["--train_file", str(pairs), "--text_column", "text", "--summary_column", "summary",
                          "--validation_split", "4", "--model_type", "llama", "--train_tokenizer_vocab_size", "200",
                          "--config_overrides", "hidden_size=32,intermediate_size=64,num_hidden_layers=1,"
                          "num_attention_heads=2,num_key_value_heads=2,max_position_embeddings=128",
                          "--max_source_length", "32", "--max_target_length", "8", *QUIET, "--output_dir",
                          str(out["text_generation"]), "--max_steps", "1",
                          "--max_generate_samples", "2", "--generation_max_new_tokens", "2"])
    reset_accelerate()
    return out


@pytest.mark.parametrize("fmt", FORMAT_CASES)
@pytest.mark.parametrize("recipe", list(EXPECTED))
def test_every_recipes_run_directory_exports_and_verifies(recipe, fmt, runs, tmp_path):
    results = export_run(runs[recipe], fmt, tmp_path / fmt)
    assert [r.name for r in results] == [name for name, _ in EXPECTED[recipe]]
    assert all(r.verified and r.max_abs_diff <= 1e-4 for r in results), [r.summary() for r in results]
    meta = json.loads((tmp_path / fmt / "export.json").read_text())
    assert [a["outputs"] for a in meta["artifacts"]] == [outputs for _, outputs in EXPECTED[recipe]]


@pytest.mark.parametrize("recipe", ["object_detection", "semantic_segmentation"])
def test_a_dense_models_preprocessing_is_saved_beside_it(recipe, runs):
    processor = json.loads((runs[recipe] / "preprocessor_config.json").read_text())
    trained = load_trained_model(runs[recipe])
    assert trained.image_size == 64 and len(processor["image_mean"]) == 3 and len(processor["image_std"]) == 3
    assert 0 < min(processor["image_std"]) and processor["rescale_factor"] == pytest.approx(1 / 255)
    factory = json.loads((runs[recipe] / "model_factory.json").read_text())
    assert factory["factory"].endswith(":CenterNet" if recipe == "object_detection" else ":UNet")
