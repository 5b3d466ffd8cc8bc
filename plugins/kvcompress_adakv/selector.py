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
sinks, recent window and ``ceil(alpha x C)`` best slots (:func:`head_best`: by score, ties to
the newer token, exactly that many). Scores must be comparable across heads (attention masses
are: each head's softmax sums to one per query).

Cost: a query head attends only its own KV head's slots of the row, gathered (a prompt chunk) or
listed as columns (a decode step), so attention does about the work of uniform budgets plus
one product over the row; ``heads`` trades flexibility for speed. ``step``: each eviction frees
a multiple of ``step`` slots of the row (``step = 0``, the method's default: ``ceil(C / 32)``,
about 1/(32 g) of a row of ``g x C`` slots; at least the ``g`` a decode step needs), so decode
selects once every ``step / g`` tokens instead of every token, and the following tokens refill
the freed slots in place: on average the row holds ``step / 2`` slots fewer than its bytes.
"""

from __future__ import annotations

import math
from typing import ClassVar

import attrs
import mlx.core as mx
from attrs.validators import ge, instance_of, le

from kvcompress import ConfigError
from kvcompress.ops import lowest_k, owner_mask, sortable_bits
from kvcompress_basic.selectors import LowestScoreSelector

__all__ = ["AdaptiveSelector", "head_best"]


def head_best(scores: mx.array, owner: mx.array, positions: mx.array, g: int, k) -> mx.array:
    """``[B, R, T]`` bool: each head's ``k`` best slots of its row by score, ties to the newer
    token (all of a head holding fewer than ``k``; never an empty slot, owner -1). ``k``: an int,
    or ``[B, 1, 1]`` per row. One partition per head (a sort only for per-row ``k``), not a rank
    of every slot."""
    # (score, position) as one unsigned key, larger = better (a head's positions are distinct);
    # inverted, smaller = better, the largest value for the slots of other heads
    key = (sortable_bits(scores.astype(mx.float32)).astype(mx.uint64) << 32) | mx.maximum(positions, 0).astype(mx.uint64)
    inv = ~key
    top = mx.full((1,), -1, mx.int64).view(mx.uint64)
    mine = owner_mask(owner, g, g)  # [B, R, g, T]: head h's slots
    worse = mx.where(mine, inv[..., None, :], top)  # each head's, best first
    if isinstance(k, mx.array):
        kk = mx.broadcast_to(k.reshape(-1, 1, 1, 1), worse.shape[:-1] + (1,)).astype(mx.int32)
        kth = mx.take_along_axis(mx.sort(worse, axis=-1), mx.clip(kk - 1, 0, None), axis=-1)
        kth = mx.where(kk > 0, kth, 0)  # k = 0: nothing is within 0 of the best
    elif k <= 0:
        return mx.zeros(owner.shape, mx.bool_)
    else:
        k = min(k, worse.shape[-1])
        kth = mx.partition(worse, k - 1, axis=-1)[..., k - 1 : k]  # [B, R, g, 1]: the k-th best
    thr = mx.take_along_axis(kth[..., 0], mx.maximum(owner, 0).astype(mx.int32), axis=-1)
    return (owner >= 0) & (inv <= thr)


@attrs.frozen
class AdaptiveSelector(LowestScoreSelector):
    """Evict the lowest-score slots of a head group's row; every head keeps what the ``lowest``
    selector protects (its sinks and its ``max(recent, floor(recent_ratio * C))`` most recent
    tokens) and its ``ceil(alpha * C)`` best; ``step`` rounds each eviction up to a multiple of
    ``step`` slots (0: ``ceil(C / 32)`` for a budget of ``C``)."""

    n_sink: int = attrs.field(default=0, validator=[instance_of(int), ge(0)])
    alpha: float = attrs.field(default=0.2, converter=float, validator=[ge(0.0), le(1.0)])
    heads: int = attrs.field(default=0, validator=[instance_of(int), ge(0)])
    step: int = attrs.field(default=1, validator=[instance_of(int), ge(0)])

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
        return max(super().reserved(budget), self._floor(budget)) + self._step(budget) - 1

    def _step(self, budget: int) -> int:
        return self.step or max(1, math.ceil(budget / 32))

    def evict_count(self, n_evict: int, budget: int) -> int:
        """``step * ceil(E / step)``: the slots :meth:`select` frees when ``E`` are needed."""
        step = self._step(budget)
        return step * math.ceil(n_evict / step)

    def select(self, sel) -> mx.array:
        protected = sel.protected
        if sel.owner is not None and self.alpha > 0:
            floor = self._floor(sel.budget)
            protected = protected | head_best(mx.where(protected, mx.inf, sel.scores), sel.owner,
                                              sel.positions, sel.heads_per_row, floor)
        k = max(self.evict_count(sel.n_evict, b) for b in (sel.budgets or (sel.widest_budget(),)))
        return lowest_k(sel.scores, sel.positions, k, ordered=sel.row_counts is not None, exclude=protected)
