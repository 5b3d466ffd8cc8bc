"""AdaKV's head-wise budgets as a selector (Feng et al., 2024, "Ada-KV: Optimizing KV Cache
Eviction by Adaptive Budget Allocation for Efficient LLM Inference", arXiv 2407.11550).

A layer keeps ``H x C`` tokens in total, but its heads need not keep ``C`` each: AdaKV selects
the top ``H x C`` (head, token) pairs of the whole layer by score (Alg. 1), so a head whose
attention is concentrated keeps few tokens and a head whose attention is spread keeps many,
with a safeguard: each head keeps at least ``alpha x C`` of its own best tokens (Sec. 4.2).

Here the cache stores the ``g`` heads of a *head group* in one row of ``g x C`` slots (the
:meth:`head_group` hook; ``heads = 0``: every KV head of the layer on this rank), each slot
tagged with its head, so the heads really hold different numbers of tokens within the bytes of
uniform budgets -- unlike kvpress's AdaKV, which masks pruned keys and frees nothing. The
selector evicts the lowest-score slots of the row, per (row), after protecting every head's
sinks, recent window and ``ceil(alpha x C)`` best slots. Scores must be comparable across heads
(attention masses are: each head's softmax sums to one per query).

Cost: a query head attends the ``g x C`` slots of its row under a mask (decode attention does
``g`` times the work of uniform budgets); ``heads`` trades flexibility for speed. ``step``: each
eviction frees a multiple of ``step`` slots of the row (the method's default 16; at least the
``g`` a decode step needs), so decode ranks each head's slots once every ``step / g`` tokens
instead of every token, and the following tokens refill the freed slots first.
"""

from __future__ import annotations

import math
from typing import ClassVar

import attrs
import mlx.core as mx
from attrs.validators import ge, instance_of, le

from kvcompress import ConfigError
from kvcompress.ops import lowest_k, sortable_bits
from kvcompress_basic.selectors import LowestScoreSelector

__all__ = ["AdaptiveSelector", "head_ranks"]


def head_ranks(scores: mx.array, owner: mx.array, g: int) -> mx.array:
    """``[B, R, T]`` int32: each slot's rank by score (0 = best) among its own head's slots of
    the row (empty slots, owner -1, rank after every real slot)."""
    t = scores.shape[-1]
    # sort by (owner, -score): each head's slots contiguous, best first
    own = mx.where(owner >= 0, owner, g).astype(mx.uint64)
    order = mx.argsort((own << 32) | sortable_bits(-scores.astype(mx.float32)).astype(mx.uint64), axis=-1)
    rank_sorted = mx.argsort(order, axis=-1).astype(mx.int32)  # where each slot landed
    counts = (owner[..., None] == mx.arange(g, dtype=owner.dtype)).astype(mx.int32).sum(axis=-2)  # [B, R, g]
    start = mx.concatenate([mx.zeros(counts.shape[:-1] + (1,), mx.int32), mx.cumsum(counts, axis=-1)], axis=-1)
    first = mx.take_along_axis(start, mx.where(owner >= 0, owner, g).astype(mx.int32), axis=-1)
    return mx.where(owner >= 0, rank_sorted - first, t)


@attrs.frozen
class AdaptiveSelector(LowestScoreSelector):
    """Evict the lowest-score slots of a head group's row; every head keeps what the ``lowest``
    selector protects (its sinks and its ``max(recent, floor(recent_ratio * C))`` most recent
    tokens) and its ``ceil(alpha * C)`` best; ``step`` rounds each eviction up to a multiple of
    ``step`` slots."""

    n_sink: int = attrs.field(default=0, validator=[instance_of(int), ge(0)])
    alpha: float = attrs.field(default=0.2, converter=float, validator=[ge(0.0), le(1.0)])
    heads: int = attrs.field(default=0, validator=[instance_of(int), ge(0)])
    step: int = attrs.field(default=1, validator=[instance_of(int), ge(1)])

    requires: ClassVar[frozenset] = frozenset()  # head_groups from scorer and disposition (checked at build)
    provides: ClassVar[frozenset] = frozenset({"protection", "head_wise_budgets"})

    def head_group(self, layer, n_kv_heads: int) -> int:
        """KV heads per row: ``heads``, or every KV head of the layer (``heads = 0``)."""
        if self.heads == 0:
            if layer.tp_size > 1 and not layer.kv_replicated:
                raise ConfigError(
                    "adaptive (AdaKV) over every KV head of a layer cannot be exact under tensor "
                    "parallelism (each rank holds some heads); set heads= to a divisor of the heads "
                    f"each rank holds ({n_kv_heads})"
                )
            return n_kv_heads
        if n_kv_heads % self.heads:
            raise ConfigError(f"adaptive heads={self.heads} must divide the layer's {n_kv_heads} KV heads")
        return self.heads

    def _floor(self, budget):
        """Each head's own best kept: ``ceil(alpha x C)``, below ``C`` so a full head can evict."""
        if isinstance(budget, mx.array):
            return mx.minimum(mx.ceil(budget.astype(mx.float32) * self.alpha).astype(mx.int32), budget - 1)
        return min(math.ceil(self.alpha * budget), budget - 1)

    def reserved(self, budget: int) -> int:
        # the floor counts a head's protected tokens first (they rank best), so they overlap;
        # an eviction rounded up to ``step`` slots may take up to ``step - 1`` more
        return max(super().reserved(budget), self._floor(budget)) + self.step - 1

    def evict_count(self, n_evict: int) -> int:
        """``step * ceil(E / step)``: the slots :meth:`select` frees when ``E`` are needed."""
        return self.step * math.ceil(n_evict / self.step)

    def select(self, sel) -> mx.array:
        protected = sel.protected
        if sel.owner is not None and self.alpha > 0:
            floor = self._floor(sel.budget)
            best = head_ranks(mx.where(protected, mx.inf, sel.scores), sel.owner, sel.heads_per_row)
            protected = protected | (best < floor)
        return lowest_k(sel.scores, sel.positions, self.evict_count(sel.n_evict), ordered=sel.row_counts is not None, exclude=protected)
