"""Span selector: keep a token when some ``w``-token span containing it is informative.

Selective Context ranks *lexical units* (phrases, sentences) by the sum of their tokens'
self-information (Li et al., 2023, Eq. 3) and keeps the best units whole. Fixed chunks
(``chunk``: positions ``q c .. q c + c - 1``) approximate units badly: a planted fact of 12-16
tokens usually straddles two chunks, and the half that holds the answer after a surprising
name (``... was born in the small town of Lingar.``) scores low and leaves. Here every
window of ``w`` consecutive stored slots (in position order) is a candidate unit, and a token
scores the best unit that contains it::

    U_j = sum_{i=j}^{j+w-1} s_i                (Eq. 3 with w-token units, every start j)
    S_t = max_{t-w < j <= t} U_j               (the best unit holding token t)

and the ``E`` unprotected slots with the lowest ``S`` leave (ties to the older token). A
fact's tokens share its unit's score, so it stays or leaves as a whole, whatever its offset.
Protected slots (sinks, the recent window, empty slots) add nothing to a unit, so a sink's
``UNKNOWN`` score does not hold its neighbours.

``step``: each eviction frees a multiple of ``step`` slots (at least ``E``), so decode selects
once every ``step`` tokens instead of every token; the cache refills the freed slots first.
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import attrs
import mlx.core as mx
from attrs.validators import ge, instance_of, lt
from kvcompress_basic.selectors import LowestScoreSelector

from kvcompress.ops import lowest_k

__all__ = ["SpanSelector"]


def _shift(x: mx.array, k: int, fill: float) -> mx.array:
    """``y[..., t] = x[..., t - k]`` (``fill`` where ``t - k`` falls outside); ``k`` may be < 0."""
    t = x.shape[-1]
    if k == 0:
        return x
    pad = mx.full(x.shape[:-1] + (min(abs(k), t),), fill, dtype=x.dtype)
    if k > 0:
        return mx.concatenate([pad, x[..., : max(t - k, 0)]], axis=-1)
    return mx.concatenate([x[..., min(-k, t):], pad], axis=-1)


def _unit_sums(s: mx.array, w: int) -> mx.array:
    """``e[..., u] = s[..., u - w + 1] + ... + s[..., u]``: the unit ending at ``u``, summed in
    the same order at every ``u`` (a row's padding never changes a sum's rounding)."""
    e = s
    for k in range(1, w):
        e = e + _shift(s, k, 0.0)
    return e


def _ahead_max(x: mx.array, w: int) -> mx.array:
    """``y[..., t] = max(x[..., t .. t + w - 1])`` (clipped at the end), by doubling."""
    m, width = x, 1
    while 2 * width <= w:
        m = mx.maximum(m, _shift(m, -width, -mx.inf))
        width *= 2
    return m if width == w else mx.maximum(m, _shift(m, -(w - width), -mx.inf))


@attrs.frozen
class SpanSelector:
    """Evict the slots whose best ``span``-token unit has the lowest summed score (module
    docstring). ``n_sink`` / ``recent`` / ``recent_ratio`` protect as in ``lowest`` (the
    most recent ``max(recent, floor(recent_ratio * budget))`` positions); ``step`` rounds each
    eviction up to a multiple of ``step`` slots."""

    span: int = attrs.field(default=16, validator=[instance_of(int), ge(1)])
    n_sink: int = attrs.field(default=4, validator=[instance_of(int), ge(0)])
    recent: int = attrs.field(default=32, validator=[instance_of(int), ge(0)])
    recent_ratio: float = attrs.field(default=0.0, converter=float, validator=[ge(0.0), lt(1.0)])
    step: int = attrs.field(default=16, validator=[instance_of(int), ge(1)])

    requires: ClassVar[frozenset] = frozenset({"positions"})
    provides: ClassVar[frozenset] = frozenset({"protection"})

    @functools.cached_property
    def _window(self) -> LowestScoreSelector:
        """``lowest``'s protection with the same parameters (built once per selector)."""
        return LowestScoreSelector(self.n_sink, self.recent, self.recent_ratio)

    def reserved(self, budget: int) -> int:
        """Sinks, the recent window and the ``step - 1`` slots an eviction may round up by."""
        return self._window.reserved(budget) + self.step - 1

    def evict_count(self, n_evict: int, budget: int) -> int:
        """``step * ceil(E / step)``: the slots :meth:`select` frees when ``E`` are needed."""
        return self.step * math.ceil(n_evict / self.step)

    def protected(self, positions: mx.array, offset: mx.array, budget) -> mx.array:
        return self._window.protected(positions, offset, budget)

    def _sorted(self, scores: mx.array, positions: mx.array, protected: mx.array) -> tuple:
        """``(order, positions, protected, S)`` of the slots sorted by position, ``S_t`` the
        largest sum over the units ending at ``t .. t + w - 1`` (protected slots add 0)."""
        order = mx.argsort(positions, axis=-1)
        pos = mx.take_along_axis(positions, order, axis=-1)
        prot = mx.take_along_axis(protected, order, axis=-1)
        s = mx.where(prot, 0.0, mx.take_along_axis(scores.astype(mx.float32), order, axis=-1))
        w = min(self.span, s.shape[-1])
        return order, pos, prot, _ahead_max(_unit_sums(s, w), w)

    def span_scores(self, scores: mx.array, positions: mx.array, protected: mx.array) -> tuple:
        """``(order, S)``: slots sorted by position and each sorted slot's best-unit score."""
        order, _, _, best = self._sorted(scores, positions, protected)
        return order, best

    def select(self, sel) -> mx.array:
        order, pos, prot, best = self._sorted(sel.scores, sel.positions, sel.protected)
        k = self.evict_count(sel.n_evict, sel.widest_budget())
        idx = lowest_k(best, pos, k, ordered=sel.row_counts is not None, exclude=prot)
        return mx.take_along_axis(order, idx, axis=-1).astype(mx.int32)
