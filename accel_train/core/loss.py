"""The loss contract, the default loss, and the gradient normalisation that makes every optimizer step exact.

A loss function `loss_fn(model, batch)` returns one of

* a scalar tensor, or a mapping with "loss": the MEAN over the micro-batch (classification, contrastive, ...),
  never divided by the accumulation count;
* a mapping with "loss_sum" and "num_items": a SUM over items (tokens) and how many items it covers — scalars,
  or per-sample tensors [B] (then evaluation is exact per sample) — for per-token losses.

Either mapping may carry per-sample tensors for the metrics and scalars under "log" (logged beside the loss).

What a loss object may declare, and the session then does for it (so that no recipe has to remember it):

* `hooks`: hook objects the loss needs (a step clock that tells it the loop's position): registered with the run's;
* `refuse_accumulation(steps) -> str`: the loss couples the whole batch (a contrastive loss sees the batch's
  negatives), so gradient accumulation would change its objective: the session refuses it with this message;
* `leaves_parameters_unused = True`: some steps give trainable parameters no gradient (a tower frozen for the
  first steps, a stage that idles half the model): the session sets DDP's `find_unused_parameters`;
* `refuse_label_smoothing(factor) -> str`: the loss has no label smoothing (a focal loss, InfoNCE), so
  --label_smoothing_factor would change nothing while config.yaml records it: `check_label_smoothing` refuses it with
  this message. The loop applies the flag only through `default_loss`; a loss of one's own reads it or declares this.

Evaluation never includes training-only terms: a loss function with regularisers that are not the objective being
measured (label smoothing, mixup, auxiliary penalties) carries `evaluation_loss`, the same loss without them, which
every evaluation (and the `--overfit_batches` check, which must judge whether the objective itself can reach zero)
uses instead: `evaluation_loss(loss_fn)`. `default_loss(label_smoothing)` has one.

What an optimizer step's gradient is (the loop applies it after the window's backward passes, before clipping):

* means: the mean over the micro-batches the window really had (a short last window of an epoch, or of a stream,
  counts its own micro-batches); under --max_tokens_per_batch, whose micro-batches hold varying numbers of examples,
  a step of several micro-batches weighs each mean by its examples (`weigh_by_examples`): the mean over the step's
  examples;
* sums: ∇ Σ sums / N, N the item count of the whole accumulation window on all processes (one all-reduce of one
  number). Accelerate divides every backward by the accumulation count and DDP averages over processes; both are
  undone here, so the objective does not depend on how the window was split into micro-batches, processes or an
  automatic batch size. A window with N = 0 makes no update (the step is skipped, never NaN).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from accelerate.utils import extract_model_from_parallel

from ..errors import ConfigError
from .chunked_loss import check_chunked_loss, chunked_causal_loss
from .sharded import refuse_sums_under_deepspeed

IGNORE_INDEX = -100  # a per-token label no loss counts (transformers' losses skip it too)


def batch_size_of(batch: Any) -> int:
    """The leading dimension of the first tensor in a batch (dict, list/tuple or tensor)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    values = batch.values() if isinstance(batch, Mapping) else batch
    for value in values:
        if isinstance(value, torch.Tensor) and value.ndim > 0:
            return value.shape[0]
        if isinstance(value, (Mapping, list, tuple)):
            try:
                return batch_size_of(value)
            except ValueError:  # a list of strings beside the tensors: look on
                continue
    raise ValueError("cannot find the batch size: the batch holds no tensor (text the collator left untokenized? "
                     "tokenize in the dataset's map() or the collate_fn)")


def tuple_target(batch: Any) -> torch.Tensor | None:
    """The target of a tuple batch, ``(inputs, targets)`` or ``(x1, x2, y)``: its last element (every other element
    is an input of the model, in order: ``model(*batch[:-1])``); None for a batch of another kind. What evaluation
    hands the metrics as "labels" and the pre-flight checks as the labels."""
    if isinstance(batch, (tuple, list)) and len(batch) >= 2 and isinstance(batch[-1], torch.Tensor):
        return batch[-1]
    return None


def as_loss_output(output: Any, loss_fn: Any = None) -> dict[str, Any]:
    """The loss contract, normalised. Every result has "loss" (the micro-batch's mean, for logging and checks)
    and "objective" (what is back-propagated: the mean, or the sum); a sum also has "items" (its 0-dim count).
    `loss_fn` only names the function in errors."""
    name = getattr(loss_fn, "__qualname__", None) or type(loss_fn).__name__ if loss_fn is not None else "loss_fn"
    if isinstance(output, torch.Tensor):
        output = {"loss": output}
    if not isinstance(output, Mapping) or not ({"loss", "loss_sum"} & set(output)):
        raise TypeError(f"the loss function {name} must return a scalar tensor or a mapping with 'loss' (the "
                        "mean over the micro-batch) or 'loss_sum' and 'num_items' (a sum over items and their "
                        f"count); it returned {type(output).__name__}"
                        + (f" with keys {sorted(output)}" if isinstance(output, Mapping) else "") + ".")
    out = dict(output)
    if "loss_sum" in out:
        total, count = out["loss_sum"], out.get("num_items")
        if not isinstance(total, torch.Tensor) or count is None:
            raise TypeError(f"the loss function {name} returned 'loss_sum' as {type(total).__name__} and "
                            f"'num_items' as {type(count).__name__}: return both, 'loss_sum' as a tensor (per "
                            "sample [B] or summed) and 'num_items' as its item count (a tensor or an int).")
        out["objective"] = total.sum()
        out["items"] = torch.as_tensor(count, device=total.device).sum().float()
        out["loss"] = out["objective"].detach().float() / out["items"].clamp(min=1)
        return out
    if not isinstance(out["loss"], torch.Tensor):
        raise TypeError(f"the loss function {name} returned 'loss' as {type(out['loss']).__name__} "
                        f"({out['loss']!r}); return a tensor that carries the graph, e.g. {{'loss': losses.mean()}}.")
    out["objective"] = out["loss"]
    return out


def check_keyword_batch(batch) -> None:
    """The default loss calls model(**batch): a tuple batch, or text the collator left untokenized, is refused
    naming what to change."""
    if not isinstance(batch, Mapping):
        kind = f"a {type(batch).__name__} of {len(batch)}" if isinstance(batch, (tuple, list)) else \
            type(batch).__name__
        raise ConfigError(f"loss_fn=None uses a transformers model's own loss, which takes the batch as keyword "
                          f"arguments (a dict with input_ids, labels, ...); this batch is {kind}. For (inputs, "
                          "targets) batches pass your loss: train(..., loss_fn=lambda model, batch: "
                          "torch.nn.functional.cross_entropy(model(batch[0]), batch[1])).")
    text = [k for k, v in batch.items() if isinstance(v, (list, tuple)) and v and isinstance(v[0], str)]
    if text:
        raise ConfigError(f"the batch holds text under {', '.join(map(repr, text))}: a model takes tensors. Tokenize "
                          "in the dataset's map() or the collate_fn (DataCollatorWithPadding(tokenizer)), and drop "
                          "the text columns (remove_columns=...).")


def default_loss(label_smoothing: float = 0.0, chunk_size: int = 0) -> Callable:
    """The loss for transformers models, which take the batch as keyword arguments:

    * per-token integer labels [B, L] (causal LM, seq2seq, token classification): the token cross-entropy as
      per-sample sums and counts ({"loss_sum", "num_items"}; -100 ignored; for a causal LM the labels are
      shifted by one as the model's own loss does), so the loop normalises by the tokens of the whole window.
      `chunk_size` > 0 (causal LMs): from the hidden states in chunks of that many tokens, never the whole
      logits (chunked_loss.py), checked against the model's own logits on the first batch;
    * one label per sample: the model's own loss (its mean), or cross-entropy with `label_smoothing`, with
      per-sample losses so that evaluation is exact (a regression model's squared errors, the mean over its
      outputs: its MSELoss per sample; a multi-label model's binary cross-entropy, the mean over its labels).
    """
    unchecked = [bool(chunk_size)]

    def loss_fn(model, batch):
        check_keyword_batch(batch)
        labels = batch.get("labels")
        if labels is not None and labels.ndim >= 2 and not labels.is_floating_point():
            if chunk_size and is_causal_lm(model):
                if unchecked[0]:  # once: a model that changes its logits after the output layer is refused
                    check_chunked_loss(model, batch)
                    unchecked[0] = False
                return chunked_causal_loss(model, batch, chunk_size, label_smoothing)
            return token_loss(model, batch, label_smoothing)
        classification = labels is not None and not labels.is_floating_point() and labels.ndim == 1
        if label_smoothing and classification:
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
            per_sample = torch.nn.functional.cross_entropy(
                logits.float(), labels, label_smoothing=label_smoothing, reduction="none"
            )
            return {"loss": per_sample.mean(), "per_sample_loss": per_sample, "logits": logits}
        out = model(**batch)
        result = {"loss": out.loss, "logits": out.logits}
        if classification and out.logits.ndim == 2 and out.logits.shape[-1] > 1:
            result["per_sample_loss"] = torch.nn.functional.cross_entropy(
                out.logits.detach().float(), labels, reduction="none"
            )
        elif labels is not None and problem_type(model) == "regression":  # the model's MSELoss, per sample
            errors = out.logits.detach().float().reshape(len(labels), -1) - labels.float().reshape(len(labels), -1)
            result["per_sample_loss"] = (errors**2).mean(1)
        elif labels is not None and problem_type(model) == "multi_label_classification":  # its BCEWithLogitsLoss
            result["per_sample_loss"] = torch.nn.functional.binary_cross_entropy_with_logits(
                out.logits.detach().float(), labels.float(), reduction="none").reshape(len(labels), -1).mean(1)
        return result

    if label_smoothing:  # evaluated, and judged by the overfit check, as the plain NLL / cross-entropy
        loss_fn.evaluation_loss = default_loss(0.0, chunk_size)
    return loss_fn


def problem_type(model) -> str | None:
    """A transformers classification model's `config.problem_type` ("regression", "single_label_classification",
    ...; set by its first forward where it was not given), else None."""
    return getattr(getattr(extract_model_from_parallel(model), "config", None), "problem_type", None)


def is_causal_lm(model) -> bool:
    """A generating model that is not an encoder-decoder: position t predicts token t + 1."""
    bare = extract_model_from_parallel(model)
    return not getattr(getattr(bare, "config", None), "is_encoder_decoder", False) and hasattr(bare, "generate")


def loss_hooks(*objects: Any) -> list[Any]:
    """The hooks a loss or metrics object declares (`obj.hooks`), for the session to register."""
    return [hook for obj in objects for hook in (getattr(obj, "hooks", None) or ())]


def check_loss(loss_fn: Callable, config) -> None:
    """What the run's loss declares it cannot do, refused with its own message before anything is written: gradient
    accumulation (a loss that couples the whole batch), label smoothing (a loss without it: check_label_smoothing).
    The session calls it for every loss; a recipe may call check_label_smoothing earlier, where it builds its loss."""
    refuse = getattr(loss_fn, "refuse_accumulation", None)
    if config.gradient_accumulation_steps > 1 and refuse is not None:
        raise ConfigError(refuse(config.gradient_accumulation_steps))
    check_label_smoothing(loss_fn, config.label_smoothing_factor)


def check_label_smoothing(loss_fn: Callable, factor: float) -> None:
    """A loss without label smoothing refuses --label_smoothing_factor > 0, with its own message (module docstring).
    A recipe calls it where it builds its loss, before anything is written."""
    refuse = getattr(loss_fn, "refuse_label_smoothing", None)
    if factor and refuse is not None:
        raise ConfigError(refuse(factor))


def evaluation_loss(loss_fn: Callable) -> Callable:
    """The loss an evaluation computes: `loss_fn.evaluation_loss` when the loss function has one (its objective
    without training-only terms such as label smoothing or mixup), else `loss_fn` itself.

        def loss_fn(model, batch): ...                     # smoothed cross-entropy
        loss_fn.evaluation_loss = plain_cross_entropy      # what eval_loss, best model and early stopping follow
    """
    return getattr(loss_fn, "evaluation_loss", None) or loss_fn


def token_loss(model, batch: Mapping[str, torch.Tensor], label_smoothing: float = 0.0) -> dict[str, torch.Tensor]:
    """Per-sample token cross-entropy sums and counts of a transformers model with per-token labels."""
    labels = batch["labels"]
    bare = extract_model_from_parallel(model)
    encoder_decoder = bool(getattr(getattr(bare, "config", None), "is_encoder_decoder", False))
    # an encoder-decoder builds its decoder inputs from the labels; other models must not see them (no 2nd loss)
    inputs = dict(batch) if encoder_decoder else {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    if is_causal_lm(model):
        logits, labels = logits[:, :-1], labels[:, 1:]
    # one row of classes per token: cross_entropy over (batch, classes, tokens), a transposed view, took 1.8x the
    # time forward and backward on CPU (16 x 63 tokens x 8,000 classes: 56 ms against 31)
    losses = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                               ignore_index=IGNORE_INDEX, label_smoothing=label_smoothing,
                                               reduction="none").view(labels.shape)
    counted = labels != IGNORE_INDEX
    return {"loss_sum": (losses * counted).sum(dim=1), "num_items": counted.sum(dim=1)}


def weigh_by_examples(out: dict[str, Any], examples: int) -> dict[str, Any]:
    """A mean loss (`as_loss_output`) as the sum over its micro-batch's `examples`: the objective times their count,
    which becomes its "items". For micro-batches of unequal sizes (--max_tokens_per_batch's) several to a step,
    accumulated or on several processes, the step is then the mean over the step's examples, as one batch of them,
    not over its micro-batches (where an example alone in one would weigh as much as a hundred in another). A sum
    loss is returned as it is; "loss" stays the micro-batch's mean."""
    if "items" in out:
        return out
    objective = out["objective"]
    return {**out, "objective": objective * examples,
            "items": torch.tensor(float(examples), device=objective.device)}


class Window:
    """What one accumulation window fed back: its micro-batches and, for sums, its item count (on the device).
    `scale_gradients` turns the gradients Accelerate and DDP left into the exact step gradient (module docstring)."""

    def __init__(self, accelerator):
        self.accelerator = accelerator
        self.reset()

    def reset(self) -> None:
        self.micro_batches = 0
        self.items: torch.Tensor | None = None  # sums only
        self.means = 0

    def add(self, out: Mapping[str, Any]) -> None:
        self.micro_batches += 1
        if "items" in out:
            # refused before training where the first batch shows sums (sharded.refuse_sum_loss); here a stream's
            refuse_sums_under_deepspeed(self.accelerator, "the loss function")
            self.items = out["items"] if self.items is None else self.items + out["items"]
        else:
            self.means += 1
        if self.items is not None and self.means:
            raise TypeError("a loss function returned a mean ('loss') for some micro-batches and a sum ('loss_sum') "
                            "for others in one accumulation window: return one kind.")

    def scale_gradients(self, model: torch.nn.Module) -> torch.Tensor | None:
        """Scale the accumulated gradients to the step gradient; for sums, return the window's global item count
        (a 0-dim tensor on the device: no host sync here), else None. Call once the window's gradients are
        synchronised, before clipping; then `reset`."""
        acc, gas = self.accelerator, self.accelerator.gradient_accumulation_steps
        if self.items is None:
            if self.micro_batches and self.micro_batches != gas:  # a short last window
                _scale(model, gas / self.micro_batches)
            return None
        total = acc.reduce(self.items.detach().clone(), reduction="sum") if acc.num_processes > 1 else self.items
        _scale(model, torch.where(total > 0, gas * acc.num_processes / total.clamp(min=1), torch.zeros_like(total)))
        return total


def _scale(model: torch.nn.Module, factor: float | torch.Tensor) -> None:
    """Multiply every gradient by `factor` (a float, or a 0-dim tensor kept on the device)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads and isinstance(factor, torch.Tensor) and any(hasattr(g, "to_local") for g in grads):
        factor = float(factor)  # FSDP2's DTensor gradients take a number, not a plain tensor
    for grad in grads:
        grad.mul_(factor)
