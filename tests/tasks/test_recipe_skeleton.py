"""Every recipe has the same skeleton, so that copying one to add a task copies a shape the library expects:
CONFIG_TYPES (TrainConfig first) and DEFAULTS (output_dir outputs/<recipe>), then load_data, build_model,
build_loss, build_metrics, an optional Finish hook, an optional parse, and main(argv=None) -> dict[str, float], run
by run_cli. What every recipe would otherwise have to remember (the step clock, the model factory, DDP's
unused-parameter handling, loader workers, padding to a multiple) is the library's: no recipe mentions it."""

from __future__ import annotations

import ast
import importlib
import inspect
import re

import pytest
from conftest import RECIPES

from accel_train import TrainConfig

NAMES = sorted(path.stem for path in RECIPES.glob("*.py"))
ORDER = ("load_data", "build_model", "build_loss", "build_metrics", "Finish", "parse", "main")
MAX_RECIPE_LINES = 200  # STYLE.md: a recipe is short, about 100-200 lines
REQUIRED = {"load_data", "build_model", "build_loss", "build_metrics", "main"}
# The library's obligations: a recipe that does any of these by hand copies what the session already does.
LIBRARY_ONLY = {
    r"\.clock\b": "the session registers a loss's hooks (its step clock)",
    r"RecordModelFactory|MODEL_FACTORY": "train() records model_factory.json from the model's factory_kwargs",
    r"DistributedDataParallelKwargs|find_unused_parameters": "a loss declares leaves_parameters_unused",
    r"torch\.cuda|is_available\(|device\.type": "no hardware branch in a recipe: the launcher decides",
    r"num_workers": "the loader workers' default is the library's (make_loader)",
    r"pad_to_multiple_of=\d": "pad_multiple(accelerator) gives the multiple for the precision in effect",
}


def test_the_seven_recipes_are_checked():
    assert NAMES == ["image_classification", "multimodal_contrastive", "multimodal_fusion", "nlp_finetune",
                     "object_detection", "semantic_segmentation", "text_generation"], "a new recipe joins the check"


@pytest.mark.parametrize("name", NAMES)
def test_a_recipe_has_the_skeleton_in_order(name):
    source = (RECIPES / f"{name}.py").read_text()
    tree = ast.parse(source)
    defined = [node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    skeleton = [n for n in defined if n in ORDER]
    assert REQUIRED <= set(skeleton), f"{name}: missing {sorted(REQUIRED - set(skeleton))}"
    assert skeleton == sorted(skeleton, key=ORDER.index), \
        f"{name}: the skeleton reads {skeleton}; the order is {' -> '.join(ORDER)} (Finish and parse optional)"
    last = tree.body[-1]
    assert isinstance(last, ast.If) and ast.unparse(last.test) == "__name__ == '__main__'" \
        and ast.unparse(last.body[0]) == "run_cli(main)", f"{name}: ends with `if __name__ == ...: run_cli(main)`"

    recipe = importlib.import_module(name)
    main = inspect.signature(recipe.main)
    assert list(main.parameters) == ["argv"] and main.parameters["argv"].default is None, \
        f"{name}: main(argv=None), so tests and other scripts can call it with flags"
    assert main.return_annotation == "dict[str, float]", f"{name}: main returns the run's final metrics"
    assert recipe.CONFIG_TYPES[0] is TrainConfig, f"{name}: CONFIG_TYPES starts with TrainConfig"
    assert recipe.DEFAULTS["output_dir"] == f"outputs/{name}", f"{name}: runs land in outputs/{name} by default"
    if hasattr(recipe, "Finish"):
        assert callable(getattr(recipe.Finish, "on_finish", None)), f"{name}.Finish is a hook with on_finish"


@pytest.mark.parametrize("name", NAMES)
def test_a_recipe_is_short_enough_to_read_and_copy(name):
    lines = len((RECIPES / f"{name}.py").read_text().splitlines())
    assert lines <= MAX_RECIPE_LINES, \
        f"{name}: {lines} lines; a recipe is at most {MAX_RECIPE_LINES} (what a third recipe repeats goes to tasks/)"


@pytest.mark.parametrize("name", NAMES)
def test_a_recipe_leaves_the_library_its_obligations(name):
    source = (RECIPES / f"{name}.py").read_text()
    found = {why: m.group(0) for pattern, why in LIBRARY_ONLY.items() if (m := re.search(pattern, source))}
    assert not found, f"{name}: " + "; ".join(f"{text!r} — {why}" for why, text in found.items())
