"""The fusion model's training objective: contrastive (ITC) + image-text matching (ITM) on hard negatives
mined from the global batch, weighted fixed or learned.

Hard negatives (ALBEF, Li et al. 2021; over the *global* batch as BLIP does): each image of this process gets
one caption and each caption one image from the whole gathered batch, drawn with probability
softmax(ITC similarity x logit scale) among the items that are *not* its positive (same image, or an
identical caption, on any process). The draw uses one uniform number per row of the global batch from a
generator seeded by (seed, step), so N processes x B draw what 1 process x N*B draws. The negatives' image
tokens and text states are gathered with `gather_with_grad`: the ITM loss of a pair whose halves live on
two processes sends each half its gradient, as the contrastive loss does for embeddings.

Weighting: ``fixed`` (loss = sum_t w_t L_t) or ``uncertainty`` (Kendall, Gal & Cipolla 2018, for
classification losses: loss = sum_t exp(-s_t) L_t + s_t / 2, with s_t = log sigma_t^2 learned by the model).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn import functional as F

from ...core.data import seeded_generator
from ...errors import ConfigError
from .collectives import gather_plain, gather_with_grad, longest, pad_to, rank, repeated_columns, world_size
from .contrastive_loss import ImageTextLoss, StepClock, clip_loss

TASKS = ("itc", "itm")
EVAL_STREAM = 2**31  # the generator stream of evaluation negatives: no training step reaches it


def gather_text(states: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Text states [B, L, H] (with gradients) and masks [B, L] of every process, padded to the longest L."""
    length = longest(states)
    return gather_with_grad(pad_to(states, length))[0], gather_plain(pad_to(mask, length))


def gather_caption_sets(caption_sets: torch.Tensor) -> torch.Tensor:
    """Every process's caption-id sets [B, K] (-1 fills a short set), padded with -1 to the largest K."""
    k = longest(caption_sets)
    pad = caption_sets.new_full((len(caption_sets), k - caption_sets.shape[1]), -1)
    return gather_plain(torch.cat([caption_sets, pad], 1))


def positives(image_ids: torch.Tensor, caption_sets: torch.Tensor, other_image_ids: torch.Tensor,
              other_captions: torch.Tensor) -> torch.Tensor:
    """[B, G]: whether caption `other_captions[g]` (shown with image `other_image_ids[g]`) is a positive for
    image b: the same image, or one of image b's own captions (`caption_sets[b]`, ids, -1 for none) — so an
    identical caption of another image, or another of this image's captions, is never a negative."""
    same_image = image_ids[:, None] == other_image_ids[None, :]
    own_caption = (caption_sets[:, :, None] == other_captions[None, None, :]).any(1)
    return same_image | own_caption


def sample_negatives(similarity: torch.Tensor, forbidden: torch.Tensor, uniform: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(one column per row [B], whether the row had any allowed column [B]).

    Row b draws column j with probability softmax(similarity[b]) restricted to ~forbidden[b], by inverse
    CDF with uniform[b] in (0, 1]: the first column whose cumulative probability reaches uniform[b] x total.
    A forbidden column has probability exactly 0, so it can never be the first to reach a positive target."""
    logits = similarity.float().masked_fill(forbidden, float("-inf"))
    valid = ~forbidden.all(1)
    probs = torch.softmax(logits.masked_fill(~valid[:, None], 0.0), 1).masked_fill(forbidden, 0.0)
    cdf = probs.cumsum(1)
    target = uniform.to(cdf) * cdf[:, -1]
    index = (cdf < target[:, None]).sum(1).clamp_max(similarity.shape[1] - 1)
    return index, valid


def uniform_draws(seed: int, step: int, rows: int, offset: int, count: int, device) -> torch.Tensor:
    """`count` numbers in (0, 1] for rows offset.. of a global batch of `rows`: a function of (seed, step) alone."""
    generator = seeded_generator(seed, step)
    return (1 - torch.rand(rows, generator=generator))[offset:offset + count].to(device)


class HardNegativePairs:
    """The `itm_pairs` callable for one batch: given the model's outputs for B local pairs, it returns the
    3B pairs to match — [positives; (image b, a hard caption); (a hard image, caption b)] — with the image
    tokens and text states gathered across processes (gradients flow back to their owners).

    A positive of image b is any caption in `caption_sets[b]` (all of its captions' ids; default: the caption
    shown with it) or any item of the same image; a positive of caption b is any image that has it among its
    captions. After the call, `valid` [2B] says which negatives exist (a row whose every candidate is a
    positive has none), `negative_image_ids` / `negative_caption_ids` [B] name what was drawn (in the global batch) and
    `features` holds the towers' outputs as the model computed them (under DDP looking for unused
    parameters, the forward's returned tensors are copies that the losses do not flow through). With
    `match=False` it only records `features` and names no pairs (the model then computes no ITM logits). The
    columns of the global batch that `excluded` [G] marks (`repeated_columns`) are never drawn."""

    def __init__(self, image_ids: torch.Tensor, caption_ids: torch.Tensor, seed: int, step: int,
                 caption_sets: torch.Tensor | None = None, match: bool = True, excluded: torch.Tensor | None = None):
        self.image_ids, self.caption_ids, self.seed, self.step = image_ids, caption_ids, seed, step
        self.match, self.excluded = match, excluded
        self.caption_sets = caption_ids[:, None] if caption_sets is None else caption_sets
        self.valid: torch.Tensor | None = None
        self.features: tuple[torch.Tensor, ...] = ()

    def __call__(self, out: Mapping[str, torch.Tensor]):
        self.features = (out["image_tokens"], out["text_states"])
        if not self.match:  # the contrastive stage of a two-stage schedule: the features only, no pairs to match
            return None
        images, texts = out["image_embeds"].detach().float(), out["text_embeds"].detach().float()
        all_images, all_texts = gather_plain(images), gather_plain(texts)
        all_image_ids, all_caption_ids = gather_plain(self.image_ids), gather_plain(self.caption_ids)
        b, g = len(images), len(all_images)
        offset = g // world_size() * rank()
        # image b against every caption; caption b against every image (whose own captions may include it)
        text_forbidden = positives(self.image_ids, self.caption_sets, all_image_ids, all_caption_ids)
        image_forbidden = positives(all_image_ids, gather_caption_sets(self.caption_sets), self.image_ids,
                                    self.caption_ids).T
        if self.excluded is not None:
            text_forbidden = text_forbidden | self.excluded
            image_forbidden = image_forbidden | self.excluded
        scale = out["logit_scale"].detach().float()
        draws = [uniform_draws(self.seed, 2 * self.step + i, g, offset, b, images.device) for i in (0, 1)]
        text_of_image, text_ok = sample_negatives(scale * images @ all_texts.T, text_forbidden, draws[0])
        image_of_text, image_ok = sample_negatives(scale * texts @ all_images.T, image_forbidden, draws[1])
        self.valid = torch.cat([text_ok, image_ok])
        self.negative_caption_ids = all_caption_ids[text_of_image]
        self.negative_image_ids = all_image_ids[image_of_text]
        tokens = gather_with_grad(out["image_tokens"])[0]
        states, mask = gather_text(out["text_states"], out["text_mask"])
        own = torch.arange(offset, offset + b, device=images.device)
        image_rows = torch.cat([own, own, image_of_text])
        text_rows = torch.cat([own, text_of_image, own])
        return tokens[image_rows], states[text_rows], mask[text_rows]


def itm_loss(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-pair ITM loss [B] from the 3B logits [positives; hard captions; hard images]: the mean of the three
    binary cross-entropies (a missing negative counts 0), so the batch mean is exact under N processes."""
    b = len(logits) // 3
    targets = torch.cat([torch.ones(b), torch.zeros(2 * b)]).to(logits)
    bce = F.binary_cross_entropy_with_logits(logits.float(), targets, reduction="none")
    return (bce[:b] + (bce[b:] * valid.to(bce)).view(2, b).sum(0)) / 3


def parse_loss_weights(text: str) -> dict[str, float]:
    """'itc=1,itm=0.5' -> {"itc": 1.0, "itm": 0.5}; every task needs a weight >= 0, not all 0."""
    weights: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, value = part.partition("=")
        try:
            weights[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"--loss_weights {text!r}: '{part}' is not task=number (e.g. itc=1,itm=1).") from None
    if set(weights) != set(TASKS) or any(w < 0 for w in weights.values()) or not any(weights.values()):
        raise ConfigError(f"--loss_weights {text!r}: give a weight >= 0 for each of {', '.join(TASKS)} (not all 0), "
                          "e.g. itc=1,itm=1.")
    return {t: weights[t] for t in TASKS}


def weigh(per_task: Mapping[str, torch.Tensor], weights: Mapping[str, float],
          log_vars: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(per-sample total [B], each task's effective weight as a tensor, with its gradient where learned).
    Fixed: sum_t w_t L_t. Uncertainty (`log_vars` s_t in TASKS order): sum_t exp(-s_t) L_t + s_t / 2
    (Kendall et al. 2018, eq. 10, the form for classification losses)."""
    if log_vars is None:
        effective = {t: per_task[t].new_tensor(weights[t]) for t in TASKS}
        return sum(effective[t] * per_task[t] for t in TASKS), effective
    effective = {t: torch.exp(-log_vars[i].float()) for i, t in enumerate(TASKS)}
    return sum(effective[t] * per_task[t] + log_vars[i].float() / 2 for i, t in enumerate(TASKS)), effective


def task_grad_norms(losses: Mapping[str, torch.Tensor], shared: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The norm of each weighted task loss's gradient with respect to the towers' outputs (what both tasks
    share) over the whole global batch; the same on 1 and N processes. Each process differentiates its own
    loss with respect to its own rows (the gathers' backward adds the other processes' terms for them); DDP's
    objective is the mean of the N per-process losses, so its gradient's norm is the square root of the
    squares summed over processes (one all-reduce), divided by N. 0 while both towers are frozen."""
    shared = [s for s in shared if s.requires_grad]
    squares = []
    for loss in losses.values():
        reaches = shared and loss.requires_grad  # a task idle in this stage of a two-stage schedule: norm 0
        grads = torch.autograd.grad(loss, shared, retain_graph=True, allow_unused=True) if reaches else []
        zero = torch.zeros((), device=loss.device)
        squares.append(sum(((g.float() ** 2).sum() for g in grads if g is not None), zero))
    squares = torch.stack(squares)
    if world_size() > 1:
        dist.all_reduce(squares)
    norms = squares.sqrt() / world_size()
    return {t: norms[i] for i, t in enumerate(losses)}


class FusionLoss(ImageTextLoss):
    """`loss_fn(model, batch)` for `train()` with a `FusionEncoder` and `ImageTextCollator` batches.

    Training: each image's caption for the epoch (`draw_captions`), `train_transform` on the images,
    optional token dropout on the captions, then ITC (`clip_loss` over the global batch) + ITM on the
    positives and one hard negative per image and per caption, weighted. Returns {"loss", "log"}; "log"
    holds each task's loss, effective weight and (with `grad_norms`) gradient norm as 0-dim tensors.
    Evaluation: each pair's own caption, `eval_transform`; returns the per-pair weighted loss and, for
    `FusionMetrics`, the embeddings, ids, image tokens and text states padded to `text_length`."""

    objective = "InfoNCE over the global batch and image-text matching on hard negatives"

    def __init__(self, train_transform: Callable, eval_transform: Callable, *, seed: int, num_train_images: int,
                 text_length: int, weights: Mapping[str, float] | None = None, clock: StepClock | None = None,
                 freeze_steps: Mapping[str, int] | None = None, token_dropout: float = 0.0,
                 grad_norms: bool = True, contrastive_steps: int = 0):
        if not 0 <= token_dropout < 1:
            raise ConfigError(f"--token_dropout {token_dropout}: must be in [0, 1).")
        if contrastive_steps < 0:
            raise ConfigError(f"--contrastive_steps {contrastive_steps}: must be >= 0 (0: one stage).")
        super().__init__(train_transform, eval_transform, seed, num_train_images, clock, freeze_steps)
        self.text_length, self.token_dropout, self.grad_norms = text_length, token_dropout, grad_norms
        self.weights = dict(weights or {t: 1.0 for t in TASKS})
        self.contrastive_steps = contrastive_steps

    @property
    def leaves_parameters_unused(self) -> bool:
        """A frozen tower, or a stage that idles one half of the model, leaves parameters without a gradient."""
        return super().leaves_parameters_unused or self.contrastive_steps > 0

    def refuse_accumulation(self, steps: int) -> str:
        return (f"--gradient_accumulation_steps {steps}: the contrastive loss and the hard negatives of a micro-batch "
                "come from fewer pairs than the batch it stands for, so accumulation is refused; raise "
                "--per_device_train_batch_size or the number of processes.")

    def stage(self) -> str:
        """"joint" (one stage), or with `contrastive_steps` N: "itc" for the first N optimizer steps (ITC alone,
        the fusion half idle), then "itm" (towers, projections and temperature fixed; the fusion half learns
        ITM alone on hard negatives from the now fixed ITC similarities)."""
        if not self.contrastive_steps:
            return "joint"
        return "itc" if self.clock.step < self.contrastive_steps else "itm"

    def __call__(self, model, batch: Mapping[str, torch.Tensor]):
        training = model.training
        stage = self.stage() if training else "joint"
        images, ids, input_ids, mask, caption_ids = self.pairs(batch, training)
        if training and self.token_dropout:
            mask = drop_tokens(mask, self.token_dropout)
        # evaluation draws its negatives from a fixed stream: the same pairs at every evaluation
        repeats = None if training else repeated_columns(len(ids) * world_size(), images.device)
        pairs = HardNegativePairs(ids, caption_ids, self.seed, self.clock.step if training else EVAL_STREAM,
                                  caption_sets=batch["caption_ids"], match=stage != "itc", excluded=repeats)
        frozen = self.frozen() if training else frozenset()
        if stage == "itm":
            frozen = frozen | {"text", "vision"}
        out = model(pixel_values=images, input_ids=input_ids, attention_mask=mask, frozen=frozen, itm_pairs=pairs)
        if stage == "itm":  # nothing reaches the projections or the temperature: AdamW leaves them as they are
            out = {**out, **{k: out[k].detach() for k in ("image_embeds", "text_embeds", "logit_scale")}}
        per_task = {"itc": clip_loss(out["image_embeds"], out["text_embeds"], out["logit_scale"], ids, caption_ids,
                                     repeats)[1]}
        per_task["itm"] = (per_task["itc"].new_zeros(len(ids)) if stage == "itc"
                           else itm_loss(out["itm_logits"], pairs.valid))
        weights = self.weights if stage == "joint" else {t: float(t == stage) for t in TASKS}
        total, weights = weigh(per_task, weights, out.get("task_log_vars"))
        if not training:
            return {"loss": total.mean(), "per_sample_loss": total, "image_ids": ids, "caption_ids": caption_ids,
                    "image_embeds": out["image_embeds"].float(), "text_embeds": out["text_embeds"].float(),
                    "image_tokens": out["image_tokens"].float(),
                    "text_states": pad_to(out["text_states"].float(), self.text_length),
                    "text_mask": pad_to(out["text_mask"], self.text_length)}
        log = {}
        for t in TASKS:
            log[f"{t}_loss"], log[f"{t}_weight"] = per_task[t].detach().mean(), weights[t].detach()
        if self.grad_norms:
            norms = task_grad_norms({t: weights[t] * per_task[t].mean() for t in TASKS}, list(pairs.features))
            log.update({f"{t}_grad_norm": norms[t] for t in TASKS})
        return {"loss": total.mean(), "log": log}


def drop_tokens(mask: torch.Tensor, p: float) -> torch.Tensor:
    """Text augmentation: hides each token from both towers' attention with probability p, except the first
    and the last real token ([CLS] and [SEP] for BERT-like tokenizers), which stay."""
    positions = torch.arange(mask.shape[1], device=mask.device)[None]
    first = mask.argmax(1)[:, None]  # the first real token of each row (left or right padding)
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)[:, None]
    keep = (torch.rand(mask.shape, device=mask.device) >= p) | (positions == first) | (positions == last)
    return mask * keep.to(mask.dtype)


@dataclass(frozen=True)
class FusionTaskArguments:
    """The fusion recipe's two tasks (ITC, ITM), their weighting and the evaluation's re-ranking."""

    loss_weights: str = field(default="itc=1,itm=1", metadata={"help": "Fixed task weights, task=weight pairs."})
    loss_weighting: str = field(default="fixed", metadata={
        "help": "fixed (--loss_weights) or uncertainty: learned homoscedastic-uncertainty weights (Kendall et al. "
                "2018), starting at 1."})
    log_task_grad_norms: bool = field(default=True, metadata={
        "help": "Log each weighted task loss's gradient norm at the towers' outputs (two partial backward passes)."})
    rerank_k: int = field(default=16, metadata={"help": "ITC candidates per query re-ranked by ITM."})
    contrastive_steps: int = field(default=0, metadata={
        "help": "Two-stage schedule: the first N optimizer steps train ITC alone; then the towers, projections and "
                "temperature stay fixed and the fusion layers and ITM head learn ITM alone. 0: both tasks together."})

    def __post_init__(self):
        weights = parse_loss_weights(self.loss_weights)
        if self.loss_weighting not in ("fixed", "uncertainty"):
            raise ConfigError(f"--loss_weighting {self.loss_weighting!r}: choose fixed or uncertainty.")
        if self.loss_weighting == "uncertainty" and set(weights.values()) != {1.0}:
            raise ConfigError(f"--loss_weights {self.loss_weights} with --loss_weighting uncertainty: the learned "
                              "weights replace the fixed ones; leave --loss_weights at itc=1,itm=1.")
        if self.contrastive_steps and self.loss_weighting != "fixed":
            raise ConfigError(f"--contrastive_steps {self.contrastive_steps} with --loss_weighting "
                              f"{self.loss_weighting}: the two stages train one task each, so there is nothing to "
                              "weigh; use --loss_weighting fixed.")
        if self.contrastive_steps < 0:
            raise ConfigError(f"--contrastive_steps {self.contrastive_steps}: must be >= 0 (0: one stage).")
        if self.rerank_k < 1:
            raise ConfigError(f"--rerank_k {self.rerank_k}: must be >= 1.")
