"""Chunked cross-entropy for a language model's output layer: the token loss from the hidden states, `chunk` tokens
at a time, never the whole [tokens, vocab] logits.

The full loss holds the logits of every token (and their float copy, log-softmax and gradient: at batch 4, sequence
1024 and vocabulary 32k, each is 0.5 GB in fp32). Here the output layer's input is taken from the model's forward
(a pre-hook on `get_output_embeddings()` that hands the layer an empty slice, so the model computes no logits), and
`LinearCrossEntropy` computes, chunk by chunk, the logits, their loss and at once their gradient with respect to
the hidden states and the layer's weight (the gradient of a sum of token losses is known in the forward pass:
softmax - one-hot), so neither the logits nor a recomputation are needed in the backward pass. Its result enters
the loss contract as every token loss does (a sum and its count), so accumulation and processes stay exact.

Mixed precision: Accelerate autocasts the prepared model's forward only, and the loop calls the loss outside it. The
chunks compute in the dtype the output layer would have computed in, read where it would have run (inside the
forward: `HeadInput.dtype`), wherever the loss is called from: bf16 matmuls in a bf16 run, as the full logits'.

What it cannot see: a model that changes its logits after the output layer (soft-capping, a logit scale). Such
config fields are refused by name, and the first call compares the logits the chunks compute with the model's own
on a slice of the batch, in the same dtype, and refuses with the reason when they differ by more than that dtype's
rounding (`probe_tolerance`). FSDP2 shards the output layer's weight, which the chunks would use directly without
the all-gather the layer's own forward does: the recipe refuses the combination before training.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from accelerate.utils import extract_model_from_parallel

from ..errors import ConfigError

# Config fields of models that change their logits after the output layer (Gemma 2's soft-capping, Cohere's scale,
# Granite's divisor): refused by name, since on a small probe their effect can be below any tolerance.
LOGIT_CHANGES = ("final_logit_softcapping", "logit_scale", "logits_scaling")
PROBE_TOKENS = 32  # the slice of the first batch the chunked loss is checked on against the model's own logits
PROBE_ULPS = 4  # the probe's tolerance, in units of the dtype's rounding (probe_tolerance)


def forward_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast computes matrix products in, here and now, on `device` (None: no autocast)."""
    kind = device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def probe_tolerance(dtype: torch.dtype, width: int) -> float:
    """How far, relative to the largest logit, the chunks' logits may be from the model's own when both are the
    same `width`-term dot products computed in `dtype` (accumulated in fp32, as bf16 / fp16 matrix products are on
    CPUs and GPUs): each result is rounded to `dtype` once, at most one unit in the last place (eps(dtype) of the
    logit), and another kernel may sum the terms in another order, at most width x eps(fp32) of their sum (the
    worst-case bound, taken of the largest logit). PROBE_ULPS of that: 3.1% under bf16, 1.6e-5 in fp32 at width 32,
    2.0e-3 at width 4096 — a logit scale or a soft-capping (factors, tanh) moves the largest logit by more; the known
    ones are refused by their config field whatever the probe sees."""
    return PROBE_ULPS * (torch.finfo(dtype).eps + width * torch.finfo(torch.float32).eps)


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits of `hidden` [n, H] by an output layer whose `weight` and `bias` are already in its compute dtype:
    the product in that dtype, as the layer's own under autocast."""
    return torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias).float()


def compute_weights(weight: torch.Tensor, bias: torch.Tensor | None,
                    dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output layer's weight and bias in `dtype` (None: as they are): cast once for all chunks, as autocast casts
    the layer's own once for its whole input."""
    if dtype is None:
        return weight, bias
    return weight.to(dtype), None if bias is None else bias.to(dtype)


def _chunk_loss(logits: torch.Tensor, labels: torch.Tensor, smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy of fp32 `logits` [n, V] (0 where the label is -100), as torch's with smoothing,
    and the log-sum-exp of each row."""
    valid = labels != -100
    lse = logits.logsumexp(-1)
    nll = lse - logits.gather(1, labels.clamp(min=0)[:, None])[:, 0]
    loss = (1 - smoothing) * nll + smoothing * (lse - logits.mean(-1)) if smoothing else nll
    return loss * valid, lse


class LinearCrossEntropy(torch.autograd.Function):
    """Σ over tokens of cross_entropy(hidden @ weight.T + bias, labels), chunk by chunk, with the gradients
    computed in the forward pass; the matrix products in `dtype` (None: the weight's), the softmax and the sums in
    fp32. Returns the sum (with its graph) and the per-token losses (no graph)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk: int, smoothing: float, dtype: torch.dtype | None):
        per_token = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if weight.requires_grad else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and bias.requires_grad else None
        vocab = weight.shape[0]
        w, b = compute_weights(weight, bias, dtype)
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start:start + chunk].to(w.dtype), labels[start:start + chunk]
            logits = chunk_logits(h, w, b)
            loss, lse = _chunk_loss(logits, y, smoothing)
            per_token[start:start + chunk] = loss
            # d loss / d logits = softmax - (1 - smoothing) one-hot - smoothing / V, on the counted tokens; the
            # softmax in place of the logits (one [chunk, V] buffer, not two)
            grad = logits.sub_(lse[:, None]).exp_()
            rows = torch.arange(len(y), device=y.device)
            grad[rows, y.clamp(min=0)] -= 1 - smoothing
            if smoothing:
                grad -= smoothing / vocab
            grad *= (y != -100)[:, None]
            # the products as the full loss's backward runs them: the logits' gradient reaches the output layer in
            # its compute dtype (the backward of the logits' float()), and its products run in that dtype
            grad = grad.to(w.dtype)
            if grad_hidden is not None:
                grad_hidden[start:start + chunk] = (grad @ w).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += (grad.T @ h).float()
            if grad_bias is not None:
                grad_bias += grad.sum(0).float()
        ctx.save_for_backward(*(g for g in (grad_hidden, grad_weight, grad_bias) if g is not None))
        ctx.present = (grad_hidden is not None, grad_weight is not None, grad_bias is not None)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        total = per_token.sum()
        ctx.mark_non_differentiable(per_token)
        return total, per_token

    @staticmethod
    def backward(ctx, grad_total, _grad_per_token):
        saved = iter(ctx.saved_tensors)
        grads = [next(saved) if present else None for present in ctx.present]
        grad_hidden, grad_weight, grad_bias = (None if g is None else g * grad_total for g in grads)
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.dtypes[0])
        if grad_bias is not None:
            grad_bias = grad_bias.to(ctx.dtypes[1])
        return grad_hidden, grad_weight, grad_bias, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, head: torch.nn.Linear, labels: torch.Tensor, chunk: int,
                         smoothing: float = 0.0, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ token losses, per-token losses) of `head` over `hidden` [N, H] for `labels` [N] (-100 not counted), its
    matrix products in `dtype` (None: the weight's; under mixed precision the forward's, `HeadInput.dtype`)."""
    if torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad):
        return LinearCrossEntropy.apply(hidden, head.weight, head.bias, labels, chunk, smoothing, dtype)
    with torch.no_grad():  # evaluation: the losses only
        weight, bias = compute_weights(head.weight, head.bias, dtype)
        per_token = torch.cat([_chunk_loss(chunk_logits(hidden[s:s + chunk], weight, bias), labels[s:s + chunk],
                                           smoothing)[0] for s in range(0, hidden.shape[0], chunk)])
    return per_token.sum(), per_token


class HeadInput:
    """While active, the model's output layer records its input and computes nothing (an empty slice). `dtype`: the
    autocast dtype in effect where the layer would have run (None: none), which Accelerate sets inside the prepared
    forward only."""

    def __init__(self, head: torch.nn.Module):
        self.head, self.hidden, self.dtype = head, None, None

    def __enter__(self):
        def keep(module, args):
            self.hidden, self.dtype = args[0], forward_dtype(args[0].device)
            return (args[0][..., :0, :],)
        self.handle = self.head.register_forward_pre_hook(keep)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def output_layer(model) -> torch.nn.Linear:
    bare = extract_model_from_parallel(model)
    head = bare.get_output_embeddings() if hasattr(bare, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        raise ConfigError(f"--loss_chunk_size: {type(bare).__name__} has no linear output layer "
                          "(get_output_embeddings()) to compute the loss from in chunks; drop --loss_chunk_size.")
    return head


def chunked_causal_loss(model, batch: Mapping[str, torch.Tensor], chunk: int, smoothing: float = 0.0) -> dict:
    """The token loss of a causal LM (position t predicts token t + 1; -100 not counted) in `chunk`-token pieces:
    {"loss_sum", "num_items"} — the sum and count (training), or per-sample sums and counts (evaluation)."""
    head = output_layer(model)
    labels = batch["labels"]
    with HeadInput(head) as taken:
        model(**{k: v for k, v in batch.items() if k != "labels"})
    hidden = taken.hidden  # [B, L, H]
    shifted = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)  # no copy of the hidden states
    total, per_token = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), head, shifted.reshape(-1), chunk,
                                            smoothing, taken.dtype)
    counted = shifted != -100
    if torch.is_grad_enabled():
        return {"loss_sum": total, "num_items": counted.sum()}
    return {"loss_sum": per_token.view(labels.shape).sum(1), "num_items": counted.sum(1)}


def logit_changes(model) -> dict:
    """The config fields by which `model` changes its logits after the output layer ({} for none)."""
    config = getattr(extract_model_from_parallel(model), "config", None)
    return {name: getattr(config, name) for name in LOGIT_CHANGES if getattr(config, name, None) not in (None, 1, 1.0)}


def check_chunked_loss(model, batch: Mapping[str, torch.Tensor]) -> None:
    """Refuse chunking where the model changes its logits after the output layer: on a slice of `batch`, the output
    layer applied to its input as the chunks apply it (in the forward's dtype) must give the model's own logits,
    within that dtype's rounding (`probe_tolerance`). The same answer wherever it is called from (under
    `accelerator.autocast()` or not, in training mode or not): the model runs in evaluation mode (no dropout mask
    drawn, no random number) and is put back as it was."""
    bare = extract_model_from_parallel(model)
    changes = logit_changes(bare)
    if changes:
        raise ConfigError(f"--loss_chunk_size: {type(bare).__name__} changes its logits after the output layer "
                          f"({', '.join(f'{k}={v}' for k, v in changes.items())}), which the chunks would leave out. "
                          "Train it without --loss_chunk_size (0).")
    rows = {k: v[:1, :PROBE_TOKENS] if isinstance(v, torch.Tensor) and v.ndim >= 2 else v for k, v in batch.items()}
    inputs = {k: v for k, v in rows.items() if k != "labels"}
    head = output_layer(model)
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            own = model(**inputs).logits.float()
            with HeadInput(head) as taken:
                model(**inputs)
            # what the chunks compute
            chunked = chunk_logits(taken.hidden, *compute_weights(head.weight, head.bias, taken.dtype))
    finally:
        for module, training in modes.items():
            module.training = training
    dtype = taken.dtype or head.weight.dtype
    error, scale = float((own - chunked).abs().max()), float(own.abs().max())
    tolerance = probe_tolerance(dtype, head.in_features)
    if error > tolerance * scale:
        raise ConfigError(f"--loss_chunk_size: the logits the chunks compute differ from the model's own by "
                          f"{error:.3g} (of {scale:.3g}; {str(dtype).removeprefix('torch.')} rounding allows "
                          f"{tolerance * scale:.2g}) on the first batch: {type(bare).__name__} changes its logits "
                          "after the output layer (soft-capping, a logit scale). Train it without --loss_chunk_size "
                          "(0).")
