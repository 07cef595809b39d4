"""The bad-input matrix, through the main job (recipes/nlp_finetune.py on a tiny BERT).

Each case: the run exits with status 2, the message names what is wrong and where, says what to do, shows no
stack trace, and a run already in the output directory is left byte-for-byte as it was.
"""

import shutil

import nlp_finetune
import pandas as pd
import pytest
from conftest import make_rows, reset_accelerate

from accel_train import run_cli

FAST = ["--report_to", "none", "--disable_tqdm", "--num_train_epochs", "1", "--per_device_train_batch_size", "8",
        "--max_seq_length", "32", "--learning_rate", "1e-3", "--warmup_steps", "0"]


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_bert):
    """Data files and one finished run with checkpoints, shared read-only by the cases (copied when used)."""
    root = tmp_path_factory.mktemp("matrix")
    for split, n, seed in (("train", 48, 0), ("dev", 16, 1)):
        (root / f"toy.{split}").write_text("".join(f"{y} {t}\n" for y, t in make_rows(n, seed)))
    three = [(i % 3, t) for i, (_, t) in enumerate(make_rows(48, 2))]
    (root / "three.train").write_text("".join(f"{y} {t}\n" for y, t in three))
    base = ["--model_name_or_path", str(tiny_bert), "--train_file", str(root / "toy.train"), "--validation_file",
            str(root / "dev.txt"), *FAST]
    (root / "dev.txt").write_text((root / "toy.dev").read_text())
    reset_accelerate()
    nlp_finetune.main([*base, "--output_dir", str(root / "run"), "--save_strategy", "steps", "--save_steps", "2"])
    from transformers import BertTokenizer

    big = root / "big_tokenizer"
    BertTokenizer(vocab={f"w{i}": i for i in range(5000)} | {"[UNK]": 5000, "[PAD]": 5001}).save_pretrained(big)
    return {"root": root, "base": base, "tiny_bert": tiny_bert}


def write(path, text):
    path.write_text(text)
    return str(path)


def csv(path, frame):
    frame.to_csv(path, index=False)
    return str(path)


def swap(argv, flag, value):
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


# (case id, area, argv builder (world, tmp) -> argv, expected fragments); builders may create files
CASES = [
    ("yaml-unknown-key", "config", lambda w, t: [*w["base"], "--config", write(t / "c.yaml", "learning_rat: 0.1\n")],
     ["c.yaml: unknown key 'learning_rat'", "Did you mean 'learning_rate'"]),
    ("yaml-syntax-error", "config", lambda w, t: [*w["base"], "--config", write(t / "c.yaml", "lr: [1\n")],
     ["c.yaml: not valid YAML"]),
    ("wrong-type", "config", lambda w, t: [*w["base"], "--num_train_epochs", "two"],
     ["--num_train_epochs", "invalid float value: 'two'"]),
    ("batch-size-zero", "config", lambda w, t: swap(w["base"], "--per_device_train_batch_size", "0"),
     ["--per_device_train_batch_size=0", "must be an integer >= 1"]),
    ("warmup-too-long", "config", lambda w, t: swap(w["base"], "--warmup_steps", "100"),
     ["warmup (100 steps) is longer than training (6 optimizer steps)", "Lower --warmup_steps"]),
    ("fp16-on-cpu", "config", lambda w, t: [*w["base"], "--mixed_precision", "fp16"],
     ["fp16 was requested on a CPU", "--mixed_precision bf16"]),
    ("unknown-tracker", "config", lambda w, t: [*w["base"], "--report_to", "neptunex"],
     ["--report_to neptunex: unknown tracker"]),
    ("scheduler-kwargs-not-json", "config", lambda w, t: [*w["base"], "--lr_scheduler_kwargs", "{gamma"],
     ["--lr_scheduler_kwargs", "is not valid JSON"]),
    ("train-file-missing", "data", lambda w, t: swap(w["base"], "--train_file", str(t / "nope.csv")),
     ["--train_file", "nope.csv: no such file"]),
    ("empty-file", "data", lambda w, t: swap(w["base"], "--train_file", write(t / "e.csv", "")),
     ["e.csv: the file is empty"]),
    ("garbled-line", "data", lambda w, t: swap(w["base"], "--train_file", write(t / "g.txt", "1 good\npositive bad\n")),
     ["g.txt:2: expected '<int label> <text>'"]),
    ("no-text-column", "data", lambda w, t: swap(w["base"], "--train_file", csv(t / "x.csv", pd.DataFrame(
        {"words": ["good", "bad"] * 8, "label": [1, 0] * 8}))), ["no text column found in ['words', 'label']",
                                                                  "--text_column_names"]),
    ("no-label-column", "data", lambda w, t: swap(w["base"], "--train_file", csv(t / "x.csv", pd.DataFrame(
        {"text": ["good", "bad"] * 8, "verdict": [1, 0] * 8}))), ["no label column found", "--label_column_name"]),
    ("text-column-not-text", "data", lambda w, t: [*swap(swap(w["base"], "--train_file", csv(t / "x.csv", pd.DataFrame(
        {"text": ["good", "bad"] * 8, "n": [3, 4] * 8, "label": [1, 0] * 8}))), "--validation_file", str(t / "x.csv")),
        "--text_column_names", "n"],
     ["text column 'n' holds int values, not text"]),
    ("label-out-of-range", "data", lambda w, t: swap(w["base"], "--validation_file",
                                                     write(t / "d.txt", "1 good film\n7 bad film\n")),
     ["validation split: label(s) [7] outside 0..1"]),
    ("unseen-label-string", "data", lambda w, t: [*swap(swap(w["base"], "--train_file", csv(t / "s.csv", pd.DataFrame(
        {"text": ["good", "bad"] * 8, "label": ["pos", "neg"] * 8}))), "--validation_file", csv(
        t / "v.csv", pd.DataFrame({"text": ["meh"], "label": ["meh"]})))], ["label(s) ['meh'] do not occur in train"]),
    ("batch-larger-than-data", "data", lambda w, t: [*swap(w["base"], "--per_device_train_batch_size", "64"),
                                                     "--dataloader_drop_last"],
     ["fewer samples than per_device_train_batch_size (64)", "Use a smaller batch size"]),
    ("empty-after-filtering", "data", lambda w, t: [*w["base"], "--max_train_samples", "0"],
     ["the train split is empty after loading and filtering"]),
    ("unknown-model", "model", lambda w, t: swap(w["base"], "--model_name_or_path", str(t / "no_model")),
     ["--model_name_or_path", "cannot load it"]),
    ("seq-len-beyond-positions", "model", lambda w, t: swap(w["base"], "--max_seq_length", "4096"),
     ["--max_seq_length 4096 exceeds the 128 positions"]),
    ("tokenizer-model-mismatch", "model", lambda w, t: [*w["base"], "--tokenizer_name",
                                                        str(w["root"] / "big_tokenizer")],
     ["the tokenizer has 5005 tokens but the model embeds only 35", "--tokenizer_name"]),
    ("config-override-unknown-field", "model", lambda w, t: [*w["base"], "--config_overrides", "hiden_dropout=0.2"],
     ["--config_overrides: BertConfig has no field ['hiden_dropout']", "hidden_dropout_prob"]),
    ("config-override-wrong-type", "model", lambda w, t: [*w["base"], "--config_overrides", "hidden_dropout_prob=high"],
     ["--config_overrides: hidden_dropout_prob takes float values, not 'high'"]),
    ("config-override-refused-by-config", "model",
     lambda w, t: [*w["base"], "--config_overrides", "classifier_dropout=high"],
     ["--config_overrides: BertConfig refuses classifier_dropout='high'", "expected float"]),
    ("config-override-not-pairs", "model", lambda w, t: [*w["base"], "--config_overrides", "hidden_dropout_prob"],
     ["write key=value pairs separated by commas"]),
    ("resume-none-saved", "checkpoint", lambda w, t: [*w["base"], "--resume_from_checkpoint", "latest"],
     ["no complete checkpoint", "Start without --resume_from_checkpoint"]),
    ("resume-path-missing", "checkpoint", lambda w, t: [*w["base"], "--resume_from_checkpoint", str(t / "gone")],
     ["--resume_from_checkpoint", "gone: no such directory"]),
    ("resume-other-label-count", "checkpoint", lambda w, t: [*swap(w["base"], "--train_file",
                                                                   str(w["root"] / "three.train")), "RUN",
                                                             "--resume_from_checkpoint", "latest"],
     ["written by a different model", "classifier.bias: checkpoint [2] vs model [3]",
      "same model and label count"]),
    ("resume-other-global-batch", "checkpoint", lambda w, t: [*swap(w["base"], "--per_device_train_batch_size", "4"),
                                                              "RUN", "--resume_from_checkpoint", "latest"],
     # the recipe's default token budget is chosen for batches of --per_device_train_batch_size: another number
     ["was trained with --max_tokens_per_batch", "this run asks for --max_tokens_per_batch",
      "Resume with the flags it was trained with"]),
    ("resume-tampered", "checkpoint", lambda w, t: [*w["base"], "RUN", "--resume_from_checkpoint", "TAMPERED"],
     ["optimizer.bin does not match its manifest", "Resume from another checkpoint"]),
    ("output-dir-holds-run", "checkpoint", lambda w, t: [*w["base"], "RUN"],
     ["already holds a run", "--resume_from_checkpoint latest", "--overwrite_output_dir"]),
    ("output-dir-not-writable", "launch", lambda w, t: [*w["base"], "--output_dir", str(t / "file" / "run")],
     ["is not writable"]),
    ("world-size-mismatch", "launch", lambda w, t: [*w["base"], "--expected_world_size", "2"],
     ["2 processes were requested (--expected_world_size) but 1 joined", "accel-train launch"]),
]


def snapshot(path):
    return {p: p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case, area, build, fragments", CASES, ids=[c[0] for c in CASES])
def test_bad_input(world, tmp_path, capsys, case, area, build, fragments):
    (tmp_path / "file").write_text("a file where a directory should be")
    run = tmp_path / "run"
    shutil.copytree(world["root"] / "run", run)
    argv = build(world, tmp_path)
    if "TAMPERED" in argv:
        optimizer = sorted((run / "checkpoints").iterdir())[-1] / "optimizer.bin"
        optimizer.write_bytes(optimizer.read_bytes()[:-3] + b"xyz")
        argv[argv.index("TAMPERED")] = str(optimizer.parent)
    if "RUN" in argv:
        argv.remove("RUN")
        argv += ["--output_dir", str(run)]
    elif "--output_dir" not in argv:
        argv += ["--output_dir", str(tmp_path / "fresh")]
    before = snapshot(run)
    reset_accelerate()
    with pytest.raises(SystemExit) as exit_info:
        run_cli(nlp_finetune.main, argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    for fragment in fragments:
        assert fragment in err, f"{case}: {fragment!r} not in:\n{err}"
    assert "Traceback" not in err
    assert snapshot(run) == before, f"{case}: the existing run was modified"
    fresh = tmp_path / "fresh"
    assert not fresh.exists() or not any(p.name in ("config.yaml", "checkpoints") for p in fresh.iterdir())


def test_the_matrix_covers_every_area():
    areas = {}
    for case in CASES:
        areas.setdefault(case[1], []).append(case[0])
    assert len(CASES) >= 20 and set(areas) == {"config", "data", "model", "checkpoint", "launch"}
