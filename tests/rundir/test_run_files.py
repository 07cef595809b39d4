"""What a run may delete or write over in its output_dir: only what runs of this package wrote (run_files.json).
--overwrite_output_dir and `auto`'s fresh start delete those and nothing else; files no run wrote that a run would
write over are refused before training; `auto` on a finished run says so, exits 0 and touches nothing."""

import json

import pytest
import torch
from conftest import run_toy
from torch.utils.data import DataLoader

from accel_train import ConfigError, TrainConfig, train
from accel_train.rundir import run_files
from accel_train.rundir.final_model import final_model_names

pytestmark = pytest.mark.usefixtures("one_thread")

QUIET = ["--report_to", "none", "--disable_tqdm", "--num_train_epochs", "1"]
# A base model kept in the directory: the generic names --overwrite_output_dir used to delete by glob. Not
# model.safetensors, which the toy's own final model writes (that is refused: the next test).
BASE_MODEL = {"config.json": b'{"model_type": "bert", "hidden_size": 768}', "base.safetensors": bytes(range(256)) * 8,
              "tokenizer.json": b'{"version": "1.0"}', "tokenizer_config.json": b"{}",
              "README.md": b"# my base model\n", "attention.png": b"\x89PNG\r\n\x1a\n" + bytes(64)}


def snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def plant(folder, files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


def test_overwrite_deletes_only_what_a_run_wrote(tmp_path, capsys):
    out = tmp_path / "run"
    plant(out, BASE_MODEL)
    run_toy(capsys, ["--output_dir", str(out), *QUIET, "--save_strategy", "steps", "--save_steps", "4"])
    earlier = {p.name for p in out.iterdir()} - set(BASE_MODEL)
    assert {"model.safetensors", "all_results.json", "checkpoints", "config.yaml", "metrics.jsonl"} <= earlier
    # the replacing run stops at its first step, before it writes a model: what is left is what it did not delete
    # (--no_preflight: its loss check would refuse the poisoned batch before anything is replaced)
    io = run_toy(capsys, ["--output_dir", str(out), *QUIET, "--overwrite_output_dir", "--poison_index", "0",
                          "--per_device_train_batch_size", "96", "--no_preflight"], code=2)
    assert "non-finite" in io.err
    kept = {name: (out / name).read_bytes() if (out / name).exists() else None for name in BASE_MODEL}
    assert kept == BASE_MODEL  # byte for byte
    left = {p.name for p in out.iterdir()}
    assert not {"model.safetensors", "all_results.json", "checkpoints"} & left, left
    toy_record = [name for name in left if name.startswith("toy_rank0_")]  # the script's own file, not the run's
    assert len(toy_record) == 1
    assert json.loads((out / "run_files.json").read_text())["foreign"] == sorted([*BASE_MODEL, *toy_record])
    assert "replaced the earlier run" in io.out and "never deleted by one" in io.out


def test_files_no_run_wrote_that_a_run_would_write_over_are_refused(tmp_path, capsys):
    trainer_dir = {**BASE_MODEL, "model.safetensors": bytes(range(256)), "all_results.json": b'{"eval_loss": 0.3}',
                   "trainer_state.json": b"{}", "runs/Jan01/events.out.tfevents.1": b"tb"}
    out = tmp_path / "trainer_output"
    plant(out, trainer_dir)
    before = snapshot(out)
    for flags in (["--overwrite_output_dir"], [], ["--resume_from_checkpoint", "auto"]):
        io = run_toy(capsys, ["--output_dir", str(out), *QUIET, *flags], code=2)
        assert "holds all_results.json, model.safetensors, runs, which no run of accel_train wrote" in io.err, io.err
        assert "Move them out of" in io.err and "Traceback" not in io.err
        assert snapshot(out) == before  # nothing deleted, nothing written over, nothing added


def test_a_transformers_models_run_refuses_a_foreign_config_json_before_training(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    model = BertForSequenceClassification(BertConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=8))
    out = tmp_path / "base"
    plant(out, {"config.json": b'{"model_type": "bert"}', "notes.txt": b"mine"})
    before = snapshot(out)
    rows = [{"input_ids": torch.tensor([1, 2, 3]), "labels": torch.tensor(0)}] * 4
    config = TrainConfig(output_dir=str(out), report_to=["none"], disable_tqdm=True, max_steps=1,
                         per_device_train_batch_size=2)
    with pytest.raises(ConfigError, match=r"holds config\.json, which no run of accel_train wrote"):
        train(model, DataLoader(rows, batch_size=2), config=config)
    assert snapshot(out) == before
    assert {"config.json", "generation_config.json", "model.safetensors"} <= set(final_model_names(model))
    assert "config.json" not in final_model_names(torch.nn.Linear(2, 2))
    tokenizer = BertTokenizer(vocab={t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a"])})
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(final_model_names(model, tokenizer))  # what it saves


def test_auto_on_a_finished_run_says_so_exits_0_and_touches_nothing(tmp_path, capsys):
    for name, saving in (("no_checkpoints", ["--save_strategy", "no"]),
                         ("last_checkpoint", ["--save_strategy", "steps", "--save_steps", "4"])):
        out = tmp_path / name
        argv = ["--output_dir", str(out), *QUIET, *saving, "--resume_from_checkpoint", "auto"]
        run_toy(capsys, argv)
        before = snapshot(out)
        io = run_toy(capsys, argv, code=0)
        assert f"{out} holds a run that already finished at step 12" in io.out
        assert f"Its results are in {out / 'all_results.json'}" in io.out and "--overwrite_output_dir" in io.out
        assert snapshot(out) == before  # no training: all_results.json, the model, the toy's records unchanged


def test_auto_leaves_a_run_early_stopping_ended_finished(tmp_path, capsys):
    """Early stopping ends a run for good: `auto` (a requeue, the same command again) restarted it from its last
    checkpoint, trained on to the next evaluation, stopped again and replaced the model and the results. A stop
    asked by another hook is still a clean interruption that `auto` continues (test_restarts.py)."""
    out = tmp_path / "run"
    argv = ["--output_dir", str(out), *QUIET, "--save_strategy", "steps", "--save_steps", "2", "--eval_strategy",
            "steps", "--eval_steps", "2", "--learning_rate", "0", "--metric_for_best_model", "eval_loss",
            "--early_stopping_patience", "1", "--resume_from_checkpoint", "auto"]
    run_toy(capsys, argv)  # a rate of 0: the second evaluation is no better than the first, and the run stops
    before = snapshot(out)
    io = run_toy(capsys, argv, code=0)
    assert f"{out} holds a run that already finished at step 4 (stopped early by EarlyStopping; 12 planned)" in io.out
    assert snapshot(out) == before


def test_a_resume_drops_a_history_line_a_crash_cut_short(tmp_path):
    """A process or machine killed mid-write leaves metrics.jsonl's last line cut: the resume's truncation raised on
    it (on the main process alone: every restart hung the other ranks). The records up to the checkpoint stay."""
    from accel_train.rundir.metrics_log import truncate_history

    history = tmp_path / "metrics.jsonl"
    history.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.9}\n{"step": 3, "loss": 0.8}\n{"step": 4, "lo')
    truncate_history(history, 2)
    assert history.read_text() == '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.9}\n'


def test_what_no_attempt_recorded_is_classified_by_name(tmp_path):
    out = tmp_path / "run"
    plant(out, {"config.json": b"base", "notes.txt": b"mine"})
    run_files.begin_attempt(out, replace=False)  # an attempt starts ...
    plant(out, {"config.yaml": b"", "metrics.jsonl": b"", "model.safetensors": b"w", "tokenizer.json": b"t",
                "diagnostics/x.json": b"", "later.txt": b""})  # ... writes, and is SIGKILLed before it records
    # ... inside a rewrite of the history (a resume's or a rollback's truncation) and of config.yaml, after the aside
    # was written and before its rename: those were taken for the user's files, kept by every later replacement
    plant(out, {".metrics.jsonl.tmp": b'{"step": 1}\n', ".config.yaml.tmp": b"seed: 0\n"})
    files = run_files.survey(out)
    assert files.open and files.foreign == {"config.json", "notes.txt", "later.txt"}
    assert files.written == {"config.yaml", "metrics.jsonl", "model.safetensors", "tokenizer.json", "diagnostics"}
    run_files.begin_attempt(out, replace=False)  # the next attempt resumes, and ends
    assert not (out / ".metrics.jsonl.tmp").exists() and not (out / ".config.yaml.tmp").exists()
    run_files.end_attempt(out)
    plant(out, {"vocab.txt": b"v", "export/onnx/model.onnx": b"o"})  # after it: the user's, unless by our name
    files = run_files.survey(out)
    assert not files.open and "vocab.txt" in files.foreign and "export" in files.written
    deleted, kept = run_files.begin_attempt(out, replace=True)
    assert deleted == ["config.yaml", "diagnostics", "export", "metrics.jsonl", "model.safetensors", "tokenizer.json"]
    assert kept == ["config.json", "later.txt", "notes.txt", "vocab.txt"]
    assert sorted(p.name for p in out.iterdir()) == sorted([*kept, "run_files.json"])
