"""Evaluate a saved detection or segmentation model on the test canvases, on however many processes it runs on
(the tests call `main(argv)` in their own process and on the session's 2 spawned ranks; it also launches), with the
recipe's own data, model, loss and metrics; the main process writes eval.json.

    accelerate launch tests/scripts/dense_eval.py --task detection --weights run/model.safetensors --output_dir out

For the 1-vs-2-process tests: training on 2 processes changes batch-norm statistics, so the tests train once
and compare the evaluation alone.
"""

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from accel_train import build_accelerator, end_training_safely, evaluate_model, make_loader, parse_config
from accel_train.rundir.weights import load_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
import object_detection  # noqa: E402
import semantic_segmentation  # noqa: E402

from accel_train.tasks.vision.dense.canvases import DenseCollator  # noqa: E402


@dataclass(frozen=True)
class EvalArguments:
    task: str = "detection"
    weights: str = ""


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe = semantic_segmentation if argv[argv.index("--task") + 1] == "segmentation" else object_detection
    config, data_args, aug_args, model_args, what = parse_config((*recipe.CONFIG_TYPES, EvalArguments), argv,
                                                                   defaults=recipe.DEFAULTS)
    accelerator = build_accelerator(config)
    data = recipe.load_data(data_args, config.seed)
    model = recipe.build_model(model_args, data)
    load_weights(model, what.weights)
    loss_fn = recipe.build_loss(aug_args, model_args, data)
    loader = make_loader(data.splits["test"], config, train=False, collate_fn=DenseCollator(data.max_objects))
    model, loader = accelerator.prepare(model, loader)
    metrics = evaluate_model(accelerator, model, loader, loss_fn, recipe.build_metrics(data))
    if accelerator.is_main_process:
        Path(config.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(config.output_dir) / "eval.json").write_text(json.dumps(metrics, indent=2))
    end_training_safely(accelerator)


if __name__ == "__main__":
    main()
