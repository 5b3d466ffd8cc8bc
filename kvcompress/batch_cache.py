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

from . import _state
from ._engine import _Engine
from .cache import CompressedKVCache, _rebuild
from .errors import ConfigError
from .group import join
from .storage import concat_slots, contiguous, pad_slots, take_slots, zeros_like_rows

__all__ = ["BatchCompressedKVCache"]

_KINDS = ("scorer", "selector", "disposition", "budget")


class BatchCompressedKVCache(_Engine):
    """A compressed cache for a batch of left-padded sequences (``left_padding`` per row)."""

    _right: Optional[list] = None
    _off_key = None

    def __init__(self, method, budget, left_padding, layer=0, group=None, info=None):
        super().__init__(method, budget, layer=layer, group=group, info=info)
        b = len(left_padding)
        self._rows_n, self._rows_evicted = [0] * b, [0] * b
        self._rows_off = [-int(p) for p in left_padding]
        self._rows_budget = [self._b_default] * b
        self._rows_pass = [0] * b

    # -- what mlx-lm reads ------------------------------------------------------------------

    @property
    def offset(self) -> mx.array:
        """Tokens seen per row, ``[B]`` int32 (RoPE offsets of the next step)."""
        key = tuple(self._rows_off)
        if self._off_key != key:
            self._off_key, self._off_arr = key, mx.array(self._rows_off, dtype=mx.int32)
        return self._off_arr

    @property
    def left_padding(self) -> mx.array:
        """Empty slots per row."""
        return mx.array([self._n - n for n in self._rows_n], dtype=mx.int32)

    @property
    def budget(self) -> list:
        return list(self._rows_budget)

    def _rowwise(self, values: list):
        return list(values)

    def _proxy_blocked(self) -> bool:
        return True

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs):
        """A nominal mask; attention applies the exact per-row slot mask itself."""
        if window_size is not None:
            raise ConfigError("kvcompress caches do not support sliding-window attention layers")
        if N == 1:
            return None
        return create_causal_mask(N, max(self._rows_n or [0])) if return_array else "causal"

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        return CompressedKVCache.to_quantized(self, group_size, bits)

    # -- prompt padding ---------------------------------------------------------------------

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        """Before a prompt step: left padding (empty cache only) or the right padding of a
        right-padded prompt (``lengths`` real tokens per row; the rest become empty slots)."""
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("Left padding can only be added to an empty BatchCompressedKVCache")
            self._rows_off = [o - int(p) for o, p in zip(self._rows_off, left_padding)]
        if right_padding is not None and max(right_padding) > 0:
            self._new_valid = [int(x) for x in lengths]
            self._right = [int(x) for x in right_padding]

    def finalize(self):
        """After a right-padded prompt: offsets count real tokens only."""
        if self._right is not None:
            self._rows_off = [o - p for o, p in zip(self._rows_off, self._right)]
            self._right = self._new_valid = self._pad = None

    # -- rows -------------------------------------------------------------------------------

    def _layout(self, width: int):
        """``(keys, values, positions, scores)`` with every row's slots in ``width`` columns:
        held tokens last, empty slots first."""
        t = self._n
        k, v = self.keys_and_values()
        pos, score = self._pos, self._score
        if t > width:
            ar = mx.arange(t, dtype=mx.int32)
            order = mx.argsort(mx.where(pos >= 0, ar + t, ar), axis=-1)[..., t - width :]
            k, v = take_slots(k, order), take_slots(v, order)
            pos, score = mx.take_along_axis(pos, order, axis=-1), mx.take_along_axis(score, order, axis=-1)
        elif t < width:
            pad = [(0, 0), (0, 0), (width - t, 0)]
            k, v = pad_slots(k, width - t), pad_slots(v, width - t)
            pos, score = mx.pad(pos, pad, constant_values=-1), mx.pad(score, pad)
        return k, v, pos, score

    def _set_rows(self, rows: dict, parts: list, width: int) -> None:
        for name, value in rows.items():
            setattr(self, name, value)
        self._written = None
        if parts:
            k, v, pos, score = zip(*parts)
            self.keys, self.values = concat_slots(list(k), axis=0), concat_slots(list(v), axis=0)
            self._pos, self._score = mx.concatenate(pos, axis=0), mx.concatenate(score, axis=0)
            self._n = width
        else:
            self.keys = self.values = self._pos = self._score = None
            self._n = 0

    def extract(self, idx: int) -> CompressedKVCache:
        """Row ``idx`` as a single-sequence cache that continues exactly as this row would."""
        group = join(f"extract:{self.group.id}:{idx}", self.info.layer)
        c = CompressedKVCache(self.method, self._rows_budget[idx], info=self.info, group=group)
        c._rows_n, c._rows_off = [self._rows_n[idx]], [self._rows_off[idx]]
        c._rows_budget, c._rows_evicted = [self._rows_budget[idx]], [self._rows_evicted[idx]]
        c._rounds, c._query_steps, c._proxy_steps = self._rounds, self._query_steps, self._proxy_steps
        c._io_seen, c._g, c._restored = self._io_seen, self._g, self._restored
        c._rows_pass = [self._rows_pass[idx]]
        c._passes, c._pass_seconds = self._passes, self._pass_seconds
        for kind in _KINDS:
            c._states[kind] = _state.take_rows(self.method.component(kind), self._hooks.of(kind).take_rows,
                                               self._states[kind], [idx])
        if self.keys is not None:
            n = self._rows_n[idx]
            row = _sub(self, [idx])
            k, v, pos, score = row._layout(n)
            c.keys, c.values = contiguous(k), contiguous(v)
            c._pos, c._score, c._n = mx.contiguous(pos), mx.contiguous(score), n
        return c

    def filter(self, batch_indices) -> None:
        """Keep only the given rows (in place)."""
        rows = [int(i) for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices)]
        for kind in _KINDS:
            self._states[kind] = _state.take_rows(self.method.component(kind), self._hooks.of(kind).take_rows,
                                                  self._states[kind], rows)
        sub = _sub(self, rows)
        host = {name: [getattr(self, name)[i] for i in rows] for name in _HOST}
        for name in ("_pad", "_new_valid", "_right"):  # a prompt in progress keeps its rows' padding
            if getattr(self, name, None) is not None:
                setattr(self, name, [getattr(self, name)[i] for i in rows])
        width = max(host["_rows_n"], default=0)
        self._set_rows(host, [sub._layout(width)] if self.keys is not None else [], width)
        self._undo = None

    def extend(self, other: "BatchCompressedKVCache") -> None:
        """Append the rows of ``other`` (in place)."""
        _check_same(self, other)
        caches = [self, other]
        for kind in _KINDS:
            comp = self.method.component(kind)
            self._states[kind] = _state.stack_rows(
                comp, self._hooks.of(kind).stack_rows, [c._states[kind] for c in caches], [len(c._rows_n) for c in caches]
            )
        host = {name: getattr(self, name) + getattr(other, name) for name in _HOST}
        width = max(self._n, other._n)
        self._set_rows(host, _layouts(caches, width), width)
        self._rounds = max(self._rounds, other._rounds)
        self._passes = max(self._passes, other._passes)
        self._pass_seconds += other._pass_seconds
        self._undo = None

    @classmethod
    def merge(cls, caches: list) -> "BatchCompressedKVCache":
        """One batched cache whose rows are the given single-sequence caches, in order."""
        first = caches[0]
        for c in caches:
            _check_same(first, c)
        key = "merge:" + ",".join(c.group.id for c in caches)
        out = cls(first.method, first._b_default, [], info=first.info, group=join(key, first.info.layer))
        host = {name: sum((_host_rows(c)[name] for c in caches), []) for name in _HOST}
        for kind in _KINDS:
            comp = first.method.component(kind)
            out._states[kind] = _state.stack_rows(
                comp, first._hooks.of(kind).stack_rows, [c._states[kind] for c in caches],
                [max(len(c._rows_n), 1) for c in caches]
            )
        width = max(c._n for c in caches)
        out._set_rows(host, _layouts(caches, width), width)
        out._rounds = max(c._rounds for c in caches)
        out._query_steps = sum(c._query_steps for c in caches)
        out._proxy_steps = sum(c._proxy_steps for c in caches)
        out._io_seen = all(c._io_seen for c in caches)
        out._restored = any(c._restored for c in caches)
        out._g = max(c._g for c in caches)
        out._passes = max(c._passes for c in caches)  # each row's own count is in _rows_pass
        out._pass_seconds = sum(c._pass_seconds for c in caches)
        return out

    @classmethod
    def from_state(cls, state, meta_state=None, registry=None):
        return _rebuild(cls, state, registry)

    def __repr__(self) -> str:
        return (
            f"BatchCompressedKVCache(method={self.method.name!r}, layer={self.info.layer}, "
            f"rows={len(self._rows_n)}, offset={self._rows_off}, kept={self._rows_n})"
        )


_HOST = ("_rows_n", "_rows_off", "_rows_budget", "_rows_evicted", "_rows_pass")


def _check_same(a, b) -> None:
    if not isinstance(b, _Engine):
        raise ConfigError(f"cannot batch a kvcompress cache with a {type(b).__name__}")
    if a.method.config != b.method.config or a.info != b.info:
        raise ConfigError(
            f"cannot batch caches of different methods or layers: {a.method.describe()} (layer "
            f"{a.info.layer}) vs {b.method.describe()} (layer {b.info.layer})"
        )


def _host_rows(c) -> dict:
    """A cache's per-row host lists (an empty single cache counts as one row holding nothing)."""
    if c._rows_n:
        return {name: list(getattr(c, name)) for name in _HOST}
    return {"_rows_n": [0], "_rows_off": [0], "_rows_budget": [c._b_default], "_rows_evicted": [0], "_rows_pass": [0]}


def _sub(cache, rows: list):
    """A light copy of ``cache`` holding only ``rows`` (storage and host lists)."""
    sub = object.__new__(type(cache))
    sub.__dict__.update(cache.__dict__)
    sub._written = None
    idx = mx.array(rows, dtype=mx.int32)
    if cache.keys is not None:
        k, v = cache.keys_and_values()
        sub.keys, sub.values, sub._pos, sub._score = k[idx], v[idx], cache._pos[idx], cache._score[idx]
    for name in _HOST:
        setattr(sub, name, [getattr(cache, name)[i] for i in rows])
    return sub


def _layouts(caches: list, width: int) -> list:
    """Every cache's rows laid out in ``width`` columns (empty caches as empty rows)."""
    like = next((c for c in caches if c.keys is not None), None)
    if like is None:
        return []
    h = like.keys.shape[1]
    parts = []
    for c in caches:
        if c.keys is not None:
            parts.append(c._layout(width) if isinstance(c, BatchCompressedKVCache) else _single_layout(c, width))
            continue
        b = max(len(c._rows_n), 1)
        parts.append((
            zeros_like_rows(like.keys, b, h, width), zeros_like_rows(like.values, b, h, width),
            mx.full((b, h, width), -1, mx.int32), mx.zeros((b, h, width), mx.float32),
        ))
    return parts


def _single_layout(c, width: int):
    return BatchCompressedKVCache._layout(c, width)


# what ``CompressedKVCache.merge`` builds (cache.py does not import this module, which imports it)
CompressedKVCache._batch_class = BatchCompressedKVCache
