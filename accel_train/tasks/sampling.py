"""Seeded subsets for `--max_train_samples` / `--max_eval_samples`, in every recipe.

The first N rows of a split are no sample of it: splits are often sorted by class (an image folder read class by
class, MNIST digits 0 then 1), so the first 100 digits were all zeros and ones. `subsample` draws a seeded subset
instead, stratified by class when the labels are given: every class keeps its share (largest remainders), so a
subset of 100 from 10 balanced classes holds 10 of each.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def subsample(size: int, limit: int | None, seed: int, labels: Sequence | None = None) -> np.ndarray:
    """Sorted indices of a seeded subset of `limit` out of `size` items (all of them when `limit` is None or not
    smaller). With `labels` (one hashable per item), stratified: each class gets round(limit x its share), the
    remainders going to the classes with the largest fractional parts, so the total is exactly `limit`. Give labels
    only for classes: float targets (regression) would each count as a class."""
    if limit is None or limit >= size:
        return np.arange(size)
    rng = np.random.default_rng(seed)
    if labels is None:
        return np.sort(rng.permutation(size)[:limit])
    classes, codes = np.unique(np.asarray([str(v) for v in labels]), return_inverse=True)
    counts = np.bincount(codes, minlength=len(classes))
    exact = counts * limit / size
    quota = np.floor(exact).astype(int)
    # the remainders go to the largest fractional parts; ties (many classes, few items) are broken at random, not
    # by class order
    for c in np.lexsort((rng.random(len(classes)), -(exact - quota)))[: limit - quota.sum()]:
        quota[c] += 1
    chosen = [rng.permutation(np.flatnonzero(codes == c))[: quota[c]] for c in range(len(classes))]
    return np.sort(np.concatenate(chosen))
