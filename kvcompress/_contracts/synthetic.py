"""Seeded random contexts (:class:`Observation`, :class:`Selection`, :class:`Eviction`) shaped like
the ones :class:`~kvcompress.CompressedKVCache` hands to components.

Slot order is not position order in a real cache (decode writes a new token into the slot the
evicted one freed), so every builder shuffles positions per (batch, head) row. Shapes use GQA
(``H_q = 2 H_kv``) and a batch of 2 so that per-head and per-row mistakes show.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..components import Eviction, Observation, Selection

__all__ = ["B", "H_KV", "H_Q", "D", "normal", "shuffled_positions", "observation", "selection", "eviction",
           "replace", "batch_row"]

B, H_KV, H_Q, D = 2, 2, 4, 16


def normal(rng: np.random.Generator, shape, dtype=mx.float32) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def shuffled_positions(rng: np.random.Generator, t: int, lo: int = 0) -> np.ndarray:
    """``[B, H_KV, t]`` int32: positions ``lo .. lo + t - 1`` in a random slot order per row."""
    base = np.arange(lo, lo + t, dtype=np.int32)
    return np.stack([np.stack([rng.permutation(base) for _ in range(H_KV)]) for _ in range(B)])


def observation(
    rng: np.random.Generator, t_old: int, n_new: int, dtype=mx.float32, proxy: bool = False, layer: int = 0
) -> tuple[mx.array, Observation]:
    """``(scores, obs)`` after a step of ``n_new`` tokens appended to ``t_old`` stored slots.

    Old slots hold positions ``0 .. t_old - 1`` (shuffled), the new ones the next ``n_new``
    positions in order at the end; scores of old slots are a random non-negative mass, new
    slots enter at 0 (the cache's rule).
    """
    t = t_old + n_new
    pos_old = shuffled_positions(rng, t_old)
    pos_new = np.broadcast_to(np.arange(t_old, t, dtype=np.int32), (B, H_KV, n_new))
    positions = mx.array(np.concatenate([pos_old, pos_new], axis=-1))
    h_q = H_KV if proxy else H_Q
    queries = normal(rng, (B, h_q, n_new, D), dtype)
    keys = normal(rng, (B, H_KV, t, D), dtype)
    old = rng.random((B, H_KV, t_old)).astype(np.float32)
    scores = mx.array(np.concatenate([old, np.zeros((B, H_KV, n_new), np.float32)], axis=-1))
    mask = "causal" if n_new > 1 else None
    obs = Observation(
        queries=queries, keys=keys, positions=positions, n_new=n_new, scale=D**-0.5, mask=mask,
        layer=layer, offset=t, proxy=proxy, shared={},
    )
    return scores, obs


def selection(rng: np.random.Generator, selector, t: int, n_evict: int, budget: int) -> Selection:
    """A selection over ``t`` stored slots holding positions ``0 .. t - 1`` (nothing evicted yet),
    distinct random scores, and the selector's own ``protected`` mask, as the cache builds it."""
    positions = mx.array(shuffled_positions(rng, t))
    scores = mx.array(rng.permutation(B * H_KV * t).reshape(B, H_KV, t).astype(np.float32) / t)
    protected = selector.protected(positions, t, budget)
    return Selection(scores, positions, n_evict, budget, t, 0, {}, protected)


def eviction(
    rng: np.random.Generator, t: int, n_evict: int, n_protected: int, dtype=mx.float32, state=None,
    draw_id: int = 0,
) -> Eviction:
    """``t`` stored slots, the first ``n_protected`` positions protected (sinks), ``n_evict``
    distinct unprotected slots per row to evict."""
    positions_np = shuffled_positions(rng, t)
    protected_np = positions_np < n_protected
    evict = np.empty((B, H_KV, n_evict), np.int32)
    for b in range(B):
        for h in range(H_KV):
            free = np.flatnonzero(~protected_np[b, h])
            evict[b, h] = rng.choice(free, size=n_evict, replace=False)
    return Eviction(
        keys=normal(rng, (B, H_KV, t, D), dtype),
        values=normal(rng, (B, H_KV, t, D), dtype),
        scores=mx.array(rng.random((B, H_KV, t)).astype(np.float32) + 0.01),
        positions=mx.array(positions_np),
        evict=mx.array(evict),
        protected=mx.array(protected_np),
        layer=0,
        draw_id=draw_id,
        state=state,
        shared={},
    )


def replace(obs: Observation, **changes) -> Observation:
    """A copy of ``obs`` with ``changes`` and a fresh ``shared`` dict (the memoised attention
    mass is ``init=False``, so ``attrs.evolve`` starts it empty)."""
    import attrs

    return attrs.evolve(obs, **{"shared": {}, **changes})  # the memo is init=False: never copied


def batch_row(obs: Observation, b: int) -> Observation:
    """Row ``b`` of ``obs`` as a batch of one."""
    return replace(obs, queries=obs.queries[b : b + 1], keys=obs.keys[b : b + 1],
                   positions=obs.positions[b : b + 1])
