"""The pieces of CaM's blend weight shared by the chunk and decode merges: each loser's share of
its target's prominence, sums over the losers that pick the same target, and the scatter-add
that accumulates them."""

from __future__ import annotations

import mlx.core as mx

__all__ = []


def _scatter_add(x: mx.array, idx: mx.array, delta: mx.array) -> mx.array:
    """``x[b, h, idx[b, h, e], ...] += delta[b, h, e, ...]`` (duplicates accumulate)."""
    b, h = idx.shape[:2]
    bi = mx.arange(b).reshape(b, *([1] * (idx.ndim - 1)))
    hi = mx.arange(h).reshape(1, h, *([1] * (idx.ndim - 2)))
    return x.at[bi, hi, idx].add(delta)


def _prominence_share(positions, evict, target, s_l, s_t, off, joins=None):
    """``a_l / (a_t + sum_{i -> t} a_i)`` with ``a = A / (offset - pos)`` (mean attention per
    query so far), the sum over the losers ``joins`` marks that merge into the same target in
    this step (``None``: one loser per target, the sum is ``a_l``). With no mass at all, the
    plain mean: ``1 / (1 + n_t)``."""
    off = off.astype(mx.float32)
    p_l = mx.take_along_axis(positions, evict, axis=-1).astype(mx.float32)
    p_t = mx.take_along_axis(positions, target, axis=-1).astype(mx.float32)
    a_l = mx.maximum(s_l, 0.0) / mx.maximum(off - p_l, 1.0)
    a_t = mx.maximum(s_t, 0.0) / mx.maximum(off - p_t, 1.0)
    if joins is None:
        total, n_t = a_l + a_t, 1.0
    else:
        total = a_t + _per_target_sum(target, mx.where(joins, a_l, 0.0), positions.shape[-1])
        n_t = _per_target_sum(target, joins.astype(mx.float32), positions.shape[-1])
    return mx.where(total > 0, a_l / mx.where(total > 0, total, 1.0), 1.0 / (1.0 + n_t))


def _per_target_sum(target, x, t: int):
    """``out[b, h, e] = sum_{e' : target[e'] = target[e]} x[b, h, e']``."""
    acc = _scatter_add(mx.zeros(target.shape[:2] + (t,), mx.float32), target, x.astype(mx.float32))
    return mx.take_along_axis(acc, target, axis=-1)
