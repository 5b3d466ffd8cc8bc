"""Seeded random contexts (:class:`Observation`, :class:`Selection`, :class:`Eviction`) shaped like
the ones the cache engine hands to components.

Slot order is not position order in a real cache (a decode step writes its token into the slot
the evicted one freed), so every builder shuffles slots per (batch, head) row. Shapes use GQA
(``H_q = 2 H_kv``) and a batch of 2 so that per-head and per-row mistakes show. With
``ragged=True`` the rows differ as batched rows do: row 1 holds fewer tokens (its extra slots
are empty, position ``-1``), has seen fewer tokens, right-pads a multi-token step and frees
fewer slots than row 0.
"""

from __future__ import annotations

from typing import Any, Optional

import attrs
import mlx.core as mx
import numpy as np

from ..contexts import Eviction, LayerInfo, Observation, Selection

__all__ = ["B", "H_KV", "H_Q", "D", "LAYER", "EMPTY", "normal", "offsets", "shuffled_positions", "observation",
           "selection", "eviction", "replace", "batch_row"]

B, H_KV, H_Q, D = 2, 2, 4, 16
#: empty slots row 1 holds in a ragged context
EMPTY = 3
#: the layer the synthetic contexts come from (layer 1 of 2, so layer-keyed draws are exercised)
LAYER = LayerInfo(layer=1, n_layers=2, head_offset=0, n_kv_heads=H_KV, model_type="llama")


def normal(rng: np.random.Generator, shape, dtype=mx.float32) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def offsets(values) -> mx.array:
    """Host ints per row -> the ``[B, 1, 1]`` int32 array contexts carry."""
    return mx.array(list(values), dtype=mx.int32).reshape(-1, 1, 1)


def shuffled_positions(rng: np.random.Generator, t: int, held=None) -> np.ndarray:
    """``[B, H_KV, t]`` int32: row ``b`` holds positions ``0 .. held[b] - 1`` and ``t - held[b]``
    empty slots (``-1``), in a random slot order per (row, head)."""
    held = [t] * B if held is None else held
    rows = []
    for b in range(B):
        base = np.concatenate([np.arange(held[b]), np.full(t - held[b], -1)]).astype(np.int32)
        rows.append(np.stack([rng.permutation(base) for _ in range(H_KV)]))
    return np.stack(rows)


def observation(
    rng: np.random.Generator, t_old: int, n_new: int, dtype=mx.float32, proxy: bool = False,
    state: Any = None, ragged: bool = False,
) -> tuple[mx.array, Observation]:
    """``(scores, obs)`` after a step of ``n_new`` tokens appended to ``t_old`` stored slots.

    Row ``b`` held ``held[b]`` old tokens at positions ``0 .. held[b] - 1`` (shuffled; with
    ``ragged`` row 1 holds ``EMPTY`` fewer and the rest of its old slots are empty); the new
    slots come last, in order, the real ones at the next positions and right padding (ragged
    row 1 of a multi-token step: its last 2 tokens) empty. Old scores are a random non-negative
    mass; new slots enter at 0 (the engine's rule).
    """
    held = [t_old, t_old - EMPTY] if ragged else [t_old] * B
    valid = [n_new, max(n_new - 2, 1)] if ragged else [n_new] * B
    pos_old = shuffled_positions(rng, t_old, held)
    ar = np.arange(n_new)
    pos_new = np.stack([np.broadcast_to(np.where(ar < valid[b], held[b] + ar, -1), (H_KV, n_new)) for b in range(B)])
    positions = mx.array(np.concatenate([pos_old, pos_new], axis=-1).astype(np.int32))
    h_q = H_KV if proxy else H_Q
    queries = normal(rng, (B, h_q, n_new, D), dtype)
    keys = normal(rng, (B, H_KV, t_old + n_new, D), dtype)
    old = rng.random((B, H_KV, t_old)).astype(np.float32)
    scores = mx.array(np.concatenate([old, np.zeros((B, H_KV, n_new), np.float32)], axis=-1))
    qpos = offsets(held).reshape(B, 1, 1) + mx.arange(n_new, dtype=mx.int32).reshape(1, 1, n_new)
    weight = None
    if any(v < n_new for v in valid):
        weight = (mx.arange(n_new).reshape(1, 1, n_new) < offsets(valid)).astype(mx.float32)
    seen = [h + v for h, v in zip(held, valid)]
    values = normal(rng, (B, H_KV, t_old + n_new, D), dtype)  # drawn last: earlier draws unchanged
    obs = Observation(
        queries=queries, keys=keys, positions=positions, query_positions=qpos, n_new=n_new, scale=D**-0.5,
        offset=offsets(seen), offsets=tuple(seen), layer=LAYER, n_valid=tuple(valid), query_weight=weight,
        proxy=proxy, state=state, values=values,
    )
    return scores, obs


def selection(
    rng: np.random.Generator, selector, t: int, budget: int, ragged: bool = False, state: Any = None,
) -> Selection:
    """A selection over ``t`` stored slots, as the engine builds it before a step: row ``b`` holds
    positions ``0 .. held[b] - 1`` (everything it has seen; ragged row 1 holds ``EMPTY`` fewer,
    its other slots empty), distinct random scores, the selector's own ``protected`` mask plus
    the empty slots. Each row frees ``held[b] - (budget - 1)`` slots; rows that differ pass
    ``row_counts``."""
    held = [t, t - EMPTY] if ragged else [t] * B
    positions = mx.array(shuffled_positions(rng, t, held))
    scores = mx.array(rng.permutation(B * H_KV * t).reshape(B, H_KV, t).astype(np.float32) / t)
    off = offsets(held)
    protected = selector.protected(positions, off, budget)
    if ragged:
        protected = protected | (positions < 0)
    need = [h - (budget - 1) for h in held]
    return Selection(
        scores=scores, positions=positions, protected=protected, n_evict=max(need), budget=budget, offset=off,
        offsets=tuple(held), layer=LAYER, row_counts=offsets(need) if len(set(need)) > 1 else None, state=state,
    )


def eviction(
    rng: np.random.Generator, t: int, n_evict: int, n_protected: int, dtype=mx.float32, state=None,
    draw_id: int = 0, ragged: bool = False, count: Optional[list] = None,
) -> Eviction:
    """``t`` stored slots, the first ``n_protected`` positions protected (sinks), ``n_evict``
    distinct unprotected slots per row to free. With ``ragged`` row 1 holds ``EMPTY`` empty
    slots (protected, as the engine marks them) and frees only ``n_evict - 1`` slots: its last
    entry names a slot that stays (``real`` is False there)."""
    held = [t, t - EMPTY] if ragged else [t] * B
    counts = count or ([n_evict, max(n_evict - 1, 1)] if ragged else [n_evict] * B)
    positions_np = shuffled_positions(rng, t, held)
    protected_np = positions_np < n_protected  # the sinks, and every empty slot (position -1)
    evict = np.empty((B, H_KV, n_evict), np.int32)
    for b in range(B):
        for h in range(H_KV):
            # a row freeing fewer slots than others has trailing entries that stay (``real``)
            free = np.flatnonzero(~protected_np[b, h])
            evict[b, h] = rng.choice(free, size=n_evict, replace=False)
    real = None
    if len(set(counts)) > 1:
        real = mx.arange(n_evict).reshape(1, 1, n_evict) < offsets(counts)
    return Eviction(
        keys=normal(rng, (B, H_KV, t, D), dtype),
        values=normal(rng, (B, H_KV, t, D), dtype),
        scores=mx.array(rng.random((B, H_KV, t)).astype(np.float32) + 0.01),
        positions=mx.array(positions_np),
        evict=mx.array(evict),
        protected=mx.array(protected_np),
        offset=offsets([h + 3 for h in held]),
        offsets=tuple(h + 3 for h in held),
        layer=LAYER,
        counts=tuple(counts),
        draw_id=draw_id,
        real=real,
        state=state,
    )


def replace(ctx, **changes):
    """A copy of a context with ``changes`` (an observation's memoised attention mass is
    ``init=False``, so ``attrs.evolve`` starts it empty)."""
    return attrs.evolve(ctx, **changes)


def batch_row(obs: Observation, b: int, state: Any = None) -> tuple[Observation, int]:
    """Row ``b`` of ``obs`` as the engine builds it for that sequence alone: a batch of one whose
    step holds only the row's real tokens (no right padding, so no padding slots), and the
    number of slots it has (the first ones of the batch's row)."""
    sl = slice(b, b + 1)
    n = obs.n_valid[b]
    t = obs.keys.shape[2] - (obs.n_new - n)
    row = replace(
        obs, queries=obs.queries[sl, :, :n], keys=obs.keys[sl, :, :t],
        values=None if obs.values is None else obs.values[sl, :, :t], positions=obs.positions[sl, :, :t],
        query_positions=obs.query_positions[sl, :, :n], n_new=n, offset=obs.offset[sl], offsets=(obs.offsets[b],),
        n_valid=(n,), query_weight=None, state=state,
    )
    return row, t
