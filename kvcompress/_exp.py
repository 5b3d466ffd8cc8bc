"""``e^z`` for ``z <= 0`` in element-wise float32 arithmetic (no ``exp`` primitive): the softmax's
exponential where MLX's CPU ``exp`` (scalar, ~12 ns an element, up to ~60 ulp) would dominate
attention and the CPU kernels (:mod:`kvcompress._lowbit`) are not built; they compute the same
reduction and polynomial in C++."""

from __future__ import annotations

import math

import mlx.core as mx

__all__ = []

#: ``e^z`` for ``z <= 0`` (see :func:`kvcompress.ops._softmax`): ``z`` at or below this gives 0 (``e^-87 ~ 1.6e-38``)
_EXP_FLOOR = -87.0
_LN2_HI, _LN2_LO = 0.693145751953125, 1.428606765330187e-06  # ln 2 = hi + lo, hi exact in 12 bits
_EXP_TAYLOR = tuple(1.0 / math.factorial(k) for k in range(8))


def _exp_nonpositive(z: mx.array) -> mx.array:
    """``e^z`` for float32 ``z <= 0`` in element-wise float32 arithmetic (compiled: no ``exp``).

    Cody-Waite reduction ``z = n ln 2 + r`` with ``n = round(z / ln 2)`` (``ln 2`` split in two so
    ``r`` is exact) and ``|r| <= ln 2 / 2``; ``e^r`` by its degree-7 Taylor polynomial
    (truncation < 3e-9); ``2^n = 1 / ((2^(k // 4))^4 2^(k % 4))`` with ``k = -n``, from
    integer shifts and products of powers of two (exact). Within ~1 ulp of ``e^z`` (MLX's CPU
    ``exp``: up to ~60 ulp); ``z`` at or below :data:`_EXP_FLOOR` gives exactly 0, NaN gives NaN."""
    n = mx.round(mx.maximum(z, _EXP_FLOOR) * (1.0 / math.log(2)))  # in [-126, 0]
    r = (z - n * _LN2_HI) - n * _LN2_LO
    p = _EXP_TAYLOR[-1]
    for c in reversed(_EXP_TAYLOR[:-1]):
        p = p * r + c
    k = (-n).astype(mx.uint32)
    one = mx.array(1, mx.uint32)
    quarter = (one << (k >> 2)).astype(mx.float32)  # 2^(k // 4), k // 4 <= 31
    quarter = quarter * quarter
    two_k = quarter * quarter * (one << (k & 3)).astype(mx.float32)
    return mx.where(z <= _EXP_FLOOR, 0.0, p / two_k)  # NaN stays NaN
