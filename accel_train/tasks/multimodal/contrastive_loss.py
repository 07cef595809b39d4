"""The contrastive loss over the global batch, and the loss function that feeds it to `train()`.

`clip_loss` is symmetric InfoNCE (CLIP): each image must pick its own caption among every caption of the
global batch, and each caption its image. The embeddings of every process are gathered with
`torch.distributed.nn.functional.all_gather`, whose backward sends each process the gradient of every other
process's loss with respect to its embeddings (Accelerate's `gather` carries no gradient). Each process then
computes the loss of its own rows against all columns; DDP's gradient average over processes makes N
processes x B samples give exactly the loss and gradients of 1 process x N*B samples.

`ContrastiveLoss` is the `loss_fn` for the loop. It draws one caption per image and epoch, applies the image
transforms, keeps towers frozen for their first steps, and, with `chunk_size`, computes the loss over the
whole batch while embedding and back-propagating it a chunk at a time (GradCache, Gao et al. 2021): memory of
a chunk, negatives of the whole batch, the same gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import contextmanager, nullcontext

import torch
from torch.nn import functional as F
from torch.utils.checkpoint import get_device_states, set_device_states

from ...core.data import seeded_generator
from ...errors import ConfigError
from .collectives import gather_plain, gather_with_grad, repeated_columns, world_size


def clip_loss(image_embeds: torch.Tensor, text_embeds: torch.Tensor, logit_scale: torch.Tensor,
              image_ids: torch.Tensor | None = None, caption_ids: torch.Tensor | None = None,
              excluded: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss over this process's pairs, per-pair loss [B]): symmetric InfoNCE of this process's B pairs
    against the pairs of the global batch, the mean of image->text and text->image cross-entropy.

    With `image_ids` / `caption_ids` [B], two pairs that share an image or an identical caption are not
    negatives of each other (the evaluation pairs an image with each of its captions; generated captions
    repeat): such logits are left out of the softmax. So are the columns of the global batch that `excluded` [G]
    marks (`repeated_columns`: the pairs that only even out the last evaluation batch); a pair's own stays."""
    images, texts = image_embeds.float(), text_embeds.float()
    all_images, offset = gather_with_grad(images)
    all_texts, _ = gather_with_grad(texts)
    targets = torch.arange(offset, offset + images.shape[0], device=images.device)
    logits_i2t = logit_scale * images @ all_texts.T
    logits_t2i = logit_scale * texts @ all_images.T
    if image_ids is not None or caption_ids is not None or excluded is not None:
        same = torch.zeros_like(logits_i2t, dtype=torch.bool)
        for ids in (image_ids, caption_ids):
            if ids is not None:
                same |= ids[:, None] == gather_plain(ids)[None, :]
        if excluded is not None:
            same |= excluded[None, :]
        same[torch.arange(len(targets), device=targets.device), targets] = False
        logits_i2t = logits_i2t.masked_fill(same, float("-inf"))
        logits_t2i = logits_t2i.masked_fill(same, float("-inf"))
    per_pair = (F.cross_entropy(logits_i2t, targets, reduction="none")
                + F.cross_entropy(logits_t2i, targets, reduction="none")) / 2
    return per_pair.mean(), per_pair


def draw_captions(image_ids: torch.Tensor, num_captions: torch.Tensor, seed: int, epoch: int,
                  num_images: int) -> torch.Tensor:
    """Which caption each image uses this epoch: a function of (seed, epoch, image) alone, so every process,
    any batch order and a resumed run draw the same one."""
    generator = seeded_generator(seed, epoch)
    table = torch.randint(0, 2**31 - 1, (num_images,), generator=generator).to(image_ids.device)
    return table[image_ids] % num_captions


class StepClock:
    """A hook that lends the loss function the loop's live position: `step` (optimizer steps done) and
    `epoch`, from the loop's own state, so they are right after a resume too."""

    def __init__(self):
        self.state = None

    def on_train_start(self, state) -> None:
        self.state = state

    @property
    def step(self) -> int:
        return self.state.step if self.state is not None else 0

    @property
    def epoch(self) -> int:
        return self.state.epoch if self.state is not None else 0


def frozen_towers(freeze_steps: Mapping[str, int], step: int) -> frozenset:
    """The towers frozen at optimizer step `step`: those frozen for the first N steps (N > step) or the whole run
    (N < 0)."""
    return frozenset(tower for tower, n in freeze_steps.items() if n < 0 or step < n)


class ImageTextLoss:
    """What both image-text losses do before their own part: the step clock, tower freezing, and each batch's
    images (train or eval transform) with one caption per image (the epoch's drawn caption in training, the
    pair's own in evaluation). What the session does for it (core/loss.py): registers its clock (`hooks`), refuses
    gradient accumulation (`refuse_accumulation`: the loss is over the global batch), and has DDP expect unused
    parameters while a tower is frozen (`leaves_parameters_unused`); the session refuses --label_smoothing_factor with
    its message (`refuse_label_smoothing`: there is none in these losses)."""

    objective = "symmetric InfoNCE over the global batch"  # what refusals name

    def __init__(self, train_transform: Callable, eval_transform: Callable, seed: int, num_train_images: int,
                 clock: StepClock | None, freeze_steps: Mapping[str, int] | None):
        self.train_transform, self.eval_transform = train_transform, eval_transform
        self.seed, self.num_train_images = seed, num_train_images
        self.clock = clock or StepClock()
        self.freeze_steps = dict(freeze_steps or {})
        self.hooks = (self.clock,)

    @property
    def leaves_parameters_unused(self) -> bool:
        """A tower frozen for some steps gets no gradient then, which DDP must expect."""
        return any(steps != 0 for steps in self.freeze_steps.values())

    def refuse_accumulation(self, steps: int) -> str:
        return accumulation_refusal(steps)

    def refuse_label_smoothing(self, factor: float) -> str:
        """Declared for core/loss.py's check_label_smoothing (the session calls it, check_loss)."""
        return (f"--label_smoothing_factor {factor}: this recipe's loss ({self.objective}) has no label smoothing, so "
                "the flag would change nothing while config.yaml records it; drop it (or set it to 0).")

    def frozen(self) -> frozenset:
        return frozen_towers(self.freeze_steps, self.clock.step)

    def pairs(self, batch: Mapping[str, torch.Tensor], training: bool):
        """(images, image ids, caption input_ids, attention_mask, caption ids) of the batch."""
        images = (self.train_transform if training else self.eval_transform)(batch["pixel_values"])
        ids = batch["image_ids"]
        pick = (draw_captions(ids, batch["num_captions"], self.seed, self.clock.epoch, self.num_train_images)
                if training else torch.zeros_like(ids))
        return (images, ids, *select_captions(batch, pick))


class ContrastiveLoss(ImageTextLoss):
    """`loss_fn(model, batch)` for `train()` with a `DualEncoder` and `ImageTextCollator` batches.

    Training: draws each image's caption for the epoch, transforms the images with `train_transform`, runs
    the towers (those still within their `freeze_steps` without gradients; -1 freezes for the whole run) and
    returns the loss over the global batch. With `chunk_size` smaller than the batch it uses GradCache.
    Evaluation: `eval_transform`, each pair's own caption, and returns the per-pair loss, the embeddings and
    ids for `ContrastiveMetrics`, plus ``zero_shot_logits`` [B, classes] when `prompts` (tokenized class
    prompts, {"input_ids", "attention_mask"}) are given.

    Gradient accumulation is refused (by the session, `refuse_accumulation`): a loss over micro-batches would see
    fewer negatives than the batch asked for. GradCache gives the memory saving without that loss, and is refused
    under DeepSpeed, whose engine steps inside each of its backward passes."""

    def __init__(self, accelerator, train_transform: Callable, eval_transform: Callable, *, seed: int,
                 num_train_images: int, clock: StepClock | None = None, chunk_size: int | None = None,
                 freeze_steps: Mapping[str, int] | None = None, prompts: Mapping[str, torch.Tensor] | None = None):
        if chunk_size is not None and chunk_size < 1:
            raise ConfigError(f"--gradient_cache_chunk_size {chunk_size}: must be >= 1 (or unset).")
        if chunk_size is not None and accelerator.distributed_type.value == "DEEPSPEED":
            raise ConfigError(f"--gradient_cache_chunk_size {chunk_size} under DeepSpeed: the engine steps the "
                              "optimizer inside every backward (its no_sync does nothing for ZeRO >= 2), so each chunk "
                              "would be an optimizer step on its part of the gradient. Train GradCache with DDP or "
                              "FSDP (accelerate_configs/), or drop the flag.")
        super().__init__(train_transform, eval_transform, seed, num_train_images, clock, freeze_steps)
        self.accelerator, self.chunk_size, self.prompts = accelerator, chunk_size, prompts

    def __call__(self, model, batch: Mapping[str, torch.Tensor]):
        training = model.training
        images, ids, input_ids, mask, caption_ids = self.pairs(batch, training)
        if not training:
            return self.evaluate(model, images, input_ids, mask, ids, caption_ids)
        if self.chunk_size and self.chunk_size < len(ids):
            return self.cached_step(model, images, input_ids, mask, ids, caption_ids)
        out = model(pixel_values=images, input_ids=input_ids, attention_mask=mask, frozen=self.frozen())
        return clip_loss(out["image_embeds"], out["text_embeds"], out["logit_scale"], ids, caption_ids)[0]

    def evaluate(self, model, images, input_ids, mask, image_ids, caption_ids) -> dict[str, torch.Tensor]:
        out = model(pixel_values=images, input_ids=input_ids, attention_mask=mask)
        repeats = repeated_columns(len(image_ids) * world_size(), images.device)
        loss, per_pair = clip_loss(out["image_embeds"], out["text_embeds"], out["logit_scale"], image_ids, caption_ids,
                                   repeats)
        result = {"loss": loss, "per_sample_loss": per_pair, "image_embeds": out["image_embeds"].float(),
                  "text_embeds": out["text_embeds"].float(), "image_ids": image_ids, "caption_ids": caption_ids}
        if self.prompts is not None:
            device = images.device  # the prompts are constants kept on the host; the batch is on the device
            prompts = model(input_ids=self.prompts["input_ids"].to(device),
                            attention_mask=self.prompts["attention_mask"].to(device))["text_embeds"]
            result["zero_shot_logits"] = result["image_embeds"] @ prompts.float().T
        return result

    def cached_step(self, model, images, input_ids, mask, image_ids, caption_ids) -> torch.Tensor:
        """GradCache: embed every chunk without a graph, take the gradient of the whole-batch loss with respect
        to the embeddings, then re-run each chunk with its graph and back-propagate that gradient into it.

        The chunks before the last call `accelerator.backward` here, inside `no_sync` (gradients accumulate
        locally); the returned tensor's backward, which the loop runs, back-propagates the last chunk and
        synchronises the gradients across processes once. Its value is the whole-batch loss. Dropout is
        replayed (the RNG state of each chunk's first pass is restored for its second) and the first pass
        leaves buffers (batch-norm statistics) as they were, so the gradients equal those of one graph over
        the chunks."""
        frozen, chunks = self.frozen(), torch.arange(len(image_ids)).split(self.chunk_size)
        rng, parts = [], []
        with torch.no_grad(), _buffers_restored(model):
            for rows in chunks:
                rng.append(_RngState(images))
                parts.append(model(pixel_values=images[rows], input_ids=input_ids[rows], attention_mask=mask[rows],
                                   frozen=frozen))
        img = torch.cat([p["image_embeds"] for p in parts]).float().requires_grad_()
        txt = torch.cat([p["text_embeds"] for p in parts]).float().requires_grad_()
        scale = parts[0]["logit_scale"].detach().float().requires_grad_()
        with torch.enable_grad():
            loss = clip_loss(img, txt, scale, image_ids, caption_ids)[0]
            grad_img, grad_txt, grad_scale = torch.autograd.grad(loss, [img, txt, scale])
        for i, rows in enumerate(chunks):
            last = i == len(chunks) - 1
            rng[i].restore()
            with nullcontext() if last else self.accelerator.no_sync(model):
                out = model(pixel_values=images[rows], input_ids=input_ids[rows], attention_mask=mask[rows],
                            frozen=frozen)
                surrogate = ((out["image_embeds"].float() * grad_img[rows]).sum()
                             + (out["text_embeds"].float() * grad_txt[rows]).sum())
                if not last:
                    self.accelerator.backward(surrogate)
        surrogate = surrogate + out["logit_scale"] * grad_scale  # the temperature's gradient, once
        return surrogate + (loss.detach() - surrogate.detach())


def accumulation_refusal(steps: int) -> str:
    return (f"--gradient_accumulation_steps {steps}: a contrastive loss computed per micro-batch sees {steps}x fewer "
            "negatives than the batch it stands for, so it is refused. For the same memory and every negative, "
            f"multiply --per_device_train_batch_size by {steps} and set --gradient_cache_chunk_size to the current "
            "per-device batch size: the loss is then computed over the whole batch while it is embedded and "
            "back-propagated one chunk at a time (GradCache), with the gradients of the large batch.")


def select_captions(batch: Mapping[str, torch.Tensor], pick: torch.Tensor):
    """The drawn caption of each item: (input_ids, attention_mask) without all-padding columns, caption ids."""
    rows = torch.arange(len(pick), device=pick.device)
    input_ids = batch["caption_input_ids"][rows, pick]
    mask = batch["caption_attention_mask"][rows, pick]
    keep = mask.any(0)  # the padding was for the longest of all K captions; left or right padding alike
    return input_ids[:, keep], mask[:, keep], batch["caption_ids"][rows, pick]


class _RngState:
    """The CPU and device RNG states at one point, to replay dropout exactly (as activation checkpointing does)."""

    def __init__(self, *tensors: torch.Tensor):
        self.cpu = torch.get_rng_state()
        self.devices, self.states = get_device_states(*tensors)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        set_device_states(self.devices, self.states)


@contextmanager
def _buffers_restored(model: torch.nn.Module):
    saved = [(buffer, buffer.clone()) for buffer in model.buffers()]
    try:
        yield
    finally:
        for buffer, copy in saved:
            buffer.copy_(copy)
