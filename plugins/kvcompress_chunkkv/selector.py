"""ChunkKV's chunk selector (Liu et al., 2025, "ChunkKV: Semantic-Preserving KV Cache
Compression for Efficient Long-Context LLM Inference", Algorithm 1).

Tokens are grouped into chunks of ``c`` consecutive *positions*, chunk ``q = p // c``. A chunk's
score is the sum of its tokens' scores (Algorithm 1 sums the observation-window attention)::

    S_q = sum_{j : p_j // c = q} s_j

and the selector evicts the ``ceil(E / c)`` lowest-scoring whole chunks, per (batch, KV head),
where ``E`` is the number of slots the cache must free. That may free up to ``c - 1`` more slots
than needed; the cache refills them before evicting again (allowed by the Selector protocol).

Protected chunks never leave: any chunk holding a protected token (the first ``n_sink``
positions, the ``recent`` most recent ones) and the *open* chunk still being filled. Since only
whole chunks are ever evicted, every other chunk is complete, so every head frees exactly
``c * ceil(E / c)`` slots and the cache stays rectangular.

Chunks with equal scores go to the older chunk (lowest start position), so the choice does
not depend on slot order or batch layout; with per-row counts (a batch whose rows free different
numbers of slots) chunks come out in priority order.

Layer-wise index reuse (ChunkKV Sec. "Layer-wise Index Reuse"): with ``reuse_layers = R > 1``
the first layer of each group of ``R`` adjacent layers selects and the others evict the same
slots, shared through the prompt's group (``sel.group.scratch``, within one step). This is exact because layers that always evict
the same slots keep identical slot layouts; a layer whose budget or length differs from its
group's first layer (e.g. under a pyramid budget) selects on its own scores instead.
"""

from __future__ import annotations

import math
from functools import reduce
from typing import ClassVar

import attrs
import mlx.core as mx
from attrs.validators import ge, instance_of

from kvcompress.ops import lowest_k

__all__ = ["ChunkSelector"]

_REUSE_KEY = "chunkkv.reuse"


def _shifted(x: mx.array, c: int, fill) -> list:
    """``[x[..., j : j + T]`` for ``j < c``], padding the end with ``fill``."""
    t = x.shape[-1]
    pad = mx.full(x.shape[:-1] + (c - 1,), fill, dtype=x.dtype)
    xp = mx.concatenate([x, pad], axis=-1) if c > 1 else x
    return [xp[..., j : j + t] for j in range(c)]


@attrs.frozen
class ChunkSelector:
    """Evict whole chunks of ``chunk`` consecutive positions with the lowest summed score.

    ``n_sink`` / ``recent`` protect the first / most recent positions as in ``lowest`` (and
    their whole chunks); ``reuse_layers`` shares one layer's choice with the next R-1 layers.
    """

    chunk: int = attrs.field(default=10, validator=[instance_of(int), ge(1)])
    n_sink: int = attrs.field(default=0, validator=[instance_of(int), ge(0)])
    recent: int = attrs.field(default=0, validator=[instance_of(int), ge(0)])
    reuse_layers: int = attrs.field(default=1, validator=[instance_of(int), ge(1)])

    requires: ClassVar[frozenset] = frozenset({"positions"})
    provides: ClassVar[frozenset] = frozenset({"protection", "chunks"})

    def reserved(self, budget: int) -> int:
        """Worst-case protected slots plus the ``c - 1`` rounding slack of whole-chunk eviction.

        Sink chunks span ``c * ceil(n_sink / c)`` slots; the window's chunks (or the open chunk)
        at most ``recent + c - 1``. A budget above this always leaves ``ceil(E / c)`` complete
        unprotected chunks to evict.
        """
        c = self.chunk
        sinks = c * math.ceil(self.n_sink / c)
        return sinks + self.recent + c - 1 + c - 1

    def evict_count(self, n_evict: int, budget: int) -> int:
        """Slots :meth:`select` frees when ``n_evict`` are needed: whole chunks, ``c * ceil(E / c)``
        (the cache uses it to size array masks before the step)."""
        return self.chunk * -(-n_evict // self.chunk)

    def protected(self, positions: mx.array, offset: mx.array, budget) -> mx.array:
        keep = positions < self.n_sink
        if self.recent:
            keep = keep | (positions >= offset - self.recent)
        return keep

    def chunk_scores(self, scores: mx.array, positions: mx.array, offset: mx.array, protected: mx.array):
        """``(order, key, start)``: slots sorted by position; per sorted slot the summed score of
        the complete, unprotected chunk starting there (``+inf`` everywhere else), and its position."""
        c = self.chunk
        order = mx.argsort(positions, axis=-1)
        pos = mx.take_along_axis(positions, order, axis=-1)
        s = mx.take_along_axis(scores.astype(mx.float32), order, axis=-1)
        prot = mx.take_along_axis(protected, order, axis=-1)
        cid = mx.where(pos >= 0, pos // c, -1)
        open_ = (offset % c != 0) & (cid == (offset - 1) // c)  # the open chunk is still filling
        prot = prot | open_ | (pos < 0)
        first = mx.concatenate([mx.ones(cid.shape[:-1] + (1,), mx.bool_), cid[..., 1:] != cid[..., :-1]], axis=-1)
        complete = first & (_shifted(cid, c, -1)[-1] == cid)
        total = reduce(mx.add, _shifted(s, c, 0.0))
        touched = reduce(mx.logical_or, _shifted(prot, c, False))
        key = mx.where(complete & ~touched, total, mx.inf)
        return order, key, pos

    def bind(self, model, layers, states) -> None:
        """Refuse index reuse across pipeline ranks: a reuse group's first layer must be local."""
        if self.reuse_layers == 1 or not layers:
            return None
        first = min(info.layer for info in layers)
        for info in layers:
            head = info.layer - info.layer % self.reuse_layers
            if head < first:
                from kvcompress import ConfigError

                raise ConfigError(
                    f"chunk reuse_layers={self.reuse_layers}: layer {info.layer} reuses layer {head}'s "
                    "choice, which another pipeline rank holds; use a reuse_layers that divides each "
                    "rank's first layer index, or reuse_layers=1"
                )

    def select(self, sel) -> mx.array:
        c = self.chunk
        reuse = self.reuse_layers > 1
        if reuse:
            store = sel.group.scratch.setdefault(_REUSE_KEY, {}) if sel.group is not None else {}
            layer = sel.layer.layer
            head = layer - layer % self.reuse_layers
            stamp = (sel.offsets, str(sel.budget), tuple(sel.positions.shape), sel.n_evict)
            rec = store.get(head)
            if layer != head and rec is not None and rec[0] == stamp:
                return rec[1]
        order, key, pos = self.chunk_scores(sel.scores, sel.positions, sel.offset, sel.protected)
        k = self.evict_count(sel.n_evict, sel.widest_budget()) // c
        starts = lowest_k(key, pos, k, ordered=sel.row_counts is not None)
        sorted_idx = (starts[..., None] + mx.arange(c)).reshape(*starts.shape[:-1], k * c)
        evict = mx.take_along_axis(order, sorted_idx, axis=-1).astype(mx.int32)
        if reuse and layer == head:
            store[head] = (stamp, evict)
        return evict
