"""The batched compressed KV cache: mlx-lm's batch-cache protocol (as ``BatchKVCache``).

Rows are independent sequences at different lengths: ``offset`` is an int32 array (one RoPE
offset per row), each row keeps its own budget, token count and eviction count, and a row's slots
that hold no token (left padding of a merge, right padding of a prompt, freed slots) have position
``-1``: they are never attended, scored, selected or merged into. A row frees exactly the slots
its own budget requires, at the step its own length requires, so every row evolves as it would
alone (ties in scores break by token position, and seeded draws are keyed by row-local facts).

``merge`` / ``extract`` / ``filter`` / ``extend`` / ``prepare`` / ``finalize`` follow
``mlx_lm.models.cache.BatchKVCache``: ``CompressedKVCache.merge`` builds one from per-sequence
caches, ``extract(i)`` returns row ``i`` as a per-sequence cache that continues exactly.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from .cache import CompressedKVCache, _rebuild
from .engine import Engine, batching
from .errors import ConfigError

__all__ = ["BatchCompressedKVCache"]

_KINDS = ("scorer", "selector", "disposition", "budget")


class BatchCompressedKVCache(Engine):
    """A compressed cache for a batch of left-padded sequences (``left_padding`` per row)."""

    BATCHED = True

    def __init__(self, method, budget, left_padding, layer=0, group=None, info=None):
        super().__init__(method, budget, layer=layer, group=group, info=info,
                         offsets=[-int(p) for p in left_padding])

    # -- what mlx-lm reads ------------------------------------------------------------------

    @property
    def offset(self) -> mx.array:
        """Tokens seen per row, ``[B]`` int32 (RoPE offsets of the next step)."""
        return self.offset_array()

    @property
    def left_padding(self) -> mx.array:
        """Empty slots per row."""
        return mx.array([self.slot_width - n for n in self.rows_held], dtype=mx.int32)

    @property
    def budget(self) -> list:
        return self.rows_budget

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs):
        """A nominal mask; attention applies the exact per-row slot mask itself."""
        if window_size is not None:
            raise ConfigError("kvcompress caches do not support sliding-window attention layers")
        if N == 1:
            return None
        return create_causal_mask(N, self.held_after(N)) if return_array else "causal"

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        return CompressedKVCache.to_quantized(self, group_size, bits)

    # -- prompt padding ---------------------------------------------------------------------

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        """Before a prompt step: left padding (empty cache only) or the right padding of a
        right-padded prompt (``lengths`` real tokens per row; the rest become empty slots)."""
        batching.prepare(self, left_padding, lengths, right_padding)

    def finalize(self):
        """After a right-padded prompt: offsets count real tokens only."""
        batching.finalize(self)

    # -- rows -------------------------------------------------------------------------------

    def extract(self, idx: int) -> CompressedKVCache:
        """Row ``idx`` as a single-sequence cache that continues exactly as this row would."""
        return batching.extract(self, idx, CompressedKVCache)

    def filter(self, batch_indices) -> None:
        """Keep only the given rows (in place)."""
        rows = batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices
        batching.filter_rows(self, [int(i) for i in rows])

    def extend(self, other: "BatchCompressedKVCache") -> None:
        """Append the rows of ``other`` (in place)."""
        batching.extend(self, other)

    @classmethod
    def merge(cls, caches: list) -> "BatchCompressedKVCache":
        """One batched cache whose rows are the given single-sequence caches, in order."""
        return batching.merge(cls, caches)

    @classmethod
    def from_state(cls, state, meta_state=None, registry=None):
        return _rebuild(cls, state, registry)

    def __repr__(self) -> str:
        return (
            f"BatchCompressedKVCache(method={self.method.name!r}, layer={self.info.layer}, "
            f"rows={len(self.rows_held)}, offset={self.rows_offset}, kept={self.rows_held})"
        )


# what ``CompressedKVCache.merge`` builds (cache.py does not import this module, which imports it)
CompressedKVCache.batch_class = BatchCompressedKVCache
