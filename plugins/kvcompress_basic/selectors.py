"""Score-based selectors with attention-sink and recent-window protection."""

from __future__ import annotations

from typing import ClassVar

import attrs
import mlx.core as mx
from attrs.validators import ge, instance_of, lt

__all__ = ["LowestScoreSelector"]


@attrs.frozen
class LowestScoreSelector:
    """Evict the ``E`` unprotected slots with the lowest score, per (batch, KV head).

    Protected: the first ``n_sink`` positions (attention sinks) and the most recent
    ``max(recent, floor(recent_ratio * budget))`` positions. With ``E = 1`` (decode) this is an
    ``argmin``; otherwise an ``argpartition`` -- never a full sort.
    """

    n_sink: int = attrs.field(default=4, validator=[instance_of(int), ge(0)])
    recent: int = attrs.field(default=0, validator=[instance_of(int), ge(0)])
    recent_ratio: float = attrs.field(default=0.0, converter=float, validator=[ge(0.0), lt(1.0)])

    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset({"protection"})

    def recent_window(self, budget: int) -> int:
        return max(self.recent, int(self.recent_ratio * budget))

    def reserved(self, budget: int) -> int:
        return self.n_sink + self.recent_window(budget)

    def protected(self, positions: mx.array, offset: int, budget: int) -> mx.array:
        keep = positions < self.n_sink
        r = self.recent_window(budget)
        if r:
            keep = keep | (positions >= offset - r)
        return keep

    def select(self, sel) -> mx.array:
        prot = sel.protected if sel.protected is not None else self.protected(sel.positions, sel.offset, sel.budget)
        s = mx.where(prot, mx.inf, sel.scores)
        if sel.n_evict == 1:
            return mx.argmin(s, axis=-1, keepdims=True)
        return mx.argpartition(s, kth=sel.n_evict - 1, axis=-1)[..., : sel.n_evict]
