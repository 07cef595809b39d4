"""Chunked cross-entropy in recipes/text_generation.py: the first-batch probe gives one answer whether the pre-flight
check runs (it calls the loss first, under accelerator.autocast(), in evaluation mode) or not (the loop calls it
first, outside autocast, in training mode) — for a bf16 Llama and for a GPT-2 with dropout — and that answer does not
change the run."""

from __future__ import annotations

import json

import pytest
import text_generation
from conftest import read_jsonl, reset_accelerate

from accel_train.tasks.text.generation.demo import date_pairs

pytestmark = pytest.mark.usefixtures("one_thread")
LLAMA = ["--model_type", "llama", "--train_tokenizer_vocab_size", "300", "--config_overrides",
         "hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2,"
         "max_position_embeddings=512"]
# GPT-2 keeps its default dropout (0.1): the probe, run by the loop in training mode, drew two dropout masks
GPT2 = ["--model_type", "gpt2", "--train_tokenizer_vocab_size", "300", "--config_overrides",
        "n_embd=32,n_layer=2,n_head=2"]
QUIET = ["--report_to", "none", "--disable_tqdm", "--cpu_threads", "1", "--save_strategy", "no", "--no_run_report"]


@pytest.mark.parametrize("model, precision, seeds", [(LLAMA, "bf16", (0, 1, 2)), (GPT2, "no", (0,))],
                         ids=["llama-bf16", "gpt2-dropout-fp32"])
def test_chunks_train_the_same_with_and_without_the_preflight(tmp_path, capsys, model, precision, seeds):
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in date_pairs(40, 1)["text"]))
    for seed in seeds:
        runs = {}
        for name, preflight in (("preflight", []), ("no_preflight", ["--no_preflight"])):
            reset_accelerate()
            out = tmp_path / f"{name}_{seed}"
            metrics = text_generation.main([
                "--train_file", str(texts), "--text_column", "text", "--block_size", "16", "--validation_split", "0.3",
                *model, *QUIET, *preflight, "--mixed_precision", precision, "--loss_chunk_size", "8",
                "--seed", str(seed), "--max_steps", "3", "--logging_steps", "1", "--per_device_train_batch_size", "4",
                "--output_dir", str(out)])
            assert "loss: chunked cross-entropy, 8 tokens a chunk" in capsys.readouterr().out
            runs[name] = ([r["loss"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r], metrics["eval_loss"])
        losses, eval_loss = runs["preflight"]
        assert len(losses) == 3
        assert runs["no_preflight"] == (losses, eval_loss), seed  # the same run, to the bit
