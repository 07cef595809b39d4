"""A dual encoder with cross-attention fusion and an image-text matching (ITM) head (ALBEF / BLIP style).

`FusionEncoder` is a `DualEncoder` (the same towers, projections and temperature, the same parameter names,
so `tower_param_groups` and the contrastive loss apply unchanged) plus a small fusion transformer: the
caption's tokens (the text tower's last hidden states) attend to each other and to the tokens of *their own*
image's last feature map (not the pooled vector), and a linear head on the fused first token ([CLS]) says
whether the caption describes the image. The fusion layers and the ITM head are "head" parameters for the
per-tower learning rates.

    model = FusionEncoder(text_model, vision_model, embed_dim=256, fusion_layers=2)
    out = model(pixel_values=x, input_ids=ids, attention_mask=mask)      # embeddings, tokens, states
    logits = model.match(out["image_tokens"], out["text_states"], out["text_mask"])   # [B] ITM logits
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError, ModelError
from ..vision.models import SmallResNet
from .dual_encoder import DualEncoder, PooledVision, frozen_tower, tower_param_groups


def vision_tokens(vision: nn.Module, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tower's last feature map as tokens [B, N, C], the pooled features [B, C] the dual encoder uses).

    The pooled features are computed *from* the returned tokens, so a gradient taken with respect to the
    tokens covers every use of the tower's output. A `SmallResNet` gives its last stage's map (3x3 tokens for
    96x96 inputs); a transformers backbone (`PooledVision`) its last hidden state (patch tokens, or a
    convolutional map flattened), pooled as `PooledVision` pools."""
    if isinstance(vision, SmallResNet):
        tokens = vision.blocks(vision.stem(pixel_values)).flatten(2).transpose(1, 2)
        return tokens, tokens.mean(1)
    if isinstance(vision, PooledVision):
        out = vision.model(pixel_values=pixel_values)
        hidden = out.last_hidden_state
        tokens = hidden.flatten(2).transpose(1, 2) if hidden.ndim == 4 else hidden
        pooled = getattr(out, "pooler_output", None)
        return tokens, (tokens.mean(1) if pooled is None else pooled.flatten(1))
    raise ModelError(f"the vision tower {type(vision).__name__} gives no feature map to fuse: use small_resnet or a "
                     "transformers vision model (--vision_model_type vit / convnext / resnet, or pretrained weights).")


class FusionLayer(nn.Module):
    """One pre-norm block: self-attention over the caption's tokens (padding masked), cross-attention from
    each caption token to the image tokens of the same row, a feed-forward network. Rows never mix."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.1, ffn_multiplier: int = 2):
        super().__init__()
        self.self_norm = nn.LayerNorm(dim)
        self.self_attention = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.cross_norm = nn.LayerNorm(dim)
        self.cross_attention = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.ffn_norm = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_multiplier * dim), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(ffn_multiplier * dim, dim), nn.Dropout(dropout))

    def forward(self, text: torch.Tensor, padding: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        """text [B, L, D] with padding [B, L] (True: a pad token), image [B, N, D] -> text [B, L, D]."""
        h = self.self_norm(text)
        text = text + self.self_attention(h, h, h, key_padding_mask=padding, need_weights=False)[0]
        h = self.cross_norm(text)
        text = text + self.cross_attention(h, image, image, need_weights=False)[0]
        return text + self.ffn(self.ffn_norm(text))


def word_region_alignment(words: torch.Tensor, regions: torch.Tensor, mask: torch.Tensor,
                          sharpness: torch.Tensor | float = 5.0) -> torch.Tensor:
    """How well a caption's words find themselves in its image [B]: each word attends to the image's regions
    (softmax of `sharpness` x cosine), and the cosine between the word and what it attended to is averaged
    over the caption's words (`mask`). The text-to-image score of SCAN (Lee et al. 2018, stacked cross
    attention): a bilinear word-region comparison that gives the ITM head a signal from its first step."""
    w, r = nn.functional.normalize(words, dim=-1), nn.functional.normalize(regions, dim=-1)
    attended = torch.softmax(sharpness * w @ r.transpose(1, 2), -1) @ r
    cosine = (w * nn.functional.normalize(attended, dim=-1)).sum(-1)
    m = mask.to(cosine.dtype)
    return (cosine * m).sum(1) / m.sum(1).clamp_min(1)


class CrossModalFusion(nn.Module):
    """Projects text states [B, L, H] and image tokens [B, N, C] to `dim`, runs `layers` `FusionLayer`s and
    returns one ITM logit per row: a linear head on the fused first token (the text tower's [CLS]), plus,
    with `alignment`, a learned multiple of the `word_region_alignment` of the projected (fusion input) tokens."""

    def __init__(self, text_dim: int, image_dim: int, dim: int = 128, layers: int = 2, heads: int = 4,
                 dropout: float = 0.1, alignment: bool = True):
        super().__init__()
        if layers < 1 or dim % heads:
            raise ConfigError(f"fusion: {layers} layers of width {dim} with {heads} heads: need >= 1 layer and a "
                              "width divisible by the number of heads.")
        self.text_in = nn.Sequential(nn.Linear(text_dim, dim), nn.LayerNorm(dim))
        self.image_in = nn.Sequential(nn.Linear(image_dim, dim), nn.LayerNorm(dim))
        self.layers = nn.ModuleList(FusionLayer(dim, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.itm_head = nn.Linear(dim, 1)
        # the alignment's weight in the logit and its attention sharpness, learned (SCAN fixes the latter)
        self.alignment = nn.Parameter(torch.tensor([5.0, 5.0])) if alignment else None

    def fused(self, image_tokens: torch.Tensor, text_states: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        """The fused caption tokens [B, L, dim]."""
        return self.fuse(self.text_in(text_states), text_mask, self.image_in(image_tokens))

    def fuse(self, text: torch.Tensor, text_mask: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            text = layer(text, text_mask == 0, image)
        return self.norm(text)

    def forward(self, image_tokens: torch.Tensor, text_states: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        text, image = self.text_in(text_states), self.image_in(image_tokens)
        logit = self.itm_head(self.fuse(text, text_mask, image)[:, 0]).squeeze(-1)
        if self.alignment is not None:
            logit = logit + self.alignment[0] * word_region_alignment(text, image, text_mask, self.alignment[1])
        return logit


class FusionEncoder(DualEncoder):
    """A `DualEncoder` with cross-attention fusion and an ITM head.

    `forward(pixel_values=None, input_ids=None, attention_mask=None, frozen=(), itm_pairs=None)` returns what
    `DualEncoder` returns (``image_embeds``, ``text_embeds``, ``logit_scale``) plus ``image_tokens``
    [B, N, C] (the vision tower's last feature map), ``text_states`` [B, L, H] and ``text_mask`` [B, L]
    (the text tower's last hidden states), and ``task_log_vars`` when the model learns task weights
    (`num_task_weights` > 0: the log variances of Kendall et al. 2018, starting at 0). `itm_pairs(out)` ->
    (image_tokens, text_states, text_mask), or None for no pairs, names pairs to match *inside* the forward, so
    that under DDP every parameter is used within it; their logits come back as ``itm_logits``. `match(...)`
    scores pairs directly (evaluation, re-ranking). Exported as the two towers and the ITM scorer of an
    (image, caption) pair (`factory_target` / `factory_kwargs` rebuild it)."""

    factory_target = "accel_train.deploy.factories:fusion_encoder"
    muon_adamw_modules = (*DualEncoder.muon_adamw_modules, "fusion.itm_head")

    def __init__(self, text_model: nn.Module, vision_model: nn.Module, embed_dim: int = 256,
                 init_temperature: float = 0.07, max_logit_scale: float = 100.0, fusion_layers: int = 2,
                 fusion_dim: int = 128, fusion_heads: int = 4, fusion_dropout: float = 0.1, num_task_weights: int = 0,
                 fusion_alignment: bool = True):
        super().__init__(text_model, vision_model, embed_dim, init_temperature, max_logit_scale)
        self.fusion = CrossModalFusion(text_model.config.hidden_size, vision_model.num_features, fusion_dim,
                                       fusion_layers, fusion_heads, fusion_dropout, fusion_alignment)
        self.task_log_vars = nn.Parameter(torch.zeros(num_task_weights)) if num_task_weights else None
        self.fusion_kwargs = {"fusion_layers": fusion_layers, "fusion_dim": fusion_dim, "fusion_heads": fusion_heads,
                              "fusion_dropout": fusion_dropout, "num_task_weights": num_task_weights,
                              "fusion_alignment": fusion_alignment}

    @property
    def factory_kwargs(self):
        towers = super().factory_kwargs
        return None if towers is None else {**towers, **self.fusion_kwargs}

    def match(self, image_tokens: torch.Tensor, text_states: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        """ITM logits [B] of the pairs (image_tokens[b], caption b): positive means "the caption fits"."""
        return self.fusion(image_tokens, text_states, text_mask)

    def forward(self, pixel_values: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, frozen: Sequence[str] = (),
                itm_pairs: Callable | None = None) -> dict[str, torch.Tensor]:
        out = {"logit_scale": self.logit_scale.clamp(0, self.max_log_scale).exp()}
        if pixel_values is not None:
            with frozen_tower(self.vision, "vision" in frozen):
                tokens, pooled = vision_tokens(self.vision, pixel_values)
            out["image_tokens"] = tokens
            out["image_embeds"] = nn.functional.normalize(self.vision_projection(pooled), dim=-1)
        if input_ids is not None:
            if attention_mask is None:
                attention_mask = torch.ones_like(input_ids)
            with frozen_tower(self.text, "text" in frozen):
                states = self.text(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(states.dtype)
            pooled = (states * mask).sum(1) / mask.sum(1).clamp_min(1)  # mean pooling, as DualEncoder.encode_text
            out.update(text_states=states, text_mask=attention_mask,
                       text_embeds=nn.functional.normalize(self.text_projection(pooled), dim=-1))
        if self.task_log_vars is not None:
            # a copy, not the leaf: DDP looking for unused parameters walks from the outputs' autograd nodes, and
            # a bare parameter has none (it would be marked unused, then receive its gradient: "ready twice")
            out["task_log_vars"] = self.task_log_vars.clone()
        chosen = itm_pairs(out) if itm_pairs is not None else None
        if chosen is not None:
            out["itm_logits"] = self.match(*chosen)
        return out


def fusion_param_groups(model: nn.Module, learning_rates: Mapping[str, float],
                        weight_decays: Mapping[str, float]) -> list[dict[str, Any]]:
    """`tower_param_groups` with a fourth part, "fusion": the fusion layers, the ITM head and the learned task
    weights (parameters named ``fusion.*`` / ``task_log_vars``), trained from scratch at their own rate.
    `learning_rates` / `weight_decays` name "head", "fusion", "vision" and "text"."""
    fusion = {id(p) for n, p in model.named_parameters() if is_fusion(n)}
    groups = []
    for group in tower_param_groups(model, learning_rates, weight_decays):
        own = [p for p in group["params"] if id(p) not in fusion]
        if own:
            groups.append({**group, "params": own})
        if group["name"].startswith("head"):
            moved = [p for p in group["params"] if id(p) in fusion]
            decay = weight_decays["fusion"] if group["name"] == "head" else 0.0
            if moved:
                groups.append({"params": moved, "name": group["name"].replace("head", "fusion"),
                               "lr": learning_rates["fusion"], "weight_decay": decay})
    return groups


def is_fusion(parameter_name: str) -> bool:
    """Whether a FusionEncoder parameter (with or without a wrapper's prefix) is part of the fusion half."""
    return parameter_name.removeprefix("module.").startswith(("fusion.", "task_log_vars"))
