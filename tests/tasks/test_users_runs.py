"""Users coming from the Hugging Face scripts and the Trainer, through real runs: the NLP recipe on a
tiny BERT / GPT-2 built offline, small runs of the public API, and the run directory they leave. Runs are in this
process; 2 processes are the session's spawned gloo ranks (conftest's `ranks`); a log file's order is a process's."""

import json
import subprocess
import sys

import nlp_finetune
import pandas as pd
import pytest
import torch
from conftest import (
    FILLER,
    NEGATIVE,
    POSITIVE,
    SCRIPTS,
    make_rows,
    read_jsonl,
    reset_accelerate,
    subprocess_env,
    toy_on,
    toy_records,
)
from conftest import (
    nlp_main as nlp,
)

from accel_train import DataError, TrainConfig, build_accelerator, make_loader, run_cli, train
from accel_train.observe.report import write_report
from accel_train.tasks.text.classification import ClassificationDataArguments

pytestmark = pytest.mark.usefixtures("one_thread")
FAST = ["--report_to", "none", "--disable_tqdm", "--num_train_epochs", "2", "--learning_rate", "3e-3",
        "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8", "--warmup_steps", "0",
        "--max_seq_length", "32"]


def results(out):
    return json.loads((out / "all_results.json").read_text())


def lines(path, rows):
    path.write_text("".join(f"{y} {t}\n" for y, t in rows))
    return str(path)


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory):
    """A 2-layer GPT-2 and a word-level tokenizer with an end-of-sequence token but no padding token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2Config, GPT2ForSequenceClassification, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny_gpt2")
    words = ["<|endoftext|>", "[UNK]", *sorted(set(POSITIVE + NEGATIVE + FILLER))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                            unk_token="[UNK]").save_pretrained(path)
    torch.manual_seed(0)
    GPT2ForSequenceClassification(GPT2Config(vocab_size=len(words), n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                             bos_token_id=0, eos_token_id=0)).save_pretrained(path)
    return path


# ------------------------------------------------------------------------------------------ wrong or crashing


def test_regression_chooses_mse_lower_is_better_and_keeps_the_best(tiny_bert, tmp_path):
    rows = make_rows(64, 4)
    pd.DataFrame({"text": [t for _, t in rows], "score": [0.9 if y else 0.1 for y, _ in rows]}).to_csv(
        tmp_path / "train.csv", index=False)
    out = tmp_path / "run"
    # a regression run picks eval_mse as its best metric by itself (eval_accuracy does not exist there)
    nlp(["--model_name_or_path", str(tiny_bert), "--train_file", str(tmp_path / "train.csv"), "--label_column_name",
         "score", "--output_dir", str(out), *FAST, "--num_train_epochs", "4"])
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if "eval_mse" in r and not r.get("final")]
    state = json.loads(next((out / "checkpoints").glob("step-*/train_state.json")).read_text())
    assert (state["best_metric_name"], state["best_greater"]) == ("eval_mse", False)
    best = min(evals, key=lambda r: r["eval_mse"])
    assert state["best_metric"] == pytest.approx(best["eval_mse"]) and f"{best['step']:08d}" in state["best_checkpoint"]
    assert results(out)["eval_mse"] == pytest.approx(best["eval_mse"], abs=1e-6)  # the best one, restored


def test_a_decoder_without_a_padding_token_pads_with_eos(tiny_gpt2, sst_like, tmp_path):
    out = tmp_path / "run"
    nlp(["--model_name_or_path", str(tiny_gpt2), "--train_file", str(sst_like["train"]), "--validation_file",
         str(sst_like["dev"]), "--output_dir", str(out), *FAST])
    config = json.loads((out / "config.json").read_text())
    assert config["pad_token_id"] == 0 and results(out)["eval_samples"] == 40
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out).pad_token == "<|endoftext|>"


def test_nan_is_written_as_null_and_a_one_class_evaluation_is_warned_about(tmp_path, capsys):
    config = TrainConfig(output_dir=str(tmp_path / "run"), num_train_epochs=1, per_device_train_batch_size=8,
                         report_to=["none"], disable_tqdm=True, save_strategy="no")
    accelerator = build_accelerator(config)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    train_set = [{"x": x[i], "labels": torch.tensor(i % 2)} for i in range(64)]
    val_set = [{"x": x[i], "labels": torch.tensor(0)} for i in range(16)]  # one class, as a sorted split's head

    def loss_fn(model, batch):
        logits = model(batch["x"])
        losses = torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="none")
        return {"loss": losses.mean(), "per_sample_loss": losses, "logits": logits}

    def metrics_fn(outputs):  # the recall of a class with no sample is undefined
        positives = outputs["labels"] == 1
        return {"recall_1": (outputs["logits"].argmax(-1)[positives] == 1).float().mean()}

    train(torch.nn.Linear(4, 2), make_loader(train_set, config, train=True), config=config, loss_fn=loss_fn,
          eval_loader=make_loader(val_set, config, train=False), metrics_fn=metrics_fn, accelerator=accelerator)
    out = tmp_path / "run"

    def strict(text):  # Python's json writes NaN, which is not JSON
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in a JSON file"))

    assert strict((out / "all_results.json").read_text())["eval_recall_1"] is None
    records = [strict(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("eval_recall_1", 0) for r in records if any(k.startswith("eval_") for k in r)] == [None]
    assert "a single class of the model's 2" in capsys.readouterr().out
    [warning] = [r["warning"] for r in records if "warning" in r]  # kept in the history, for the report
    assert "a single class of the model's 2" in warning


def test_a_retrieval_among_too_few_candidates_is_warned_about(tmp_path, capsys):
    config = TrainConfig(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4,
                         report_to=["none"], disable_tqdm=True, save_strategy="no", eval_strategy="no")
    accelerator = build_accelerator(config)
    data = [{"x": torch.ones(3), "labels": torch.tensor(0.0)} for _ in range(8)]

    def loss_fn(model, batch):
        return ((model(batch["x"]).squeeze(-1) - batch["labels"]) ** 2).mean()

    train(torch.nn.Linear(3, 1), make_loader(data, config, train=True), config=config, loss_fn=loss_fn,
          eval_loader=make_loader(data, config, train=False), accelerator=accelerator,
          metrics_fn=lambda outputs: {"i2t_recall@10": 1.0, "i2t_chance_recall@10": 1.0})
    assert "chance level is 50% or more (eval_i2t_chance_recall@10 100%)" in capsys.readouterr().out


def test_result_metrics_are_the_same_dict_on_every_rank(tmp_path, ranks):
    """toy_train on the session's 2 spawned gloo ranks."""
    toy_on(ranks, ["--output_dir", str(tmp_path), "--max_steps", "4", "--save_strategy", "no"], processes=2)
    records = toy_records(tmp_path)
    assert set(records) == {0, 1} and len(records[0]) == len(records[1]) == 1
    assert records[0][0]["metrics"] == records[1][0]["metrics"] == results(tmp_path), \
        "every rank returns the same final metrics (runtime, samples/s, peak memory: the all-reduced ones)"


# ------------------------------------------------------------------------------------------ what HF users expect


def test_labels_1_to_k_are_mapped_with_their_names(tiny_bert, tmp_path):
    rows = [(y + 1, t) for y, t in make_rows(64, 5)]  # star-rating style 1, 2
    out = tmp_path / "run"
    nlp(["--model_name_or_path", str(tiny_bert), "--train_file", lines(tmp_path / "train.txt", rows),
         "--test_file", lines(tmp_path / "test.txt", rows[:8]), "--output_dir", str(out), *FAST])
    assert json.loads((out / "config.json").read_text())["id2label"] == {"0": "1", "1": "2"}, \
        "labels 1..K are mapped to 0..K-1 and keep their names"
    predictions = {json.loads(line)["prediction"] for line in (out / "predict_results.jsonl").read_text().splitlines()}
    assert predictions <= {"1", "2"} and "test_accuracy" in results(out)


def test_a_headerless_csv_is_detected_and_named_with_column_names(tiny_bert, tmp_path, capsys):
    rows = make_rows(48, 6)
    (tmp_path / "ag.csv").write_text("".join(f'{y + 1},"{t}","more words here"\n' for y, t in rows))
    argv = ["--model_name_or_path", str(tiny_bert), "--train_file", str(tmp_path / "ag.csv"), *FAST]
    reset_accelerate()
    with pytest.raises(SystemExit):
        run_cli(nlp_finetune.main, [*argv, "--output_dir", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert "the file seems to have no header row" in err and "--column_names" in err
    nlp([*argv, "--output_dir", str(tmp_path / "b"), "--column_names", "label,text,description"])
    assert results(tmp_path / "b")["eval_samples"] == 5  # 10% of 48 held out; the first row is data too


def test_a_folder_as_train_file_says_to_use_dataset_name(tmp_path):
    with pytest.raises(DataError, match=f"--train_file {tmp_path}: a folder.*--dataset_name {tmp_path}"):
        nlp_finetune.load_data(ClassificationDataArguments(train_file=str(tmp_path)), seed=0)


def test_the_recipe_flags_have_help_texts_and_defaults(capsys):
    from accel_train import parse_config

    with pytest.raises(SystemExit):
        parse_config(nlp_finetune.CONFIG_TYPES, ["--help"], defaults=nlp_finetune.DEFAULTS)
    text = " ".join(capsys.readouterr().out.split())
    for dtype in nlp_finetune.CONFIG_TYPES[1:]:
        for name in dtype.__dataclass_fields__:
            help_text = dtype.__dataclass_fields__[name].metadata.get("help")
            assert help_text, f"--{name} has no help text"
            assert " ".join(help_text.split())[:40] in text
    assert "--max-seq-length MAX_SEQ_LENGTH Truncate" in text and "(default: 128)" in text


def test_the_run_prints_a_data_summary(tiny_bert, tmp_path, capsys):
    long = [(y, t + " and the plot was really quite a story") for y, t in make_rows(40, 7)]
    out = tmp_path / "run"
    nlp(["--model_name_or_path", str(tiny_bert), "--train_file", lines(tmp_path / "train.txt", long[:30] +
         make_rows(10, 8)), "--validation_file", lines(tmp_path / "dev.txt", make_rows(20, 9)),
         "--output_dir", str(out), *FAST, "--max_seq_length", "12", "--num_train_epochs", "1"])
    text = capsys.readouterr().out
    assert f"data: train 40 ({tmp_path / 'train.txt'}), validation 20 ({tmp_path / 'dev.txt'})" in text
    assert "data: text column 'text', label column 'label'" in text
    counts = pd.Series([y for y, _ in long[:30] + make_rows(10, 8)]).value_counts()
    assert f"data: 2 labels (train count): 0: {counts[0]}, 1: {counts[1]}" in text
    # 6 words + [CLS] + [SEP] fit in 12 tokens; the long ones (15 words) do not
    assert "data: truncated to --max_seq_length 12: train 30 of 40, validation 0 of 20" in text


def test_an_output_dir_clash_is_refused_before_the_model_loads(tiny_bert, sst_like, tmp_path, capsys):
    out = tmp_path / "run"
    base = ["--train_file", str(sst_like["train"]), "--output_dir", str(out), *FAST, "--num_train_epochs", "1"]
    nlp(["--model_name_or_path", str(tiny_bert), *base])
    reset_accelerate()
    with pytest.raises(SystemExit):  # the clash is reported, not the (missing) model: the check comes first
        run_cli(nlp_finetune.main, ["--model_name_or_path", str(tmp_path / "no_model"), *base])
    err = capsys.readouterr().err
    assert f"--output_dir {out} already holds a run" in err and "--resume_from_checkpoint latest" in err


def test_every_checkpoint_loads_with_from_pretrained(tiny_bert, sst_like, tmp_path):
    from transformers import AutoModelForSequenceClassification, pipeline

    from accel_train.rundir.checkpoint import read_manifest, verify_checkpoint

    out = tmp_path / "run"
    nlp(["--model_name_or_path", str(tiny_bert), "--train_file", str(sst_like["train"]), "--validation_file",
         str(sst_like["dev"]), "--output_dir", str(out), *FAST, "--save_strategy", "steps", "--save_steps", "6",
         "--eval_strategy", "steps", "--eval_steps", "6", "--save_total_limit", "5", "--load_best_model_at_end",
         "false"])
    checkpoints = sorted((out / "checkpoints").glob("step-*"))
    assert len(checkpoints) == 4  # steps 6, 12, 18, 24
    from safetensors.torch import load_file

    for checkpoint in checkpoints:
        verify_checkpoint(checkpoint)
        assert {"config.json", "tokenizer_config.json"} <= set(read_manifest(checkpoint)["files"])
        model = AutoModelForSequenceClassification.from_pretrained(checkpoint)
        saved = load_file(checkpoint / "model.safetensors")
        assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    classify = pipeline("text-classification", model=str(checkpoints[-1]), device="cpu")
    assert classify("great superb lovely")[0]["label"] in ("0", "1")


def test_one_line_per_evaluation_and_the_final_evaluation_is_logged(tiny_bert, sst_like, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    nlp(["--model_name_or_path", str(tiny_bert), "--train_file", str(sst_like["train"]), "--validation_file",
         str(sst_like["dev"]), "--test_file", str(sst_like["test"]), "--output_dir", str(out), *FAST,
         "--num_train_epochs", "3", "--report_to", "tensorboard"])
    text = capsys.readouterr().out
    history = read_jsonl(out / "metrics.jsonl")
    evals = [r for r in history if "eval_accuracy" in r and not r.get("final")]
    assert len(evals) == 3 and text.count("\neval step ") == 3
    for record in evals:
        assert f"eval step {record['step']} (epoch {record['epoch']:g}): loss {record['eval_loss']:.4g}" in text
    (final,) = [r for r in history if r.get("final")]  # the restored best model on validation, and test
    res = results(out)
    assert final["eval_accuracy"] == res["eval_accuracy"] and final["test_accuracy"] == res["test_accuracy"]
    assert final["step"] == 36 and "final evaluation step 36" in text  # 12 steps an epoch
    events = EventAccumulator(str(next((out / "runs").rglob("events.out.tfevents.*")).parent))
    events.Reload()
    assert [e.step for e in events.Scalars("test_accuracy")] == [36]
    assert len(events.Scalars("eval_accuracy")) == 4


@pytest.mark.slow
def test_the_startup_report_comes_before_the_progress_bar_in_a_log_file(tmp_path):
    """A process of its own: what is tested is its block-buffered stdout and its stderr meeting in one file."""
    log = tmp_path / "log.txt"
    with open(log, "w") as fh:  # as `python script.py > log.txt 2>&1` (stdout block-buffered)
        proc = subprocess.run([sys.executable, str(SCRIPTS / "toy_train.py"), "--output_dir",
                               str(tmp_path / "run"), "--disable_tqdm", "false", "--max_steps", "6"],
                              cwd=tmp_path, env=subprocess_env(), stdout=fh, stderr=subprocess.STDOUT, timeout=300)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    bar = text.index("train:")
    assert text.index("accel_train run") < bar and text.index("pre-flight check:") < bar


def test_a_crash_is_recorded_and_the_report_shows_it(tmp_path):
    config = TrainConfig(output_dir=str(tmp_path / "run"), max_steps=6, per_device_train_batch_size=4,
                         report_to=["none"], disable_tqdm=True, save_strategy="no", eval_strategy="no",
                         logging_steps=1)
    accelerator = build_accelerator(config)
    data = [{"x": torch.ones(3), "labels": torch.tensor(0.0)} for _ in range(40)]
    calls = []

    def loss_fn(model, batch):
        calls.append(model.training)  # the pre-flight runs it once in evaluation mode: the 4th training call raises
        if sum(calls) == 4:
            raise RuntimeError("shape mismatch in my loss")
        return ((model(batch["x"]).squeeze(-1) - batch["labels"]) ** 2).mean()

    with pytest.raises(RuntimeError):
        train(torch.nn.Linear(3, 1), make_loader(data, config, train=True), config=config, loss_fn=loss_fn,
              accelerator=accelerator)
    crash = json.loads((tmp_path / "run" / "crash_rank0.json").read_text())
    assert (crash["error"], crash["message"], crash["step"]) == ("RuntimeError", "shape mismatch in my loss", 3)
    assert "in loss_fn" in crash["traceback"]
    report = write_report(tmp_path / "run").read_text()
    assert "**crashed** at step 3: RuntimeError: shape mismatch in my loss" in report and "## Crash" in report
