"""recipes/nlp_finetune.py: end to end on a tiny BERT built offline; data formats; 1 vs 2 processes (the recipe's one
real `accelerate launch` of 2 against `main(argv)` here); and one real test on all-MiniLM-L6-v2 with SST-2 (slow).
Bad input to the recipe: tests/tasks/test_bad_input_matrix.py."""

import json

import pandas as pd
import pytest
from conftest import FILLER, RECIPES, SHARED_DATA, launch, make_rows
from conftest import nlp_main as run

from accel_train import ConfigError, layerwise_lr_decay_groups
from accel_train.tasks.text.classification import load_embedded_tweets

RECIPE = RECIPES / "nlp_finetune.py"
FAST = ["--report_to", "none", "--disable_tqdm", "--num_train_epochs", "3", "--learning_rate", "3e-3",
        "--per_device_train_batch_size", "8", "--per_device_eval_batch_size", "8", "--warmup_steps", "0",
        "--max_seq_length", "32"]


def results(out):
    return json.loads((out / "all_results.json").read_text())


def test_end_to_end_on_line_format_with_test_predictions(tiny_bert, sst_like, tmp_path):
    out = tmp_path / "run"
    run(["--model_name_or_path", str(tiny_bert), "--train_file", str(sst_like["train"]), "--validation_file",
         str(sst_like["dev"]), "--test_file", str(sst_like["test"]), "--output_dir", str(out), *FAST,
         "--num_train_epochs", "5"])
    res = results(out)
    assert res["eval_samples"] == 40
    assert res["eval_accuracy"] >= 0.9 and res["test_accuracy"] >= 0.9  # the words decide the label
    for key in ("eval_f1", "eval_f1_micro", "eval_f1_binary", "eval_precision", "eval_recall",
                "eval_matthews_correlation", "train_padding_ratio", "test_f1"):
        assert key in res
    predictions = [json.loads(line) for line in (out / "predict_results.jsonl").read_text().splitlines()]
    assert len(predictions) == 24 and {p["prediction"] for p in predictions} <= {"0", "1"}


def test_a_metric_the_recipe_never_reports_is_refused_before_training(tiny_bert, sst_like, tmp_path):
    """--metric_for_best_model f1_macro (the metric is `f1`, macro-averaged): the recipe's metrics named nothing, so
    only the pre-flight warned, and the first evaluation stopped the run an epoch in. They list what they return:
    refused before the first step, naming what is reported."""
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"--metric_for_best_model f1_macro: the evaluations of this run report only "
                                          r".*eval_f1, .*eval_f1_binary, eval_matthews_correlation"):
        run(["--model_name_or_path", str(tiny_bert), "--train_file", str(sst_like["train"]), "--validation_file",
             str(sst_like["dev"]), "--output_dir", str(out), *FAST, "--metric_for_best_model", "f1_macro"])
    assert not (out / "metrics.jsonl").exists()


def test_string_labels_sentence_pairs_and_pipeline(tiny_bert, tmp_path):
    rows = make_rows(96, 3)
    frame = pd.DataFrame({"premise": [t for _, t in rows], "hypothesis": ["it is" for _ in rows],
                          "verdict": ["positive" if y else "negative" for y, _ in rows]})
    frame.iloc[:80].to_csv(tmp_path / "train.csv", index=False)
    frame.iloc[80:].to_json(tmp_path / "dev.jsonl", orient="records", lines=True)
    out = tmp_path / "run"
    run(["--model_name_or_path", str(tiny_bert), "--train_file", str(tmp_path / "train.csv"), "--validation_file",
         str(tmp_path / "dev.jsonl"), "--text_column_names", "premise,hypothesis", "--label_column_name", "verdict",
         "--output_dir", str(out), *FAST, "--num_train_epochs", "8"])
    config = json.loads((out / "config.json").read_text())
    assert config["id2label"] == {"0": "negative", "1": "positive"}
    from transformers import pipeline

    classify = pipeline("text-classification", model=str(out), device="cpu")
    assert classify("great superb lovely")[0]["label"] == "positive"
    assert classify("awful terrible boring")[0]["label"] == "negative"


def test_regression_on_float_labels(tiny_bert, tmp_path):
    rows = make_rows(64, 4)
    frame = pd.DataFrame({"text": [t for _, t in rows], "score": [0.9 if y else 0.1 for y, _ in rows]})
    frame.to_parquet(tmp_path / "train.parquet")
    out = tmp_path / "run"
    run(["--model_name_or_path", str(tiny_bert), "--train_file", str(tmp_path / "train.parquet"),
         "--label_column_name", "score", "--output_dir", str(out), *FAST, "--metric_for_best_model", "mse",
         "--greater_is_better", "false"])
    res = results(out)
    assert res["eval_samples"] == 7  # 10% held out, seeded
    assert res["eval_mse"] < 0.16 and "eval_pearson" in res


def test_label_smoothing_is_refused_for_float_labels_before_tokenizing(tiny_bert, tmp_path):
    """A regression's loss (MSE) has no label smoothing: the flag changed nothing while config.yaml recorded it
    (failed before: the run trained and returned)."""
    rows = make_rows(40, 4)
    pd.DataFrame({"text": [t for _, t in rows], "score": [0.9 if y else 0.1 for y, _ in rows]}).to_csv(
        tmp_path / "train.csv", index=False)
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"--label_smoothing_factor 0.1: .*regression.* no label smoothing.*drop"):
        run(["--model_name_or_path", str(tiny_bert), "--train_file", str(tmp_path / "train.csv"),
             "--label_column_name", "score", "--output_dir", str(out), *FAST, "--max_steps", "1",
             "--label_smoothing_factor", "0.1"])
    assert not out.exists() or not any(out.iterdir())


def test_regression_eval_loss_on_two_processes_counts_each_sample_once(tiny_bert, tmp_path, ranks):
    """13 float-label validation rows, 1 process x 8 against 2 x 4 (the session's gloo ranks): the last batch of rank
    1 holds row 12 and three rows repeated from the start to even it out. Per-sample squared errors let the gather
    drop the repeats; the batch mean stood for each of its samples, repeats included (failed before)."""
    rows = make_rows(77, 6)
    frame = pd.DataFrame({"text": [t for _, t in rows], "score": [0.2 + 0.6 * y + 0.01 * i for i, (y, _) in
                                                                  enumerate(rows)]})
    frame.iloc[:64].to_csv(tmp_path / "train.csv", index=False)
    frame.iloc[64:].to_csv(tmp_path / "dev.csv", index=False)
    common = ["--model_name_or_path", str(tiny_bert), "--train_file", str(tmp_path / "train.csv"), "--validation_file",
              str(tmp_path / "dev.csv"), "--label_column_name", "score", *FAST, "--learning_rate", "0",
              "--max_steps", "1", "--save_strategy", "no", "--load_best_model_at_end", "false", "--mixed_precision",
              "no", "--per_device_train_batch_size", "4"]
    one = run([*common, "--per_device_eval_batch_size", "8", "--output_dir", str(tmp_path / "one")])
    ranks.run(run, [*common, "--per_device_eval_batch_size", "4", "--output_dir", str(tmp_path / "two")])
    two = results(tmp_path / "two")
    assert one["eval_samples"] == two["eval_samples"] == 13
    assert two["eval_mse"] == pytest.approx(one["eval_mse"], abs=1e-6)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], abs=1e-6)
    assert one["eval_loss"] == pytest.approx(one["eval_mse"], rel=1e-5)  # the loss is the mean squared error


def test_a_regression_head_under_bf16_autocast_predicts_in_fp32(tiny_bert):
    """Under bf16 autocast (--mixed_precision auto on bf16 hardware) a Linear head returns bf16: a prediction near 500
    was rounded to a multiple of 2 (8 mantissa bits), in eval_mse, the best-model metric, and predict_results.jsonl.
    The recipe's regression head computes in fp32 from the body's features (failed before: 500.7 came out as 500)."""
    import nlp_finetune
    import torch
    from transformers import AutoTokenizer

    from accel_train.tasks.text.classification import ClassificationModelArguments, Labels

    _, model = nlp_finetune.build_model(ClassificationModelArguments(model_name_or_path=str(tiny_bert)),
                                        Labels(None), 32)
    batch = AutoTokenizer.from_pretrained(tiny_bert)(["good movie", "bad plot"], return_tensors="pt")
    model.eval()
    with torch.no_grad():
        model.classifier.weight.mul_(1e-3)  # the features hardly move the prediction: the bias decides it
        model.classifier.bias.fill_(500.7)
        fp32 = model(**batch).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = model(**batch).logits
    assert mixed.dtype == torch.float32 and (mixed - fp32).abs().max() < 0.01, (mixed, fp32)


def test_config_overrides_reach_the_trained_model(tiny_bert, sst_like, tmp_path):
    out = tmp_path / "run"
    run(["--model_name_or_path", str(tiny_bert), "--train_file", str(sst_like["train"]), "--validation_file",
         str(sst_like["dev"]), "--output_dir", str(out), *FAST, "--num_train_epochs", "1",
         "--config_overrides", "hidden_dropout_prob=0.25, classifier_dropout=0.3"])
    saved = json.loads((out / "config.json").read_text())
    assert saved["hidden_dropout_prob"] == 0.25 and saved["classifier_dropout"] == 0.3


def test_length_grouping_cuts_padding(tiny_bert, tmp_path):
    import random

    rng = random.Random(5)
    lines = [f"{i % 2} {' '.join(rng.choices(FILLER, k=rng.randint(2, 28)))}\n" for i in range(128)]
    (tmp_path / "train.txt").write_text("".join(lines))
    ratios = {}
    for flag in ("--group_by_length", "--no_group_by_length"):
        out = tmp_path / flag
        run(["--model_name_or_path", str(tiny_bert), "--train_file", str(tmp_path / "train.txt"), "--output_dir",
             str(out), *FAST, "--num_train_epochs", "1", flag])
        ratios[flag] = results(out)["train_padding_ratio"]
    assert ratios["--group_by_length"] < 0.5 * ratios["--no_group_by_length"]


def test_layerwise_lr_decay_groups(tiny_bert):
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tiny_bert)
    groups = layerwise_lr_decay_groups(model, 1.0, 0.01, 0.5)
    lr_of = {id(p): g["lr"] for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert lr_of[id(named["classifier.weight"])] == 1.0
    assert lr_of[id(named["bert.encoder.layer.1.attention.self.query.weight"])] == 0.5
    assert lr_of[id(named["bert.encoder.layer.0.attention.self.query.weight"])] == 0.25
    assert lr_of[id(named["bert.embeddings.word_embeddings.weight"])] == 0.125
    assert sum(len(g["params"]) for g in groups) == len(named)


def test_embedded_tweets_split_is_seeded_and_stratified():
    a = load_embedded_tweets(seed=1, train_size=400, validation_size=100)
    b = load_embedded_tweets(seed=1, train_size=400, validation_size=100)
    assert len(a["train"]) == 400 and len(a["validation"]) == 100
    assert a["train"]["text"] == b["train"]["text"]
    shares = pd.Series(a["train"]["label"]).value_counts(normalize=True)
    assert set(shares.index) == {"negative", "neutral", "positive"}
    assert abs(shares["positive"] - 6954 / 38158) < 0.02  # class proportions kept


@pytest.mark.slow
def test_two_processes_give_the_same_metrics(tiny_bert, sst_like, tmp_path):
    """2 processes: the real launcher; 1 process: `main(argv)` in this process."""
    common = ["--model_name_or_path", str(tiny_bert), "--train_file", str(sst_like["train"]), "--validation_file",
              str(sst_like["dev"]), "--test_file", str(sst_like["test"]), *FAST, "--num_train_epochs", "2",
              "--save_strategy", "no", "--load_best_model_at_end", "false", "--mixed_precision", "no"]  # fp32 parity
    common[common.index("--per_device_train_batch_size") + 1] = "4"
    launch(RECIPE, [*common, "--output_dir", str(tmp_path / "two")], 2)
    common[common.index("--per_device_train_batch_size") + 1] = "8"
    run([*common, "--output_dir", str(tmp_path / "one")])
    one, two = results(tmp_path / "one"), results(tmp_path / "two")
    assert one["eval_samples"] == two["eval_samples"] == 40
    for key in ("eval_accuracy", "eval_f1", "eval_matthews_correlation", "test_accuracy"):
        assert one[key] == two[key], key
    predictions = [(tmp_path / name / "predict_results.jsonl").read_text() for name in ("one", "two")]
    assert predictions[0] == predictions[1] and len(predictions[0].splitlines()) == 24  # every test row, in order
    assert one["eval_loss"] == pytest.approx(two["eval_loss"], abs=1e-4)


def test_the_line_format_reads_windows_1252_and_ends_lines_at_line_breaks_only(tmp_path):
    """MR and Subj (sentence-classification) are Windows-1252: an ellipsis is byte 0x85, which read as latin-1 is
    U+0085, where str.splitlines() ended a line ('0 ' then a line of text: the recipe refused the file at line 474).
    Each file reads whole, one example a line, with its quotes and ellipses; a label without text is refused by
    name; a line holding only whitespace is skipped."""
    from accel_train import DataError
    from accel_train.tasks.text.classification.data import read_label_text_lines

    path = tmp_path / "mr.txt"
    path.write_bytes(b"0 \x85the maudlin way \x93it\x94 unfolds\r\n1 a fine film \x96 truly\n \n")
    rows = read_label_text_lines(path)
    assert rows["label"] == [0, 1]
    assert rows["text"] == ["\u2026the maudlin way \u201cit\u201d unfolds", "a fine film \u2013 truly"]
    path.write_bytes(b"\xef\xbb\xbf1 byte-order mark\r0 old mac endings\r")  # utf-8 with a BOM, "\r" lines
    assert read_label_text_lines(path).to_dict() == {"label": [1, 0], "text": ["byte-order mark", "old mac endings"]}
    path.write_text("1 good\n0 \n", encoding="utf-8")
    with pytest.raises(DataError, match=r"mr.txt:2: the label 0 has no text after it. Remove the line"):
        read_label_text_lines(path)
    shared = SHARED_DATA / "sentence-classification"
    for name, lines in (("rt-polarity.all", 10662), ("subj.all", 10000)):
        if (shared / name).is_file():
            rows = read_label_text_lines(shared / name)
            assert len(rows) == lines and set(rows["label"]) == {0, 1}
            assert not any("\x85" in text for text in rows["text"])


@pytest.mark.slow
def test_real_minilm_learns_sst2(tmp_path):
    """The real pretrained model on a slice of real data: clearly above chance after a short run."""
    sst = SHARED_DATA / "sentence-classification"
    if not (sst / "stsa.binary.train").is_file():
        pytest.skip("../shared/data is not beside the checkout")
    out = tmp_path / "minilm"
    run(["--train_file", str(sst / "stsa.binary.train"), "--validation_file", str(sst / "stsa.binary.dev"),
         "--max_train_samples", "800", "--max_eval_samples", "300", "--num_train_epochs", "1",
         "--learning_rate", "3e-4", "--output_dir", str(out), "--report_to", "none", "--disable_tqdm",
         "--save_strategy", "no", "--load_best_model_at_end", "false"])
    res = results(out)
    assert res["eval_samples"] == 300
    assert res["eval_accuracy"] > 0.7, res  # chance is ~0.5
