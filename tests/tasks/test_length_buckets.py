"""--length_buckets (accel_train/tasks/text/buckets.py): each batch padded to the smallest of a few widths. Exact with
the loss contract (a bucketed batch has the unbucketed batch's loss and gradients), with accumulation over
micro-batches of different widths, with resume (bitwise) and on 2 processes (each rank pads to its own bucket);
refused with --packing / --padding_free / --pad_to_max_length; and what it is for: with --torch_compile the graphs
compiled stay at the buckets used, where static shapes without buckets compile one per length
(train_compiled_graphs in all_results.json). Everything runs in this process (the 2-process case on the session's
gloo ranks); compiling uses the eager backend: dynamo traces and counts graphs as with inductor, without kernels."""

import json

import pytest
import token_train
import torch
from conftest import FILLER, reset_accelerate, step_gradient, token_gradient_error, token_main
from conftest import nlp_main as run_nlp
from safetensors.torch import load_file
from transformers import BertConfig, BertForSequenceClassification, DataCollatorWithPadding

from accel_train import TrainConfig
from accel_train.core.loss import default_loss
from accel_train.errors import ConfigError, DataError
from accel_train.tasks.text.buckets import BucketedPadding, resolve_buckets
from accel_train.tasks.text.classification import ClassificationDataArguments
from accel_train.tasks.text.generation import GenerationDataArguments, TrainCollator

pytestmark = pytest.mark.usefixtures("one_thread")
BUCKETS = "16,32,40"  # token_train's sequences have 3 to 40 tokens
COMPILE = ["--torch_compile", "--torch_compile_backend", "eager"]
ONE_SGD_STEP = ["--optim", "sgd", "--sgd_momentum", "0", "--learning_rate", "1", "--max_grad_norm", "0",
                "--max_steps", "1", "--lr_scheduler_type", "constant", "--weight_decay", "0",
                "--eval_strategy", "no"]  # as tests/core/test_token_loss.py: the step moves by minus the gradient


def results_of(out):
    return json.loads((out / "all_results.json").read_text())


def run_tokens(out, *args):
    reset_accelerate()
    return token_train.main(["--output_dir", str(out), "--save_initial", "true", *args])


def widths(spec: str, micro: int, rows=None) -> list[int]:
    """The width of each training micro-batch token_train feeds (its sequences in order)."""
    rows = rows or token_train.sequences(16, 0)
    collate = token_train.bucketed(spec) if spec else token_train.collate()
    return [collate(rows[i:i + micro])["input_ids"].shape[1] for i in range(0, len(rows), micro)]


def test_auto_and_given_buckets():
    assert resolve_buckets("auto", 128, None).widths == (16, 24, 32, 48, 64, 96, 128)
    assert resolve_buckets("auto", 100, 8).widths == (16, 24, 32, 48, 64, 96, 104)  # the longest, to the multiple
    assert resolve_buckets("auto", 4096, 8).widths == (384, 512, 768, 1024, 1536, 2048, 3072, 4096)  # 8 at most
    assert resolve_buckets("auto", 10, None).widths == (10,)
    assert resolve_buckets("20,40", 40, 8).widths == (24, 40)
    assert resolve_buckets(None, 40, None) is None
    assert resolve_buckets("16,32", 20, None).width(17) == 32
    with pytest.raises(ConfigError, match="cannot hold the longest row"):
        resolve_buckets("16,32", 40, None)
    with pytest.raises(ConfigError, match="increasing"):
        resolve_buckets("32,16", 16, None)
    with pytest.raises(ConfigError, match="at most 8"):
        resolve_buckets(",".join(str(8 * k) for k in range(1, 10)), 64, None)
    with pytest.raises(ConfigError, match="comma"):
        resolve_buckets("32;64", 64, None)
    with pytest.raises(DataError, match="longer than the largest"):
        resolve_buckets("16", 16, None).width(17)


def test_refused_where_it_does_not_apply():
    with pytest.raises(ConfigError, match="--packing fills rows"):
        GenerationDataArguments(packing=True, length_buckets="auto")
    with pytest.raises(ConfigError, match="--padding_free writes each micro-batch as one row"):
        GenerationDataArguments(padding_free=True, length_buckets="auto")
    with pytest.raises(ConfigError, match="--pad_to_max_length"):
        ClassificationDataArguments(pad_to_max_length=True, length_buckets="auto")
    with pytest.raises(ConfigError, match="--torch_compile_backend='tvm': choose one of inductor"):
        TrainConfig(output_dir="unused", torch_compile_backend="tvm")


def loss_and_grads(model, batch, loss_fn=None):
    model.zero_grad()
    if loss_fn:  # per-sequence token sums and counts: the token mean of the batch
        out = loss_fn(model, batch)
        loss = out["loss_sum"].sum() / out["num_items"].sum()
    else:
        loss = model(**batch).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(a, b, tol=1e-6):
    assert a[0] == pytest.approx(b[0], abs=tol)
    assert a[1].keys() == b[1].keys()
    assert max((a[1][n] - b[1][n]).abs().max().item() for n in a[1]) < tol


def test_a_bucketed_batch_has_the_loss_and_gradients_of_the_unbucketed_one(tiny_bert):
    """Classification (tiny BERT, transformers' padding to the bucket) and a token loss (tiny GPT-2, the
    text_generation recipe's TrainCollator, the default token-sum loss): the same loss and gradients."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    features = [dict(tokenizer(" ".join(FILLER[:n])), labels=n % 2) for n in (3, 9, 14)]
    torch.manual_seed(0)
    bert = BertForSequenceClassification(BertConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=32,
                                                    max_position_embeddings=64, hidden_dropout_prob=0.0,
                                                    attention_probs_dropout_prob=0.0))
    plain = DataCollatorWithPadding(tokenizer)(features)
    bucketed = BucketedPadding(tokenizer, resolve_buckets("8,32,64", 64, None))(features)
    assert plain["input_ids"].shape[1] == 16 and bucketed["input_ids"].shape[1] == 32
    assert_same(loss_and_grads(bert, plain), loss_and_grads(bert, bucketed))

    rows = [{"input_ids": r, "labels": r} for r in token_train.sequences(4, 3)]
    plain = TrainCollator(0)(rows)
    bucketed = TrainCollator(0, None, resolve_buckets("64", 64, None))(rows)
    assert plain["input_ids"].shape[1] < 64 == bucketed["input_ids"].shape[1]
    assert (bucketed["labels"][:, plain["labels"].shape[1]:] == -100).all()
    lm = token_train.tiny_lm()
    assert_same(loss_and_grads(lm, plain, default_loss()), loss_and_grads(lm, bucketed, default_loss()))


def test_accumulation_over_micro_batches_of_different_buckets_is_the_window_token_mean(tmp_path):
    """One SGD step of 4 micro-batches x 4 padded to different buckets: the token-mean gradient of all 16."""
    assert len(set(widths(BUCKETS, 4))) > 1
    run_tokens(tmp_path, *ONE_SGD_STEP, "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4",
               "--length_buckets", BUCKETS)
    assert token_gradient_error(step_gradient(tmp_path)) < 1e-6


def test_two_processes_each_padding_to_its_own_bucket_give_the_step_gradient(tmp_path, ranks):
    """2 processes on the session's gloo ranks: micro-batches of 4, 2 per process per step (rank 0 and rank 1 get
    different rows, so different buckets); the step is the token mean of all 16."""
    first = widths(BUCKETS, 4)[:2]  # the first micro-batch of rank 0 and of rank 1
    assert first[0] != first[1]
    args = [*ONE_SGD_STEP, "--save_initial", "true", "--per_device_train_batch_size", "4",
            "--gradient_accumulation_steps", "2", "--length_buckets", BUCKETS]
    ranks.run(token_main, [*args, "--output_dir", str(tmp_path / "two")])
    assert token_gradient_error(step_gradient(tmp_path / "two")) < 1e-6


def test_resume_is_bitwise_with_buckets(tmp_path):
    common = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_steps", "6",
              "--learning_rate", "0.01", "--num_sequences", "24", "--eval_strategy", "no", "--save_strategy", "steps",
              "--save_steps", "1", "--length_buckets", BUCKETS]
    run_tokens(tmp_path / "full", *common)
    run_tokens(tmp_path / "cut", *common, "--stop_at_step", "3")
    run_tokens(tmp_path / "cut", *common, "--resume_from_checkpoint", "latest")
    full, cut = load_file(tmp_path / "full" / "model.safetensors"), load_file(tmp_path / "cut" / "model.safetensors")
    assert all(torch.equal(full[n], cut[n]) for n in full)


@pytest.mark.slow
def test_compiled_graphs_stay_at_the_buckets_used(tmp_path):
    """5 optimizer steps of 2 sequences (3 to 40 tokens), no evaluation, torch.compile with static shapes: with
    buckets one graph per bucket used; without, one per distinct length (what buckets prevent); with automatic
    dynamic shapes (torch.compile's default, no buckets) at most a static graph and then one dynamic-shape graph.
    Before the fix in core/meter.py the FLOP count of the first micro-batch made dynamo skip the model for good:
    every count was 0 (the pre-flight check's graphs were all that ever ran compiled)."""
    common = [*COMPILE, "--per_device_train_batch_size", "2", "--max_steps", "5", "--num_sequences", "10",
              "--eval_strategy", "no", "--evaluate", "false", "--learning_rate", "0.01"]
    counts = {}
    for name, flags in (("buckets", ["--length_buckets", BUCKETS]), ("static", ["--static_shapes", "true"]),
                        ("dynamic", [])):
        torch._dynamo.reset()  # one run per process, as a user's: graphs cached by the run before would be reused
        run_tokens(tmp_path / name, *common, *flags)
        counts[name] = json.loads((tmp_path / name / "all_results.json").read_text())["train_compiled_graphs"]
    rows = token_train.sequences(10, 0)
    # the first micro-batch runs uncompiled (the MFU's FLOP count: core/meter.py), the others compiled
    used, lengths = len(set(widths(BUCKETS, 2, rows)[1:])), len(set(widths("", 2, rows)[1:]))
    assert lengths > used >= 2
    assert counts["buckets"] == used and counts["static"] == lengths and 1 <= counts["dynamic"] <= 2, counts


@pytest.mark.slow
def test_the_nlp_recipe_reports_buckets_padding_and_compiled_graphs(tiny_bert, tmp_path, capsys):
    """recipes/nlp_finetune.py in this process: rows of 3 to 30 words, --length_buckets auto (16,24,32 for
    --max_seq_length 32), compiled: the padding share with buckets and the graphs compiled (training and
    evaluation in eval mode: at most one per bucket each) in all_results.json."""
    import random

    torch._dynamo.reset()
    rng = random.Random(5)
    lines = [f"{i % 2} {' '.join(rng.choices(FILLER, k=rng.randint(1, 28)))}\n" for i in range(64)]
    (tmp_path / "train.txt").write_text("".join(lines))
    out = tmp_path / "run"
    run_nlp(["--model_name_or_path", str(tiny_bert), "--train_file", str(tmp_path / "train.txt"), "--output_dir",
             str(out), "--report_to", "none", "--disable_tqdm", "--num_train_epochs", "1",
             "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8", "--max_seq_length", "32",
             "--save_strategy", "no", "--load_best_model_at_end", "false", "--length_buckets", "auto", *COMPILE])
    printed = capsys.readouterr().out
    assert "batches, padded to the length buckets 16,24,32)" in printed
    assert "compile eager (default, static shapes)" in printed  # the start-up report's speed line
    assert f"torch.compile: {results_of(out)['train_compiled_graphs']} graph(s) compiled" in printed
    results = json.loads((out / "all_results.json").read_text())
    assert 1 <= results["train_compiled_graphs"] <= 2 * 3
    assert 0 < results["train_padding_ratio"] < 1


@pytest.mark.slow
def test_the_text_generation_recipe_pads_to_buckets_and_reports_compiled_graphs(tmp_path, capsys):
    """recipes/text_generation.py in this process: a tiny Llama from a config on date pairs (source 24 + target 12
    tokens at most: auto gives 16,24,32,36), compiled with the eager backend, no generation."""
    import text_generation

    from accel_train.tasks.text.generation.demo import date_pairs

    torch._dynamo.reset()
    pairs = date_pairs(48, 1)
    data = tmp_path / "dates.jsonl"
    data.write_text("".join(json.dumps({"text": t, "summary": s}) + "\n"
                            for t, s in zip(pairs["text"], pairs["summary"], strict=True)))
    reset_accelerate()
    text_generation.main([
        "--train_file", str(data), "--text_column", "text", "--summary_column", "summary", "--validation_split", "8",
        "--model_type", "llama", "--train_tokenizer_vocab_size", "300", "--config_overrides",
        "hidden_size=32,intermediate_size=64,num_hidden_layers=1,num_attention_heads=2,num_key_value_heads=2,"
        "max_position_embeddings=128", "--output_dir", str(tmp_path / "run"), "--report_to", "none",
        "--disable_tqdm", "--no_run_report", "--max_generate_samples", "0", "--per_device_train_batch_size", "4",
        "--num_train_epochs", "1", "--save_strategy", "no", "--max_source_length", "24", "--max_target_length", "12",
        "--length_buckets", "auto", *COMPILE])
    assert "length buckets: each batch padded to the smallest of 16,24,32,36 tokens" in capsys.readouterr().out
    results = json.loads((tmp_path / "run" / "all_results.json").read_text())
    assert 1 <= results["train_compiled_graphs"] <= 2 * 4  # a graph per width at most, in training and evaluation
