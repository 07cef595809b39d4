"""What a regression head needs besides a classification head: fp32 predictions under mixed precision, and a loss
that refuses label smoothing.

Under bf16 autocast (the recipe's --mixed_precision auto on bf16 hardware) a Linear head returns bf16: 8 bits of
mantissa, so a prediction near 500 is a multiple of 2 and one near 5 a multiple of 1/32, in the loss, in eval_mse
(the default best-model metric for regression) and in predict_results.jsonl. A classification head's argmax hardly
notices; a regression's value is its prediction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

from ....core.loss import check_label_smoothing, default_loss, problem_type
from .data import Labels


def classification_loss(labels: Labels, label_smoothing: float) -> Callable:
    """The model's own loss (cross-entropy, or with `label_smoothing` its smoothed form, evaluated without it), with
    per-sample losses (core/loss.py: default_loss). Float labels (regression: the mean squared error, which has no
    label smoothing) declare `refuse_label_smoothing`, which the session checks, and which is checked here already,
    before the recipe tokenizes: a smoothing factor would change nothing while config.yaml records it."""
    loss_fn = default_loss(label_smoothing)
    if labels.is_regression:
        loss_fn.refuse_label_smoothing = _no_smoothing
        check_label_smoothing(loss_fn, label_smoothing)
    return loss_fn


def _no_smoothing(factor: float) -> str:
    return (f"--label_smoothing_factor {factor}: the labels are floats, a regression, and its loss (the mean squared "
            "error) has no label smoothing, so the flag would change nothing while config.yaml records it; drop it "
            "(or set it to 0).")


def regression_head_in_fp32(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (a transformers sequence-classification model) with its regression head computing in fp32 from the
    body's features, under autocast and under bf16 weights alike (a forward hook recomputes the head's output: a
    dot product per output; the weights and their names are unchanged). A model that is not a regression, or whose
    last Linear layer does not give its `num_labels` outputs, is returned as it is.

        model = regression_head_in_fp32(AutoModelForSequenceClassification.from_pretrained(path, num_labels=1))
    """
    outputs = getattr(getattr(model, "config", None), "num_labels", None)
    heads = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.out_features == outputs]
    if problem_type(model) == "regression" and heads:
        heads[-1].register_forward_hook(fp32_output)  # the last registered: the head (classifier, score, out_proj)
    return model


def fp32_output(module: torch.nn.Linear, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
    """A Linear layer's output again, in fp32 (None, its own output, where it is fp32 already)."""
    if output.dtype == torch.float32:
        return None
    bias = None if module.bias is None else module.bias.float()
    with torch.autocast(output.device.type, enabled=False):
        return F.linear(args[0].float(), module.weight.float(), bias)
