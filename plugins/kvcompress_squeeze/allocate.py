"""SqueezeAttention's layer budgets from layer-importance scores (pure numpy, deterministic).

Each layer ``l`` has a similarity ``c_l = mean_t cos(x_t, x_t + Attn_l(x_t))`` between its input
hidden state and its state after attention + residual (averaged over the prompt's tokens). A
layer whose attention barely changes the hidden state (high ``c_l``) matters less. The ``c_l``
are clustered by 1-D k-means (k = 3); the cluster with the highest centre gets
``b_low = round(squeeze_ratio * b)`` tokens per layer and the other layers share the rest, so
the total equals the uniform total ``L * b``::

    b_l = b_low                                   for l in the highest-similarity cluster
    b_l = floor((L b - n_low b_low) / (L - n_low)) (+1 for the most important layers, to make
          the sum exact)                          otherwise
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["kmeans_1d", "squeeze_budgets"]


def kmeans_1d(x: Sequence[float], k: int = 3, seed: int = 0, n_init: int = 10, iters: int = 100):
    """Lloyd's k-means on scalars with seeded k-means++ starts; the best of ``n_init`` runs.

    Returns ``(labels [L] int, centres [k'] float)`` with ``k' = min(k, #distinct values)``.
    """
    x = np.asarray(x, dtype=np.float64).reshape(-1)
    if x.size == 0:
        raise ValueError("k-means needs at least one value")
    k = max(1, min(int(k), np.unique(x).size))
    rng = np.random.default_rng(seed)
    best = None
    for _ in range(n_init):
        centres = [x[rng.integers(x.size)]]
        for _ in range(1, k):
            d2 = np.min((x[:, None] - np.asarray(centres)[None]) ** 2, axis=1)
            if not d2.sum() > 0:  # remaining values coincide numerically with the centres
                break
            centres.append(x[rng.choice(x.size, p=d2 / d2.sum())])
        c = np.asarray(centres)
        for _ in range(iters):
            labels = np.argmin(np.abs(x[:, None] - c[None]), axis=1)
            new = np.array([x[labels == j].mean() if np.any(labels == j) else c[j] for j in range(c.size)])
            if np.allclose(new, c, rtol=0.0, atol=1e-12):
                break
            c = new
        labels = np.argmin(np.abs(x[:, None] - c[None]), axis=1)
        inertia = float(((x - c[labels]) ** 2).sum())
        if best is None or inertia < best[0] - 1e-15:
            best = (inertia, labels, c)
    return best[1], best[2]


def squeeze_budgets(
    similarity: Sequence[float],
    budget: int,
    squeeze_ratio: float,
    n_clusters: int = 3,
    seed: int = 0,
    min_budget: int = 1,
) -> list[int]:
    """Per-layer budgets summing to ``len(similarity) * budget`` (see module docstring).

    ``min_budget`` is the smallest budget a layer may get (the selector's protected tokens + 1).
    A single cluster (all similarities equal) gives the uniform budgets.
    """
    sim = np.asarray(similarity, dtype=np.float64)
    n = sim.size
    labels, centres = kmeans_1d(sim, n_clusters, seed)
    low = labels == int(np.argmax(centres))
    n_low = int(low.sum())
    if n_low == n:
        return [int(budget)] * n
    b_low = min(max(int(round(squeeze_ratio * budget)), int(min_budget)), int(budget))
    rest = n * int(budget) - n_low * b_low
    others = np.flatnonzero(~low)
    base, extra = divmod(rest, others.size)
    out = np.full(n, b_low, dtype=np.int64)
    out[others] = base
    most_important = others[np.argsort(sim[others], kind="stable")][:extra]
    out[most_important] += 1
    return [int(b) for b in out]
