"""Score-based selectors with attention-sink and recent-window protection."""

from __future__ import annotations

import functools
from typing import ClassVar

import attrs
import mlx.core as mx
from attrs.validators import ge, instance_of, lt

from kvcompress.ops import COMPILE, lowest_k

__all__ = ["LowestScoreSelector"]


@functools.lru_cache(maxsize=256)
def _protect_fn(n_sink: int, r: int):
    """``positions < n_sink | positions >= offset - r`` as one compiled kernel (ints baked in)."""

    def protect(positions, offset):
        return (positions < n_sink) | (positions >= offset - r)

    return mx.compile(protect) if COMPILE else protect


@attrs.frozen
class LowestScoreSelector:
    """Evict the ``E`` unprotected slots with the lowest score, per (row, KV head).

    Protected: the first ``n_sink`` positions (attention sinks) and the most recent
    ``r = max(recent, floor(recent_ratio * budget))`` positions. Ties go to the older token
    (:func:`kvcompress.ops.lowest_k`), so the choice never depends on slot order. With ``E = 1``
    (decode) this is a pair of reductions; otherwise an ``argpartition`` -- never a full sort.
    """

    n_sink: int = attrs.field(default=4, validator=[instance_of(int), ge(0)])
    recent: int = attrs.field(default=0, validator=[instance_of(int), ge(0)])
    recent_ratio: float = attrs.field(default=0.0, converter=float, validator=[ge(0.0), lt(1.0)])

    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset({"protection"})

    def recent_window(self, budget):
        """``r`` for an int budget, or per row for a ``[B, 1, 1]`` budget array."""
        if isinstance(budget, mx.array):
            return mx.maximum(self.recent, mx.floor(budget.astype(mx.float32) * self.recent_ratio).astype(mx.int32))
        return max(self.recent, int(self.recent_ratio * budget))

    def reserved(self, budget: int) -> int:
        return self.n_sink + self.recent_window(budget)

    def protected(self, positions: mx.array, offset: mx.array, budget) -> mx.array:
        r = self.recent_window(budget)
        if not isinstance(r, mx.array) and r:
            return _protect_fn(self.n_sink, r)(positions, offset)
        keep = positions < self.n_sink
        if isinstance(r, mx.array):
            keep = keep | (positions >= offset - r)
        return keep

    def select(self, sel) -> mx.array:
        return lowest_k(sel.scores, sel.positions, sel.n_evict, ordered=sel.row_counts is not None,
                        exclude=sel.protected)
