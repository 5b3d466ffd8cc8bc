"""KIVI's quantized store (Liu et al., 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization
for KV Cache", arXiv 2402.02750): keys quantized per channel over groups of tokens, values per
token over groups of channels (Sec. 3.2), asymmetric (scale and zero point per group), packed in
MLX's affine layout; and the per-row state that holds the packed store. The disposition that
fills and attends it is :mod:`kvcompress_kivi.quant`.
"""

from __future__ import annotations

from typing import Optional

import attrs
import mlx.core as mx
import numpy as np

from kvcompress.errors import ConfigError

__all__ = ["KiviState", "kivi_quantize", "quantize_keys", "quantize_values"]


# --------------------------------------------------------------------------------------------
# Packing helpers
# --------------------------------------------------------------------------------------------


def kivi_quantize(x: mx.array, group: int, bits: int):
    """Asymmetric ``bits``-bit codes of ``x`` in groups of ``group`` along its last axis.

    ``s = (max - min) / (2^b - 1)`` and ``z = min`` per group (stored in ``x.dtype``), codes
    ``round((x - z) / s)`` clipped to ``[0, 2^b - 1]`` (computed with the stored ``s, z``), packed
    ``32 / b`` per ``uint32``, element ``i`` of a word in bits ``i*b .. i*b + b - 1``: MLX's
    affine layout, so ``dequantize = s * code + z``. A constant group gets ``s = 0``, codes 0.
    Returns ``(codes [..., n*b/32] uint32, scales [..., n/group], biases [..., n/group])``.
    """
    *lead, n = x.shape
    if n % group:
        raise ValueError(f"the quantized axis ({n}) must be a multiple of the group size ({group})")
    xg = x.astype(mx.float32).reshape(*lead, n // group, group)
    lo = xg.min(axis=-1, keepdims=True)
    hi = xg.max(axis=-1, keepdims=True)
    top = 2**bits - 1
    scale = ((hi - lo) / top).astype(x.dtype)
    bias = lo.astype(x.dtype)
    s = scale.astype(mx.float32)
    codes = mx.round((xg - bias.astype(mx.float32)) / mx.where(s > 0, s, 1.0))
    codes = mx.clip(codes, 0, top).astype(mx.uint32)
    per = 32 // bits
    words = codes.reshape(*lead, n // per, per) << (mx.arange(per, dtype=mx.uint32) * bits)
    return words.sum(axis=-1).astype(mx.uint32), scale[..., 0], bias[..., 0]


def quantize_keys(k: mx.array, group: int, bits: int):
    """Per-channel codes of ``k`` ``[B, H, T, D]`` (``T`` a multiple of ``group``).

    Returns ``(codes, scales, biases)`` of ``K^T``: ``[B, H, D, T*bits/32]`` uint32 and
    ``[B, H, D, T/group]``, so group ``j`` of channel ``c`` covers tokens ``j*g .. j*g+g-1``.
    """
    return kivi_quantize(k.swapaxes(-1, -2), group, bits)


def _pad_channels(v: mx.array, group: int) -> mx.array:
    """Pad the last axis to a multiple of ``group`` by repeating the last channel.

    The repeated channel never changes the min/max of the group it lands in, so the real
    channels get exactly the codes a group of the remaining width would give (MLX only
    supports groups of 32, 64 or 128, and toy models have head_dim 8 or 16).
    """
    d = v.shape[-1]
    pad = -d % group
    if pad == 0:
        return v
    return mx.concatenate([v, mx.repeat(v[..., -1:], pad, axis=-1)], axis=-1)


def quantize_values(v: mx.array, group: int, bits: int):
    """Per-token codes of ``v`` ``[B, H, T, D]``: ``[B, H, T, D'*bits/32]`` and ``[B, H, T, D'/group]``
    with ``D'`` = ``D`` rounded up to a multiple of ``group`` (see :func:`_pad_channels`)."""
    return kivi_quantize(_pad_channels(v, group), group, bits)


# --------------------------------------------------------------------------------------------
# State
# --------------------------------------------------------------------------------------------

#: (field, axis along T, T-units per token-column): keys' codes/params grow along their last
#: axis (``K^T``), values' along axis 2; a key code word holds ``32/bits`` tokens and a key
#: scale one group of tokens
_KEY_FIELDS = ("kq", "ks", "kb")
_VALUE_FIELDS = ("vq", "vs", "vb")
_STORE_FIELDS = _KEY_FIELDS + _VALUE_FIELDS


@attrs.define
class KiviState:
    """One layer's packed store and full-precision buffer, for every batch row.

    Arrays (``None`` until the first eviction), with ``W`` the store width (tokens, a multiple of
    ``g``, = the largest ``n_quant``):

    * ``kq`` ``[B, H, D, W*b/32]`` uint32 packed ``K^T``; ``ks``/``kb`` ``[B, H, D, W/g]`` its
      scales and zero points;
    * ``vq`` ``[B, H, W, D'*b/32]`` packed ``V``; ``vs``/``vb`` ``[B, H, W, D'/g]``;
    * ``buf_k``/``buf_v`` ``[B, H, g, D]``: evicted tokens waiting for a whole group, oldest first.

    Host ints per row: ``n_quant`` (tokens in the store, whole groups; columns past it are zeros)
    and ``n_buf`` (< g; buffer slots past it are zeros). Empty lists: the rows are not known yet
    (nothing stored or attended), which counts as one row holding nothing.
    """

    kq: Optional[mx.array] = None
    ks: Optional[mx.array] = None
    kb: Optional[mx.array] = None
    vq: Optional[mx.array] = None
    vs: Optional[mx.array] = None
    vb: Optional[mx.array] = None
    buf_k: Optional[mx.array] = None
    buf_v: Optional[mx.array] = None
    n_quant: list[int] = attrs.field(factory=list)
    n_buf: list[int] = attrs.field(factory=list)

    @property
    def rows(self) -> int:
        """Batch rows (1 while unknown)."""
        return max(len(self.n_quant), 1)

    @property
    def width(self) -> int:
        """Store width in tokens (the widest row's ``n_quant``)."""
        return 0 if self.vq is None else self.vq.shape[2]

    @property
    def empty(self) -> bool:
        """Nothing evicted yet (in any row)."""
        return not any(self.n_quant) and not any(self.n_buf)

    def arrays(self) -> list:
        return [getattr(self, f) for f in (*_STORE_FIELDS, "buf_k", "buf_v")]


def _with_rows(state: KiviState, b: int) -> KiviState:
    """``state`` with its host lists sized to ``b`` rows (a row-less state gets zeros)."""
    if len(state.n_quant) == b:
        return state
    if state.n_quant and len(state.n_quant) != b:
        raise ConfigError(f"kivi_quant state holds {len(state.n_quant)} rows but the step has {b}")
    return attrs.evolve(state, n_quant=[0] * b, n_buf=[0] * b)


def _units(field: str, group: int, bits: int) -> tuple[int, int]:
    """``(axis, units per group)`` of a store field along its token axis."""
    if field == "kq":
        return -1, group * bits // 32
    if field in ("ks", "kb"):
        return -1, 1
    if field == "vq" or field in ("vs", "vb"):
        return 2, group
    raise KeyError(field)


def _take(x: mx.array, axis: int, idx: np.ndarray) -> mx.array:
    """``x`` gathered along ``axis`` with per-row indices ``idx`` ``[B, n]`` (host ints)."""
    b, n = idx.shape
    shape = [b] + [1] * (x.ndim - 1)
    shape[axis] = n
    return mx.take_along_axis(x, mx.array(idx.astype(np.int32)).reshape(shape), axis=axis)


def _group_index(groups: np.ndarray, unit: int) -> np.ndarray:
    """Group indices ``[B, G]`` -> unit indices ``[B, G*unit]``."""
    return (groups[..., None] * unit + np.arange(unit)).reshape(groups.shape[0], -1)


def _zero_group(x: mx.array, axis: int, unit: int) -> mx.array:
    shape = list(x.shape)
    shape[axis] = unit
    return mx.zeros(shape, x.dtype)


# --------------------------------------------------------------------------------------------
# The disposition
# --------------------------------------------------------------------------------------------


def _unpack(codes: mx.array, scales: mx.array, biases: mx.array, group: int, bits: int, dtype=None) -> mx.array:
    """``scale * code + bias`` of MLX's affine layout (what ``mx.dequantize`` gives), as a few
    broadcast element-wise ops (faster than ``mx.dequantize`` on the CPU)."""
    per = 32 // bits
    dtype = dtype or scales.dtype
    lead, j = codes.shape[:-1], scales.shape[-1]
    shifts = mx.arange(per, dtype=mx.uint32) * bits
    c = ((codes.reshape(*lead, j, group // per, 1) >> shifts) & (2**bits - 1)).astype(dtype)
    x = c * scales.astype(dtype)[..., None, None] + biases.astype(dtype)[..., None, None]
    return x.reshape(*lead, j * group)
