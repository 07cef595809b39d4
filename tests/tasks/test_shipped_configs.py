"""Every shipped recipe config parses with its recipe's own dataclasses (torchtune's habit: one test loads all)."""

import importlib

import pytest
from conftest import RECIPES

from accel_train import parse_config

CONFIGS = sorted((RECIPES / "configs").glob("*.yaml"))


def recipe_for(config_path):
    # the longest recipe name the config name starts with (multimodal_fusion_* is not multimodal_contrastive's),
    # else a recipe of the same family (nlp_sst2 -> nlp_finetune)
    name, recipes = config_path.stem, sorted(RECIPES.glob("*.py"))
    for recipe in sorted(recipes, key=lambda p: -len(p.stem)):
        if name.startswith(recipe.stem):
            return importlib.import_module(recipe.stem)
    for recipe in recipes:
        if name.startswith(recipe.stem.split("_")[0]):
            return importlib.import_module(recipe.stem)
    raise AssertionError(f"no recipe matches config {config_path.name}")


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_parses(path):
    module = recipe_for(path)
    configs = parse_config(module.CONFIG_TYPES, ["--config", str(path)], defaults=getattr(module, "DEFAULTS", None))
    assert configs[0].output_dir.startswith("outputs/")


RECIPE_NAMES = sorted(p.stem for p in RECIPES.glob("*.py"))


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_help_lists_every_flag(name, capsys):
    # argparse %-formats help texts: one stray '%' made `--help` a traceback.
    module = importlib.import_module(name)
    with pytest.raises(SystemExit) as exit_info:
        parse_config(module.CONFIG_TYPES, ["--help"], defaults=getattr(module, "DEFAULTS", None))
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--learning_rate", "--gradient_checkpointing", "--config", "--output_dir"):
        assert flag in text
