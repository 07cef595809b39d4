"""Retrieval and zero-shot metrics on embeddings gathered from every process.

Image->text: each distinct image queries every distinct caption; its rank is that of its best-placed own
caption (with 5 captions per image, a hit if any of them is in the top K: the Flickr/COCO protocol).
Text->image: each distinct caption queries every distinct image; its rank is that of its best-placed image
(a caption shared by several images, as generated captions are, matches any of them). Rank 1 is the top;
Recall@K is the share of queries with rank <= K. Ties count in the query's favour.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ...errors import ConfigError
from .collectives import distinct


def _ranks(queries: torch.Tensor, gallery: torch.Tensor, positive: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """1 + the number of gallery items scoring above each query's best-scoring positive, in blocks of queries."""
    ranks = []
    for start in range(0, len(queries), block):
        scores = queries[start:start + block] @ gallery.T
        best = scores.masked_fill(~positive[start:start + block], float("-inf")).amax(1, keepdim=True)
        ranks.append(1 + (scores > best).sum(1))
    return torch.cat(ranks)


def _chance(positive: torch.Tensor, k: int) -> float:
    """Expected Recall@K of a random ranking: a query with p positives among n is missed with probability
    C(n - p, K) / C(n, K)."""
    n, p = positive.shape[1], positive.sum(1).double()
    miss = torch.ones_like(p)
    for j in range(min(k, n)):
        miss *= ((n - p - j) / (n - j)).clamp_min(0)
    return (1 - miss).mean().item()


def retrieval_metrics(image_embeds: torch.Tensor, text_embeds: torch.Tensor, image_ids: torch.Tensor | None = None,
                      caption_ids: torch.Tensor | None = None, ks: Sequence[int] = (1, 5, 10)) -> dict[str, float]:
    """Recall@K and median rank in both directions for N (image, caption) pairs: embeddings [N, D] (unit
    vectors), and optional ids [N] saying which pairs share an image or an identical caption (default: all
    distinct). Returns ``i2t_recall@K``, ``t2i_recall@K``, ``i2t_median_rank``, ``t2i_median_rank``,
    ``mean_recall`` (of all the recalls), the numbers of distinct images and captions, and the recall a random
    ranking would get, ``i2t_chance_recall@K`` / ``t2i_chance_recall@K``, to read the others against."""
    n = len(image_embeds)
    image_ids = torch.arange(n) if image_ids is None else image_ids.cpu()
    caption_ids = torch.arange(n) if caption_ids is None else caption_ids.cpu()
    image_of, image_first = distinct(image_ids)
    caption_of, caption_first = distinct(caption_ids)
    images, texts = image_embeds.float().cpu()[image_first], text_embeds.float().cpu()[caption_first]
    positive = torch.zeros(len(images), len(texts), dtype=torch.bool)
    positive[image_of, caption_of] = True
    metrics: dict[str, float] = {}
    chance: dict[str, float] = {}
    for name, pos, ranks in (("i2t", positive, _ranks(images, texts, positive)),
                             ("t2i", positive.T, _ranks(texts, images, positive.T))):
        for k in ks:
            metrics[f"{name}_recall@{k}"] = (ranks <= k).float().mean().item()
            chance[f"{name}_chance_recall@{k}"] = _chance(pos, k)
        metrics[f"{name}_median_rank"] = ranks.float().median().item()
    recalls = list(metrics[f"{d}_recall@{k}"] for d in ("i2t", "t2i") for k in ks)
    metrics.update(mean_recall=sum(recalls) / len(recalls), retrieval_images=float(len(images)),
                   retrieval_captions=float(len(texts)), **chance)
    return metrics


def retrieval_metric_names(ks: Sequence[int] = (1, 5, 10)) -> list[str]:
    """The keys `retrieval_metrics` returns for `ks`."""
    per_direction = [f"{d}_{what}" for d in ("i2t", "t2i") for what in (*(f"recall@{k}" for k in ks), "median_rank")]
    chance = [f"{d}_chance_recall@{k}" for d in ("i2t", "t2i") for k in ks]
    return [*per_direction, "mean_recall", "retrieval_images", "retrieval_captions", *chance]


def zero_shot_accuracy(logits: torch.Tensor, labels: torch.Tensor, image_ids: torch.Tensor | None = None) -> float:
    """Top-1 accuracy of classifying each distinct image by its most similar class prompt (logits [N, classes])."""
    if image_ids is not None:
        _, first = distinct(image_ids.cpu())
        logits, labels = logits[first], labels[first]
    return (logits.argmax(-1).cpu() == labels.cpu()).float().mean().item()


class ContrastiveMetrics:
    """A `metrics_fn` for the loop: retrieval metrics from the gathered embeddings and ids, plus
    ``zero_shot_accuracy`` with `zero_shot` (the outputs must then carry ``zero_shot_logits`` and ``labels``:
    `ContrastiveLoss` with class prompts, on data with classes). `metric_names` lists what a call returns, so that a
    --metric_for_best_model it never reports is refused before training.

        ContrastiveMetrics(zero_shot=True).metric_names  # ["i2t_recall@1", ..., "zero_shot_accuracy"]
    """

    def __init__(self, ks: Sequence[int] = (1, 5, 10), zero_shot: bool = False):
        self.ks, self.zero_shot = tuple(ks), zero_shot

    @property
    def metric_names(self) -> list[str]:
        return [*retrieval_metric_names(self.ks), *(["zero_shot_accuracy"] if self.zero_shot else [])]

    def __call__(self, outputs: Mapping[str, torch.Tensor]) -> dict[str, float]:
        metrics = retrieval_metrics(outputs["image_embeds"], outputs["text_embeds"], outputs.get("image_ids"),
                                    outputs.get("caption_ids"), self.ks)
        if self.zero_shot:
            if "zero_shot_logits" not in outputs or "labels" not in outputs:
                raise ConfigError("ContrastiveMetrics(zero_shot=True), but the evaluation outputs hold no "
                                  "zero_shot_logits and labels: give ContrastiveLoss the class prompts (prompts=...) "
                                  "and evaluate data with labels, or build the metrics with zero_shot=False.")
            metrics["zero_shot_accuracy"] = zero_shot_accuracy(outputs["zero_shot_logits"], outputs["labels"],
                                                               outputs.get("image_ids"))
        return metrics
