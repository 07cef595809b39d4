"""Users coming from the Hugging Face scripts and the Trainer: their flags, no silent wrong numbers, the
README's script as printed. Recipe runs and the run directory: tests/tasks/test_users_runs.py."""

import json
import re
import subprocess
import sys

import nlp_finetune
import pytest
import torch
from conftest import ACCELERATE_CONFIGS, RECIPES, ROOT, SHARED_DATA, subprocess_env

from accel_train import ConfigError, TrainConfig, build_accelerator, parse_config
from accel_train.cli import main as cli_main
from accel_train.cli import plan_launch
from accel_train.tasks.text.classification import ClassificationDataArguments

pytestmark = pytest.mark.usefixtures("one_thread")


def parse(argv, types=(TrainConfig,)):
    return parse_config(types, argv)


# ------------------------------------------------------------------------------------------ metric direction


@pytest.mark.parametrize("metric, greater", [
    ("mse", False), ("eval_mae", False), ("rmse", False), ("eval_loss", False), ("perplexity", False),
    ("eval_i2t_median_rank", False), ("error_rate", False), ("accuracy", True), ("eval_f1", True),
    ("pearson", True), ("matthews_correlation", True), ("i2t_recall@1", True)])
def test_greater_is_better_is_inferred_from_the_metric_name(metric, greater):
    assert TrainConfig(metric_for_best_model=metric).best_is_greater is greater, \
        f"{metric}: errors, losses and ranks are lower-is-better, not only names ending in loss"
    assert TrainConfig(metric_for_best_model=metric, greater_is_better=not greater).best_is_greater is (not greater)


# ------------------------------------------------------------------------------------------ HF spellings


@pytest.mark.parametrize("argv, field, value", [
    (["--fp16"], "mixed_precision", "fp16"),
    (["--bf16", "true"], "mixed_precision", "bf16"),
    (["--bf16", "false"], "mixed_precision", None),
    (["--max_train_steps", "7"], "max_steps", 7),
    (["--num_warmup_steps", "3"], "warmup_steps", 3),
    (["--evaluation_strategy", "steps"], "eval_strategy", "steps"),
    (["--checkpointing_steps", "50"], "save_steps", 50),
    (["--checkpointing_steps", "epoch"], "save_strategy", "epoch"),
    (["--resume_from_checkpoint", "true"], "resume_from_checkpoint", "latest"),
    (["--resume_from_checkpoint", "True"], "resume_from_checkpoint", "latest"),
    (["--resume_from_checkpoint", "false"], "resume_from_checkpoint", None),
    (["--with_tracking"], "report_to", ["tensorboard"]),
    (["--do_train", "--do_eval", "--do_predict"], "num_train_epochs", 3.0),
])
def test_hugging_face_spellings_are_read_as_accel_train_flags(argv, field, value, capsys):
    (config,) = parse(argv)
    assert getattr(config, field) == value
    if argv[0] == "--checkpointing_steps" and argv[1] != "epoch":
        assert config.save_strategy == "steps"
    if value is not None and argv[0] != "--do_train":
        assert argv[0] in capsys.readouterr().err  # the run says how it read the flag


def test_max_length_is_the_recipes_max_seq_length():
    _, _, data = parse(["--max_length", "64"], nlp_finetune.CONFIG_TYPES)
    assert data.max_seq_length == 64


def test_hf_spellings_in_a_yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("fp16: true\nmax_train_steps: 9\nevaluation_strategy: steps\n")
    (config,) = parse(["--config", str(path)])
    assert (config.mixed_precision, config.max_steps, config.eval_strategy) == ("fp16", 9, "steps")


def test_report_to_all_means_every_installed_tracker(tmp_path):
    (config,) = parse(["--report_to", "all", "--output_dir", str(tmp_path)])
    trackers = [str(getattr(t, "value", t)) for t in build_accelerator(config).log_with]
    from accelerate.utils import imports

    from accel_train.core.accelerator import KNOWN_TRACKERS

    installed = [name for name in KNOWN_TRACKERS if getattr(imports, f"is_{name}_available")()]
    assert trackers == installed and "tensorboard" in trackers, "all: every installed tracker, not 'unknown tracker'"


def test_eval_or_predict_without_train_is_explained():
    with pytest.raises(ConfigError, match="--do_eval without --do_train: an accel_train run always trains"):
        parse(["--do_eval"])


def test_unknown_flags_get_a_did_you_mean():
    with pytest.raises(ConfigError, match=r"unrecognized arguments: --learning_rte 0.1\. Did you mean --learning_rate"):
        parse(["--learning_rte", "0.1"])
    with pytest.raises(ConfigError, match="Did you mean --per_device_train_batch_size"):
        parse(["--per_device_train_batch_sizes", "8"])


# ------------------------------------------------------------------------------------------ accel-train launch


def test_launch_help_prints_usage(capsys):
    assert cli_main(["launch", "--help"]) == 0, "--help is usage, not a missing-script error"
    out = capsys.readouterr().out
    assert "usage: accel-train launch" in out and "--preset NAME" in out and "cpu_multiprocess" in out


def test_a_preset_by_name_works_from_any_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args, env = plan_launch(["--preset", "cpu_multiprocess", "train.py", "--lr", "1"], has_gpu=False)
    config_file = args[args.index("--config_file") + 1]
    assert config_file == str(ACCELERATE_CONFIGS / "cpu_multiprocess.yaml")
    assert args[-3:] == ["train.py", "--lr", "1"] and env["ACCEL_TRAIN_EXPECTED_WORLD_SIZE"] == "2"
    args, _ = plan_launch(["--preset=deepspeed_zero3", "train.py"], has_gpu=True)  # its JSON made absolute
    import yaml

    preset = yaml.safe_load(open(args[args.index("--config_file") + 1]))
    assert preset["deepspeed_config"]["deepspeed_config_file"] == str(ACCELERATE_CONFIGS / "deepspeed" / "zero3.json")
    assert cli_main(["launch", "--config_file", "accelerate_configs/cpu.yaml", "train.py"]) == 2
    assert "From another directory, name the preset: --preset cpu" in capsys.readouterr().err


def test_a_shipped_config_works_from_any_directory(tmp_path, monkeypatch):
    if not (SHARED_DATA / "sentence-classification").is_dir():
        pytest.skip("../shared/data is not beside the checkout")
    monkeypatch.chdir(tmp_path)
    _, _, data = parse_config(nlp_finetune.CONFIG_TYPES, ["--config", str(RECIPES / "configs" / "nlp_sst2.yaml")],
                              defaults=nlp_finetune.DEFAULTS)
    for path in (data.train_file, data.validation_file, data.test_file):
        assert (tmp_path / path).is_file(), f"{path}: a config's paths are relative to the config file, not the cwd"


# ------------------------------------------------------------------------------------------ subsets


def test_subsample_is_seeded_and_stratified():
    from accel_train.tasks.sampling import subsample

    labels = [i // 100 for i in range(1000)]  # sorted by class, as an image folder is read
    picked = subsample(1000, 100, seed=3, labels=labels)
    assert len(picked) == 100 and list(picked) == sorted(picked)
    assert torch.bincount(torch.tensor(labels)[picked]).tolist() == [10] * 10
    assert (subsample(1000, 100, 3, labels) == picked).all() and not (subsample(1000, 100, 4, labels) == picked).all()
    assert len(subsample(10, 3, 0)) == 3 and len(subsample(10, None, 0)) == 10


def test_image_max_eval_samples_holds_every_class():
    from accel_train.tasks.vision.data import ImageDataArguments, load_image_data

    data = load_image_data(ImageDataArguments(max_eval_samples=50), seed=0)
    labels = data.splits["test"].labels
    assert len(labels) == 50 and len(set(labels.tolist())) == 10, "a subset is drawn over all classes, not the first N"


def test_contrastive_max_eval_samples_holds_every_class():
    from accel_train.tasks.multimodal.data import ImageTextArguments, load_image_text_data

    data = load_image_text_data(ImageTextArguments(max_eval_samples=40), seed=0)
    split = data.splits[data.eval_split]
    assert len(split) == 40 and len(set(split.fields["labels"])) == 10


def test_text_max_eval_samples_is_stratified(tmp_path):
    rows = "".join(f"{i // 50} text number {i}\n" for i in range(200))  # sorted by class
    (tmp_path / "train.txt").write_text(rows)
    (tmp_path / "dev.txt").write_text(rows)
    args = ClassificationDataArguments(train_file=str(tmp_path / "train.txt"),
                                       validation_file=str(tmp_path / "dev.txt"), max_eval_samples=20,
                                       max_train_samples=40)
    ds, _, labels, _ = nlp_finetune.load_data(args, seed=0)
    assert sorted(ds["validation"]["label"]) == [0] * 5 + [1] * 5 + [2] * 5 + [3] * 5
    assert sorted(set(ds["train"]["label"])) == [0, 1, 2, 3] and len(ds["train"]) == 40


# ------------------------------------------------------------------------------------------ the README's script


def readme_script() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Use it from your code"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow  # runs the README's script as printed, in its own processes
def test_the_readme_script_runs_as_printed_and_a_second_run_says_what_to_change(tmp_path):
    (tmp_path / "demo.py").write_text(readme_script())
    env = subprocess_env()

    def run():
        return subprocess.run([sys.executable, "demo.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)

    first = run()
    assert first.returncode == 0, first.stderr[-3000:]
    results = json.loads((tmp_path / "runs/demo/all_results.json").read_text())
    assert results["eval_accuracy"] > 0.8 and "eval_accuracy" in first.stdout
    second = run()
    assert second.returncode != 0
    message = second.stderr.strip().splitlines()[-1]
    assert "output_dir runs/demo already holds a run" in message
    assert "TrainConfig(resume_from_checkpoint='latest')" in message
    assert "TrainConfig(overwrite_output_dir=True)" in message
    assert "--resume_from_checkpoint" not in message and "--overwrite_output_dir" not in message
