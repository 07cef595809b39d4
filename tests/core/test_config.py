"""Config: defaults < recipe defaults < YAML < CLI; unknown keys and wrong types are errors that name them."""

import dataclasses
import json

import pytest
import yaml

from accel_train import ConfigError, TrainConfig, parse_config, save_config


def parse(argv, defaults=None):
    (cfg,) = parse_config((TrainConfig,), argv, defaults=defaults)
    return cfg


def test_precedence_defaults_yaml_cli(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 0.001\nnum_train_epochs: 2\nreport_to: [none]\nseed: 7\n")
    cfg = parse(["--config", str(path), "--seed", "11"], defaults={"learning_rate": 0.5, "max_steps": 9})
    assert cfg.learning_rate == 0.001  # YAML beats the recipe default
    assert cfg.max_steps == 9  # recipe default beats the dataclass default
    assert cfg.seed == 11  # CLI beats YAML
    assert cfg.num_train_epochs == 2.0 and cfg.report_to == ["none"]
    assert cfg.per_device_train_batch_size == TrainConfig().per_device_train_batch_size


def test_yaml_null_resets_and_bools(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data_seed: null\nload_best_model_at_end: true\neval_strategy: steps\ndisable_tqdm: false\n")
    cfg = parse(["--config", str(path)], defaults={"data_seed": 3})
    assert cfg.data_seed is None and cfg.load_best_model_at_end is True and cfg.disable_tqdm is False


def test_unknown_yaml_key_is_named_with_a_suggestion(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rat: 0.1\n")
    with pytest.raises(ConfigError, match=r"run.yaml: unknown key 'learning_rat'.*learning_rate"):
        parse(["--config", str(path)])


def test_wrong_type_in_yaml_names_file_and_flag(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("per_device_train_batch_size: 3.5\n")
    with pytest.raises(ConfigError, match=r"run.yaml.*--per_device_train_batch_size.*invalid int value"):
        parse(["--config", str(path)])


def test_yaml_syntax_error_is_reported(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: [0.1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        parse(["--config", str(path)])


def test_unknown_flag_and_wrong_type_on_cli():
    with pytest.raises(ConfigError, match="unrecognized arguments: --learnin_rate"):
        parse(["--learnin_rate", "0.1"])
    with pytest.raises(ConfigError, match="--learning_rate.*: invalid float value: 'fast'"):
        parse(["--learning_rate", "fast"])
    with pytest.raises(ConfigError, match="--mixed_precision.*invalid choice"):
        parse(["--mixed_precision", "fp8x"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--per_device_train_batch_size", "0"], "per_device_train_batch_size=0.*>= 1"),
        (["--gradient_accumulation_steps", "0"], "gradient_accumulation_steps"),
        (["--warmup_steps", "2.5"], "warmup_steps"),
        (["--warmup_steps", "10", "--warmup_ratio", "0.1"], "either --warmup_steps or --warmup_ratio"),
        (["--lr_scheduler_type", "cosine_wobble"], "unknown scheduler"),
        (["--lr_scheduler_kwargs", "{step"], "not valid JSON"),
        (["--optim", "lion"], "unknown optimizer"),
        (["--early_stopping_patience", "2", "--eval_strategy", "no"], "needs evaluations"),
        (["--report_to", "neptunex"], None),  # validated when the accelerator is built
    ],
)
def test_bad_values_are_refused_by_name(argv, message):
    if message is None:
        parse(argv)
        return
    with pytest.raises(ConfigError, match=message):
        parse(argv)


def test_warmup_ratio_and_steps():
    assert parse(["--warmup_steps", "0.1"]).warmup_for(200) == 20
    assert parse(["--warmup_ratio", "0.25"]).warmup_for(200) == 50  # the 4.x name still works
    assert parse(["--warmup_steps", "30"]).warmup_for(200) == 30


def test_config_is_frozen():
    cfg = parse([])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.learning_rate = 1.0


def test_saved_config_reloads_identically(tmp_path):
    cfg = parse(["--learning_rate", "0.003", "--report_to", "tensorboard", "--lr_scheduler_kwargs", '{"gamma": 0.5}',
                 "--metric_for_best_model", "accuracy", "--save_total_limit", "2"])
    path = tmp_path / "config.yaml"
    save_config([cfg], path)
    assert yaml.safe_load(path.read_text())["learning_rate"] == 0.003
    assert parse(["--config", str(path)]) == cfg


def test_help_shows_trainconfig_in_its_groups_and_every_field_has_help(capsys):
    from accel_train.config import HELP_GROUPS

    missing = [f.name for f in dataclasses.fields(TrainConfig) if f.init and not f.metadata.get("help")]
    assert missing == []
    with pytest.raises(SystemExit):
        parse_config((TrainConfig,), ["--help"])
    text = capsys.readouterr().out
    titles = [line.rstrip(":") for line in text.splitlines() if line.startswith("TrainConfig: ")]
    assert titles == [f"TrainConfig: {title}" for title in HELP_GROUPS.values()] and len(titles) == 12
    assert text.index("--output_dir") < text.index("--num_train_epochs") < text.index("--preflight")


def test_scheduler_arguments_may_be_a_dict_in_python():
    config = TrainConfig(lr_scheduler_type="step", lr_scheduler_kwargs={"step_size": 2, "gamma": 0.5})
    assert config.scheduler_kwargs == {"step_size": 2, "gamma": 0.5}
    assert json.loads(config.lr_scheduler_kwargs) == {"step_size": 2, "gamma": 0.5}


@pytest.mark.parametrize("flag", ["--cpu", "--use_cpu", "--no_cuda", "--num_processes"])
def test_a_launcher_flag_given_to_the_script_says_where_it_belongs(flag):
    with pytest.raises(ConfigError, match=f"{flag} is a flag of the launcher, not of the training script: give it "
                                          f"to `accelerate launch {flag} ... SCRIPT`"):
        parse_config(argv=[flag])


def test_config_yaml_is_replaced_at_once(tmp_path, monkeypatch):
    """A kill while config.yaml is written (each attempt writes it at its start) left half a file, and `auto` then
    refused every later attempt over "changed" fields it could not read. It is written aside and renamed."""
    from pathlib import Path

    path = tmp_path / "config.yaml"
    save_config([TrainConfig(output_dir=str(tmp_path), learning_rate=0.1)], path)
    whole = path.read_text()
    real = Path.write_text

    def killed_midway(self, text, *args, **kwargs):
        real(self, text[: len(text) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", killed_midway)
    with pytest.raises(OSError):
        save_config([TrainConfig(output_dir=str(tmp_path), learning_rate=0.2)], path)
    assert path.read_text() == whole

