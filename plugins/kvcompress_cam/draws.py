"""CaM's gate draws: ``merge ~ Bernoulli(p)`` (Eq. 14) from a counter-based hash, not ``mx.random``.

Each uniform is a hash of (seed, global layer, global KV head, tokens the row has seen, the
loser's position): global identities and row-local facts, so a sequence draws the same alone,
in any batch row, or with its heads split across machines. The (seed, layer, head, offset) part
can be hashed on the host (:func:`_host_draw_keys`, the same bits as :func:`_draw_keys`), so a
decode step only mixes in the losers' positions on the device.
"""

from __future__ import annotations

import functools

import mlx.core as mx

__all__ = ["gate_uniforms", "bernoulli_gate"]


def _c32(c: int) -> mx.array:
    return mx.array(c, mx.uint32)


def _mix32(x: mx.array) -> mx.array:
    """A 32-bit integer hash (the "lowbias32" finalizer): uniform bits from consecutive inputs."""
    x = x ^ (x >> _c32(16))
    x = x * _c32(0x7FEB352D)
    x = x ^ (x >> _c32(15))
    x = x * _c32(0x846CA68B)
    return x ^ (x >> _c32(16))


def _mix32_int(x: int) -> int:
    """:func:`_mix32` of a host int (the same bits)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def _seed_base(seed: int, layer: int) -> int:
    return (seed * 0x9E3779B1 + layer * 0x85EBCA77 + 0x27D4EB2F) & 0xFFFFFFFF


def _u32(x) -> mx.array:
    return (x if isinstance(x, mx.array) else mx.array(x)).astype(mx.uint32)


def _draw_keys(base: mx.array, heads: mx.array, offset: mx.array) -> mx.array:
    """The hash of (base, head, offset) that each loser's position is then mixed into."""
    h = _mix32(base ^ _mix32(heads * _c32(0x9E3779B1) + _c32(0x68E31DA4)))
    return _mix32(h ^ (offset * _c32(0x85EBCA77)))


@functools.lru_cache(maxsize=4096)
def _head_keys(base: int, heads: tuple) -> tuple:
    """The (base, head) part of :func:`_draw_keys` per head, as host ints (constant per layer)."""
    return tuple(_mix32_int(base ^ _mix32_int((hd * 0x9E3779B1 + 0x68E31DA4) & 0xFFFFFFFF)) for hd in heads)


def _host_draw_keys(base: int, heads: tuple, offsets: tuple) -> mx.array:
    """:func:`_draw_keys` ``[B, H, 1]`` computed on the host (the same bits, no device ops)."""
    hk = _head_keys(base, heads)
    rows = [[_mix32_int(k ^ ((o * 0x85EBCA77) & 0xFFFFFFFF)) for k in hk] for o in offsets]
    return mx.array(rows, dtype=mx.uint32).reshape(len(offsets), len(heads), 1)


def _draws(keys: mx.array, pos: mx.array) -> mx.array:
    """Uniforms in [0, 1) from :func:`_draw_keys` and the losers' positions."""
    bits = _mix32(keys ^ (_u32(pos) * mx.array(0xC2B2AE3D, mx.uint32) + mx.array(0x165667B1, mx.uint32)))
    return (bits >> 8).astype(mx.float32) * (1.0 / (1 << 24))


def _uniforms(base: mx.array, heads: mx.array, offset: mx.array, pos: mx.array) -> mx.array:
    """Uniforms in [0, 1) from the uint32 hash of (base, head, offset, loser position)."""
    return _draws(_draw_keys(base, _u32(heads), _u32(offset)), pos)


def gate_uniforms(seed: int, layer: int, heads, offset, positions) -> mx.array:
    """Uniforms in [0, 1) indexed by (seed, global layer, global KV head, tokens seen, position).

    ``heads`` ``[1, H, 1]``, ``offset`` ``[B, 1, 1]`` and ``positions`` ``[B, H, E]`` broadcast to
    the result's shape. Each value depends only on its own indices, never on the batch, the slot
    order or ``mx.random``'s global state.
    """
    return _uniforms(mx.array(_seed_base(seed, layer), mx.uint32), heads, offset, positions)


def bernoulli_gate(p: mx.array, seed: int, layer: int, heads, offset, positions) -> mx.array:
    """``merge ~ Bernoulli(p)`` with :func:`gate_uniforms` draws."""
    return gate_uniforms(seed, layer, heads, offset, positions) < p


def gate_probability(loser_score: mx.array, target_score: mx.array) -> mx.array:
    """Eq. 14: ``clamp(A_l / A_t, 0, 1)``; a non-positive target gives 1 iff ``A_l >= A_t``."""
    ratio = loser_score / mx.where(target_score > 0, target_score, 1.0)
    return mx.where(target_score > 0, mx.clip(ratio, 0.0, 1.0), (loser_score >= target_score).astype(mx.float32))
