"""Evaluation of the fusion model on gathered outputs: image-text matching (ITM) accuracy and ROC-AUC, and
retrieval with the top-k contrastive (ITC) candidates re-ranked by ITM, beside ITC-only retrieval.

The evaluation pass gathers, for every (image, caption) pair, the embeddings, the ids, the image tokens and
the text states. `FusionMetrics` then works on the distinct images and captions:

* ITM pairs: every evaluation pair is a positive; each gets two *random* negatives (its image with a caption
  that is not one of the image's, its caption with an image it does not describe; a seeded draw, the same at
  every evaluation) and two *hard* ones (its caption with the highest-ITC image it does not describe; its
  image with its r-th highest-ITC caption that is not its own, r being the pair's place among the image's
  captions, so an image's five pairs get five different hard captions). AUC is scale-free and so unaffected
  by the 1:2 imbalance; accuracy is balanced ((TPR + TNR) / 2) at logit -log 2 (`BALANCED_THRESHOLD`). The
  ITC similarity's AUC on the same pairs is reported beside ITM's (``itc_auc_*``): how hard the negatives are
  for ITC itself.
* Re-ranking: each image's top-k captions by ITC (and each caption's top-k images) are ordered by their ITM
  logit (``rerank_*``), or by ITM logit + ITC logit (``rerank_sum_*``, BLIP's ranking score); a query whose
  positives are all outside its top-k keeps its ITC rank (> k). Ranks and recalls follow `retrieval_metrics`
  (the best-placed positive counts; ties in the query's favour).

Every pair is scored by the fusion model exactly once: the distinct pairs are split among the processes, each
scores its share, and the scores are all-gathered (every process calls the metrics function with the same
gathered outputs, so all get the same numbers).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from sklearn.metrics import roc_auc_score

from .collectives import distinct, gather_plain, rank, world_size
from .contrastive_metrics import retrieval_metric_names, retrieval_metrics

# The ITM head trains on one positive per two negatives, so its logit is the log-odds under a prior of 1/3;
# on balanced pairs the same evidence has log-odds logit + log 2, which crosses 0 at logit = -log 2.
BALANCED_THRESHOLD = -math.log(2)


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (the probability that a random positive outscores a random negative, ties
    half); NaN when one class is missing."""
    labels = labels.bool()
    if labels.all() or not labels.any():
        return float("nan")
    return float(roc_auc_score(labels.numpy(), scores.double().numpy()))


def balanced_accuracy(scores: torch.Tensor, labels: torch.Tensor, threshold: float = 0.0) -> float:
    """(TPR + TNR) / 2 of `scores > threshold` against `labels`."""
    labels, predicted = labels.bool(), scores > threshold
    return ((predicted[labels].float().mean() + (~predicted[~labels]).float().mean()) / 2).item()


def random_other(allowed_of, rows: torch.Tensor, columns: int, generator: torch.Generator, tries: int = 1000):
    """For each of `rows`, a column drawn uniformly among those `allowed_of(rows, cols)` says are allowed
    (rejection sampling with a seeded generator); -1 where none was found within `tries` draws."""
    picked = torch.full_like(rows, -1)
    todo = torch.arange(len(rows))
    for _ in range(tries):
        if not len(todo):
            break
        draw = torch.randint(0, columns, (len(todo),), generator=generator)
        ok = allowed_of(rows[todo], draw)
        picked[todo[ok]] = draw[ok]
        todo = todo[~ok]
    return picked


def nth_best_other(similarity: torch.Tensor, positive: torch.Tensor, rows: torch.Tensor, nth: torch.Tensor,
                   block: int = 1024) -> torch.Tensor:
    """For each of `rows`, the column with the nth[row]-highest similarity among its non-positive columns."""
    depth = min(int(nth.max()) + 1, similarity.shape[1])
    out = []
    for start in range(0, len(rows), block):
        r = rows[start:start + block]
        top = similarity[r].masked_fill(positive[r], float("-inf")).topk(depth, 1).indices
        out.append(top[torch.arange(len(r)), nth[start:start + block].clamp_max(depth - 1)])
    return torch.cat(out)


class FusionMetrics:
    """A `metrics_fn` for the loop: ITC retrieval (`retrieval_metrics`), ITM-re-ranked retrieval
    (``rerank_*``), and ITM / ITC accuracy and AUC on positive vs random and vs hard negative pairs.

    `model` is the `FusionEncoder` being trained (the object given to `train()`; preparation wraps it, the
    parameters stay the same): its `match` scores pairs, in eval mode, without gradients. `rerank_k`:
    candidates per query. `seed`: the random negatives' draw."""

    def __init__(self, model, ks: Sequence[int] = (1, 5, 10), rerank_k: int = 16, seed: int = 0,
                 batch_size: int = 256):
        self.model, self.ks, self.rerank_k, self.seed, self.batch_size = model, tuple(ks), rerank_k, seed, batch_size

    @property
    def metric_names(self) -> list[str]:
        """What a call returns: a --metric_for_best_model it never reports is refused before training."""
        pairs = [f"{score}_{negatives}" for negatives in ("random", "hard")
                 for score in ("itm_auc", "itc_auc", "itm_accuracy")]
        reranked = [f"{prefix}_{d}_{what}" for prefix in ("rerank", "rerank_sum") for d in ("i2t", "t2i")
                    for what in (*(f"recall@{k}" for k in self.ks), "median_rank")]
        return [*retrieval_metric_names(self.ks), *pairs, *reranked, "rerank_mean_recall", "rerank_sum_mean_recall",
                "rerank_k"]

    def __call__(self, outputs: Mapping[str, torch.Tensor]) -> dict[str, float]:
        metrics = retrieval_metrics(outputs["image_embeds"], outputs["text_embeds"], outputs["image_ids"],
                                    outputs["caption_ids"], self.ks)
        image_of, image_first = distinct(outputs["image_ids"].cpu())
        caption_of, caption_first = distinct(outputs["caption_ids"].cpu())
        similarity = outputs["image_embeds"][image_first].float() @ outputs["text_embeds"][caption_first].float().T
        positive = torch.zeros(similarity.shape, dtype=torch.bool)
        positive[image_of, caption_of] = True
        sets = self.itm_pairs(similarity, positive, image_of, caption_of)
        i2t = candidates(similarity, self.rerank_k)
        t2i = candidates(similarity.T, self.rerank_k)
        wanted = torch.cat([*(p for p, _ in sets.values()), pairs_of(i2t), pairs_of(t2i).flip(1)])
        scorer = PairScorer(self.model, outputs["image_tokens"][image_first], outputs["text_states"][caption_first],
                            outputs["text_mask"][caption_first], self.batch_size)
        scores = scorer(wanted)
        for name, (pairs, labels) in sets.items():
            itm, itc = scores(pairs), similarity[pairs[:, 0], pairs[:, 1]]
            metrics.update({f"itm_auc_{name}": roc_auc(itm, labels), f"itc_auc_{name}": roc_auc(itc, labels),
                            f"itm_accuracy_{name}": balanced_accuracy(itm, labels, BALANCED_THRESHOLD)})
        itm = {"i2t": scores(pairs_of(i2t)), "t2i": scores(pairs_of(t2i).flip(1))}
        metrics.update(self.reranked("rerank", similarity, positive, {"i2t": i2t, "t2i": t2i}, itm, 0.0))
        scale = self.model.logit_scale.detach().clamp(0, self.model.max_log_scale).exp().item()
        metrics.update(self.reranked("rerank_sum", similarity, positive, {"i2t": i2t, "t2i": t2i}, itm, scale))
        metrics["rerank_k"] = float(min(self.rerank_k, *similarity.shape))
        return metrics

    def reranked(self, prefix: str, similarity, positive, top: dict, itm: dict, itc_scale: float) -> dict[str, float]:
        """Recalls and median ranks with each query's candidates ordered by ITM logit + itc_scale x ITC cosine
        (itc_scale 0: by ITM alone; the ITC logit scale: BLIP's sum of the two)."""
        metrics = {}
        for direction in ("i2t", "t2i"):
            sim, pos = (similarity, positive) if direction == "i2t" else (similarity.T, positive.T)
            score = itm[direction] + itc_scale * sim.gather(1, top[direction]).flatten()
            ranks = rerank_ranks(sim, pos, top[direction], score)
            for k in self.ks:
                metrics[f"{prefix}_{direction}_recall@{k}"] = (ranks <= k).float().mean().item()
            metrics[f"{prefix}_{direction}_median_rank"] = ranks.float().median().item()
        recalls = [metrics[f"{prefix}_{d}_recall@{k}"] for d in ("i2t", "t2i") for k in self.ks]
        metrics[f"{prefix}_mean_recall"] = sum(recalls) / len(recalls)
        return metrics

    def itm_pairs(self, similarity, positive, image_of, caption_of) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{"random": (pairs [3N, 2] of (image, caption) indices, labels [3N]), "hard": (...)}: the N positives,
        then N image-side and N caption-side negatives (rows without any negative are left out)."""
        n_images, n_captions = similarity.shape
        generator = torch.Generator().manual_seed(self.seed)
        slot = occurrence(image_of)  # the pair's place among its image's captions
        random_caption = random_other(lambda i, c: ~positive[i, c], image_of, n_captions, generator)
        random_image = random_other(lambda c, i: ~positive[i, c], caption_of, n_images, generator)
        hard_caption = nth_best_other(similarity, positive, image_of, slot)
        hard_image = nth_best_other(similarity.T, positive.T, caption_of, torch.zeros_like(caption_of))
        sets = {}
        for name, text_side, image_side in (("random", random_caption, random_image),
                                            ("hard", hard_caption, hard_image)):
            pairs = torch.cat([torch.stack([image_of, caption_of], 1), torch.stack([image_of, text_side], 1),
                               torch.stack([image_side, caption_of], 1)])
            labels = torch.arange(len(pairs)) < len(image_of)
            keep = (pairs >= 0).all(1) & (labels | ~positive[pairs[:, 0], pairs[:, 1]])
            sets[name] = (pairs[keep], labels[keep])
        return sets


def occurrence(ids: torch.Tensor) -> torch.Tensor:
    """For each element, how many earlier elements have the same id (0 for the first)."""
    order = torch.sort(ids, stable=True).indices
    sorted_ids = ids[order]
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[1:] = sorted_ids[1:] != sorted_ids[:-1]
    group_start = torch.cummax(torch.where(starts, torch.arange(len(ids)), 0), 0).values
    out = torch.empty_like(ids)
    out[order] = torch.arange(len(ids)) - group_start
    return out


def candidates(similarity: torch.Tensor, k: int) -> torch.Tensor:
    """The top-k columns of each row by similarity, best first [rows, k]."""
    return similarity.topk(min(k, similarity.shape[1]), 1).indices


def pairs_of(top: torch.Tensor) -> torch.Tensor:
    """(row, column) pairs [rows * k, 2] of a candidates table."""
    rows = torch.arange(top.shape[0]).repeat_interleave(top.shape[1])
    return torch.stack([rows, top.flatten()], 1)


def rerank_ranks(similarity: torch.Tensor, positive: torch.Tensor, top: torch.Tensor,
                 itm: torch.Tensor) -> torch.Tensor:
    """Each query's rank after re-ranking its top-k candidates by ITM (`itm` [rows * k] in `pairs_of(top)`
    order): 1 + the candidates scoring above its best positive candidate; without a positive among them,
    its ITC rank, which is beyond k."""
    itm = itm.view(top.shape)
    hit = positive.gather(1, top)
    best = itm.masked_fill(~hit, float("-inf")).amax(1, keepdim=True)
    reranked = 1 + (itm > best).sum(1)
    itc_best = similarity.masked_fill(~positive, float("-inf")).amax(1, keepdim=True)
    itc_rank = (1 + (similarity > itc_best).sum(1)).clamp_min(top.shape[1] + 1)
    return torch.where(hit.any(1), reranked, itc_rank)


class PairScorer:
    """Scores (image, caption) index pairs with `model.match`, each distinct pair once across processes.

    `scorer(pairs)` computes the scores of the distinct pairs (this process scores its contiguous share,
    then an all-gather) and returns a lookup: `lookup(pairs)` -> ITM logits [M] on the CPU."""

    def __init__(self, model, image_tokens, text_states, text_mask, batch_size: int = 256):
        keep = text_mask.any(0)  # the evaluation padded every caption to the longest possible
        self.model, self.batch_size = model, batch_size
        self.image_tokens, self.text_states, self.text_mask = image_tokens, text_states[:, keep], text_mask[:, keep]
        self.columns = len(text_states)

    @torch.no_grad()
    def __call__(self, pairs: torch.Tensor):
        keys = torch.unique(pairs[:, 0] * self.columns + pairs[:, 1])
        share = -(-len(keys) // world_size())
        mine = keys[rank() * share:(rank() + 1) * share]
        device = next(self.model.parameters()).device
        scores = torch.zeros(share, device=device)
        was_training = self.model.training
        self.model.eval()
        for start in range(0, len(mine), self.batch_size):
            key = mine[start:start + self.batch_size]
            image, text = key // self.columns, key % self.columns
            scores[start:start + len(key)] = self.model.match(
                self.image_tokens[image].to(device), self.text_states[text].to(device),
                self.text_mask[text].to(device)).float()
        self.model.train(was_training)
        scores = gather_plain(scores)
        table = scores[:len(keys)].cpu()

        def lookup(wanted: torch.Tensor) -> torch.Tensor:
            return table[torch.searchsorted(keys, wanted[:, 0] * self.columns + wanted[:, 1])]

        return lookup


def summary(m: Mapping[str, float], prefix: str, ks: Sequence[int] = (1, 5, 10)) -> str | None:
    """One line: ITC-only and re-ranked recalls both ways, and the ITM AUCs; None without those metrics."""
    if f"{prefix}_rerank_mean_recall" not in m:
        return None
    row = lambda what: " / ".join(f"{m[f'{prefix}_{what}@{k}']:.1%}" for k in ks)  # noqa: E731
    return (f"{prefix} ({int(m[f'{prefix}_retrieval_images'])} images, {int(m[f'{prefix}_retrieval_captions'])} "
            f"captions): R@{'/'.join(map(str, ks))} image->text ITC {row('i2t_recall')}, re-ranked by ITM (top "
            f"{int(m[f'{prefix}_rerank_k'])}) {row('rerank_i2t_recall')}; text->image ITC {row('t2i_recall')}, "
            f"re-ranked {row('rerank_t2i_recall')}; ITM AUC vs random negatives {m[f'{prefix}_itm_auc_random']:.3f}, "
            f"vs hard negatives {m[f'{prefix}_itm_auc_hard']:.3f} (ITC: {m[f'{prefix}_itc_auc_random']:.3f} / "
            f"{m[f'{prefix}_itc_auc_hard']:.3f})")
