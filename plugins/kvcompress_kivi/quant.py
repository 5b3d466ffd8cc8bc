"""KIVI-style asymmetric 2/4-bit quantization of the tokens a selector evicts.

KIVI (Liu et al., ICML 2024, arXiv:2402.02750) keeps the most recent tokens in full precision
and stores older ones quantized:

* **keys per channel**: for each (batch, KV head, channel ``c``) the keys of ``g`` consecutive
  tokens form one group, i.e. ``K^T`` (``[D, T]``) is quantized along ``T`` (paper Sec. 3.2);
* **values per token**: for each token the ``g`` channels of one group share the parameters,
  i.e. ``V`` (``[T, D]``) is quantized along ``D``;
* **asymmetric** (scale and zero point) ``b``-bit codes, for a group ``x``::

      s = (max x - min x) / (2^b - 1),   q_i = round((x_i - min x) / s),   x_i ~ s q_i + min x

  so the error of each element is at most ``s / 2`` (plus float rounding of ``s`` and ``min``).

The codes are computed with exactly this min/max rule (:func:`kivi_quantize`) and packed in
MLX's affine layout (``b``-bit codes in ``uint32`` words from the low bits up, one scale and one
bias per group in the cache's dtype), so ``mx.quantized_matmul`` and ``mx.dequantize`` read them.
``mx.quantize`` itself is not used: its affine mode moves the grid so that zero is exactly
representable, which can cost up to ~1.8x the half-step error bound above. The "most recent
tokens" are the cache's stored slots (``budget`` = KIVI's residual length); whatever the
selector evicts enters a full-precision *buffer* held in the disposition state, and whole
groups of ``g`` tokens leave the buffer for the packed store, so every key group spans ``g``
evicted tokens (in position order) exactly as KIVI's per-channel groups do.

Attention over the packed store never dequantizes it: ``q K^T`` is ``mx.quantized_matmul``
with the packed ``K^T`` (``transpose=False``: ``K^T`` is quantized along its last axis) and
``p V`` is ``mx.quantized_matmul`` with the packed ``V`` (``transpose=False``: ``V`` is
quantized along ``D``). The logits of the packed store, the buffer and the stored slots are
concatenated and normalised by one float32 softmax. Evicted tokens are always older than
every query of the current step (eviction happens before a step's tokens are appended), so
they are visible to all of them; the given mask applies to the stored slots only.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import attrs
import mlx.core as mx
from attrs.validators import in_, instance_of

from kvcompress.errors import ConfigError

__all__ = ["KiviQuant", "KiviState", "kivi_quantize", "quantize_keys", "quantize_values"]

_QUERY_BLOCK = 256  # queries per block in attend(): bounds the [.., N, T] logits of a long chunk


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


@attrs.define
class KiviState:
    """One layer's quantized store plus the full-precision buffer of a not yet whole group.

    ``kq/ks/kb``: packed ``K^T`` ``[B, H, D, Tq*b/32]`` and its scales/zero points
    ``[B, H, D, Tq/g]``; ``vq/vs/vb``: packed ``V`` ``[B, H, Tq, D'*b/32]`` and
    ``[B, H, Tq, D'/g]``; ``buf_k/buf_v``: ``[B, H, n, D]`` evicted tokens waiting for a whole
    group (``n < g``), oldest first. All ``None`` until the first eviction.
    """

    kq: Optional[mx.array] = None
    ks: Optional[mx.array] = None
    kb: Optional[mx.array] = None
    vq: Optional[mx.array] = None
    vs: Optional[mx.array] = None
    vb: Optional[mx.array] = None
    buf_k: Optional[mx.array] = None
    buf_v: Optional[mx.array] = None

    @property
    def n_quantized(self) -> int:
        """Tokens (per head) held in packed form."""
        return 0 if self.vq is None else self.vq.shape[2]

    @property
    def n_buffered(self) -> int:
        """Evicted tokens (per head) still in full precision, waiting for a whole group."""
        return 0 if self.buf_k is None else self.buf_k.shape[2]

    @property
    def empty(self) -> bool:
        return self.n_quantized == 0 and self.n_buffered == 0

    def arrays(self) -> list:
        return [self.kq, self.ks, self.kb, self.vq, self.vs, self.vb, self.buf_k, self.buf_v]


def _cat(a: Optional[mx.array], b: mx.array, axis: int) -> mx.array:
    return b if a is None else mx.concatenate([a, b], axis=axis)


# --------------------------------------------------------------------------------------------
# The disposition
# --------------------------------------------------------------------------------------------


@attrs.frozen
class KiviQuant:
    """Evicted tokens are quantized (keys per channel, values per token), not dropped.

    ``bits``: code width (2 = KIVI-2, 4 = KIVI-4, 8); ``group``: tokens per key group and
    channels per value group (32 in KIVI's LongBench runs; MLX allows 32, 64, 128).
    """

    bits: int = attrs.field(default=2, validator=[instance_of(int), in_((2, 4, 8))])
    group: int = attrs.field(default=32, validator=[instance_of(int), in_((32, 64, 128))])

    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset({"quantized_store"})

    # -- optional disposition hooks ---------------------------------------------------------

    def init_state(self, layer) -> KiviState:
        return KiviState()

    def diagnostics(self, state) -> dict:
        if not isinstance(state, KiviState):
            return {}
        return {"quantized_tokens": state.n_quantized, "buffered_tokens": state.n_buffered}

    # -- eviction ----------------------------------------------------------------------------

    def dispose(self, ev):
        """Move the evicted slots into the buffer (in position order); pack whole groups."""
        state = ev.state
        if not isinstance(state, KiviState):
            raise ConfigError(
                "kivi_quant keeps evicted tokens in per-cache state; use it through "
                "CompressedKVCache (which calls init_state), not dispose() alone"
            )
        if ev.real is not None:
            raise ConfigError(
                "kivi_quant cannot yet batch rows that free different numbers of tokens in one step"
            )
        pos = mx.take_along_axis(ev.positions, ev.evict, axis=-1)
        evict = mx.take_along_axis(ev.evict, mx.argsort(pos, axis=-1), axis=-1)[..., None]
        k_out = mx.take_along_axis(ev.keys, evict, axis=2)
        v_out = mx.take_along_axis(ev.values, evict, axis=2)
        self._push(state, k_out, v_out)
        return ev.keys, ev.values, ev.scores

    def _push(self, state: KiviState, k: mx.array, v: mx.array) -> None:
        buf_k = _cat(state.buf_k, k, axis=2)
        buf_v = _cat(state.buf_v, v, axis=2)
        n = buf_k.shape[2]
        m = (n // self.group) * self.group
        if m:
            kq, ks, kb = quantize_keys(buf_k[:, :, :m], self.group, self.bits)
            vq, vs, vb = quantize_values(buf_v[:, :, :m], self.group, self.bits)
            # keys grow along T = the last axis of K^T, values along T = axis 2
            state.kq, state.ks, state.kb = _cat(state.kq, kq, 3), _cat(state.ks, ks, 3), _cat(state.kb, kb, 3)
            state.vq, state.vs, state.vb = _cat(state.vq, vq, 2), _cat(state.vs, vs, 2), _cat(state.vb, vb, 2)
            buf_k, buf_v = buf_k[:, :, m:], buf_v[:, :, m:]
        state.buf_k, state.buf_v = buf_k, buf_v

    def dequantize(self, state: KiviState):
        """``(K, V)`` ``[B, H, Tq, D]`` of the packed store (for tests and diagnostics only)."""
        if state.n_quantized == 0:
            return None, None
        k = mx.dequantize(state.kq, state.ks, state.kb, group_size=self.group, bits=self.bits)
        v = mx.dequantize(state.vq, state.vs, state.vb, group_size=self.group, bits=self.bits)
        return k.swapaxes(-1, -2), v[..., : state.buf_v.shape[-1]]

    # -- attention ---------------------------------------------------------------------------

    def attend(self, state, queries, keys, values, scale, mask, sinks, sdpa):
        """``softmax([q Kq^T | q Kbuf^T | q K^T + mask] * scale) [Vq; Vbuf; V]`` (see module doc)."""
        if state is None or state.empty:
            return sdpa(queries, keys, values, cache=None, scale=scale, mask=mask, sinks=sinks)
        b, h_q, n, d = queries.shape
        h_kv, t = keys.shape[1], keys.shape[2]
        if h_q % h_kv:
            raise ValueError(f"query heads ({h_q}) must be a multiple of KV heads ({h_kv})")
        g = h_q // h_kv
        dv = values.shape[-1]
        nq, nb = state.n_quantized, state.n_buffered
        q = (queries.astype(mx.float32) * scale).reshape(b, h_kv, g, n, d)
        k_t = mx.expand_dims(keys.astype(mx.float32).swapaxes(-1, -2), 2)  # [B, H_kv, 1, D, T]
        v_s = mx.expand_dims(values.astype(mx.float32), 2)
        if nb:
            kb_t = mx.expand_dims(state.buf_k.astype(mx.float32).swapaxes(-1, -2), 2)
            vb_s = mx.expand_dims(state.buf_v.astype(mx.float32), 2)
        qargs = dict(transpose=False, group_size=self.group, bits=self.bits)
        outs = []
        for i0 in range(0, n, _QUERY_BLOCK):
            i1 = min(i0 + _QUERY_BLOCK, n)
            qb = q[:, :, :, i0:i1]  # [B, H_kv, G, nb, D]
            m = i1 - i0
            parts = []
            if nq:
                flat = qb.reshape(b, h_kv, g * m, d)
                sq = mx.quantized_matmul(flat, state.kq, state.ks, state.kb, **qargs)
                parts.append(sq.reshape(b, h_kv, g, m, nq))
            if nb:
                parts.append(qb @ kb_t)
            parts.append(_masked(qb @ k_t, mask, i0, i1, n, t, h_kv, g))
            if sinks is not None:
                sink = sinks.astype(mx.float32).reshape(1, h_kv, g, 1, 1)
                parts.append(mx.broadcast_to(sink, (b, h_kv, g, m, 1)))
            p = mx.softmax(mx.concatenate(parts, axis=-1), axis=-1)
            out = p[..., nq + nb : nq + nb + t] @ v_s
            if nq:
                pq = p[..., :nq].reshape(b, h_kv, g * m, nq)
                oq = mx.quantized_matmul(pq, state.vq, state.vs, state.vb, **qargs)[..., :dv]
                out = out + oq.reshape(b, h_kv, g, m, dv)
            if nb:
                out = out + p[..., nq : nq + nb] @ vb_s
            outs.append(out)
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
        return out.reshape(b, h_q, n, dv).astype(queries.dtype)


def _masked(logits: mx.array, mask: Any, i0: int, i1: int, n: int, t: int, h_kv: int, g: int) -> mx.array:
    """Apply the model's mask (rows ``i0:i1``) to ``[B, H_kv, G, rows, T]`` stored-slot logits.

    ``"causal"`` is bottom-right aligned (query ``i`` sits at slot ``t - n + i``); arrays are
    bool (True = visible) or additive, ``[rows, T]``, ``[B, 1, rows, T]`` or ``[B, H_q, rows, T]``.
    """
    if mask is None:
        return logits
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported attention mask {mask!r}; expected None, 'causal' or an array")
        visible = mx.arange(t - n + i0, t - n + i1)[:, None] >= mx.arange(t)[None]
        return mx.where(visible, logits, -mx.inf)
    m = mask[..., i0:i1, :]
    if m.ndim == 4 and m.shape[1] > 1:
        m = m.reshape(m.shape[0], h_kv, g, i1 - i0, m.shape[-1])
    elif m.ndim == 4:
        m = mx.expand_dims(m, 2)
    elif m.ndim == 3:
        m = m[:, None, None]
    if m.dtype == mx.bool_:
        return mx.where(m, logits, -mx.inf)
    return logits + m.astype(mx.float32)
