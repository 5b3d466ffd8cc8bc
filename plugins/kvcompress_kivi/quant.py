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

The codes are computed with exactly this min/max rule (:func:`~kvcompress_kivi.store.kivi_quantize`) and packed in
MLX's affine layout (``b``-bit codes in ``uint32`` words from the low bits up, one scale and one
bias per group in the cache's dtype), so ``mx.quantized_matmul`` and ``mx.dequantize`` read them.
``mx.quantize`` itself is not used: its affine mode moves the grid so that zero is exactly
representable, which can cost up to ~1.8x the half-step error bound above.

**Rows.** The "most recent tokens" are the cache's stored slots (``budget`` = KIVI's residual
length); whatever the selector evicts from a batch row enters that row's full-precision *buffer*
(``g`` slots, the first ``n_buf[b]`` used), in position order, and every time a row's buffer
holds ``g`` tokens they leave it as one group for the row's packed store (``n_quant[b]`` tokens,
always whole groups). Each row's counts live on the host (:class:`KiviState`), so a step never
syncs to know them; rows that free different numbers of tokens in one step (``ev.real``) each
get exactly the groups, store and buffer they would have alone. The store is as wide as its
widest row; a row's unused tail is zeros and is masked out of attention.

**Attention** runs through :func:`kvcompress.ops.attention` (the project's one masked attention:
one float32 softmax over ``[packed store | buffer | stored slots]``, the stored slots under the
mask the cache hands the layer; evicted tokens are older than every query of the step, so each
row sees all of its own, and a row's unused store/buffer columns are masked out):

* a decode step (at most :data:`QMM_QUERIES` queries): the store joins as
  :class:`kvcompress.ops.ExtraKeys` read by a quantized matmul on the packed codes
  (``transpose=False``: ``K^T`` is quantized along its last axis, ``V`` along ``D``), so it is
  never materialised in full precision; on a Linux x86-64 CPU the product is kvcompress's
  few-row kernel (:func:`kvcompress.ops.quantized_matmul`, ~7x MLX's CPU kernel, which unpacks the codes
  again for every query row), elsewhere ``mx.quantized_matmul``;
* a chunk of queries: the store is dequantized once (one layer's float32 K/V, transient) and
  put in front of the stored slots as one key block, and the queries run in blocks of at most
  :data:`LOGITS_PER_BLOCK` logits, one block at a time, so the transient memory stays far below
  the ``[H, N, T]`` scores mlx-lm's attention over a full cache allocates.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import mlx.core as mx
import numpy as np
from attrs.validators import in_, instance_of

from kvcompress import ops
from kvcompress.errors import ConfigError

from .store import (
    _STORE_FIELDS, KiviState, _group_index, _take, _units, _unpack, _with_rows,
    _zero_group, quantize_keys, quantize_values,
)

__all__ = ["KiviQuant"]

#: decode steps with at most this many queries read the packed store with ``quantized_matmul``;
#: longer steps dequantize it once and use float matmuls (much faster for many queries)
QMM_QUERIES = 4
#: float32 logits per query block of a prompt chunk (elements): bounds the transient memory
LOGITS_PER_BLOCK = 1 << 22


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

    # -- optional hooks ----------------------------------------------------------------------

    def bind(self, model, layers, states) -> None:
        """Refuse models whose cache does not hold attention values (MLA: a latent and a RoPE key)."""
        for layer in getattr(model, "layers", []) or []:
            attn = getattr(layer, "self_attn", None)
            if attn is not None and hasattr(attn, "kv_lora_rank"):
                raise ConfigError(
                    f"kivi_quant quantizes the cached values, but {type(model).__name__} caches an MLA "
                    "latent and RoPE keys (not values); use an eviction method with this model"
                )

    def init_state(self, layer=None) -> KiviState:
        """An empty store. The few-row kernel that reads it is resolved here (built on first use),
        when a cache is made or loaded, not inside the first timed decode step."""
        ops.prepare_quantized_matmul()
        return KiviState()

    def diagnostics(self, state) -> dict:
        """``quantized_tokens`` and ``buffered_tokens`` per row (per KV head)."""
        if not isinstance(state, KiviState):
            return {}
        return {"quantized_tokens": list(state.n_quant or [0]), "buffered_tokens": list(state.n_buf or [0])}

    def take_rows(self, state: KiviState, rows: list) -> KiviState:
        """The given rows (the store cut to their widest ``n_quant``)."""
        if not state.n_quant:
            return KiviState(n_quant=[0] * len(rows), n_buf=[0] * len(rows))
        nq = [state.n_quant[i] for i in rows]
        out = KiviState(n_quant=nq, n_buf=[state.n_buf[i] for i in rows])
        idx = mx.array(rows, dtype=mx.int32)
        width = max(nq, default=0)
        for f in (*_STORE_FIELDS, "buf_k", "buf_v"):
            x = getattr(state, f)
            if x is None:
                continue
            x = x[idx]
            if f in _STORE_FIELDS and width < state.width:
                x = self._cut(f, x, width)
            setattr(out, f, x)
        return out

    def stack_rows(self, states: list, rows: list) -> KiviState:
        """One state holding every state's rows in order (``rows[i]`` in ``states[i]``; stores
        padded to the widest)."""
        states = [s if isinstance(s, KiviState) else KiviState() for s in states]
        out = KiviState(n_quant=[x for s, r in zip(states, rows) for x in (s.n_quant or [0] * r)],
                        n_buf=[x for s, r in zip(states, rows) for x in (s.n_buf or [0] * r)])
        width = max(s.width for s in states)
        for fields in (("buf_k", "buf_v"), _STORE_FIELDS):
            like = next((s for s in states if getattr(s, fields[0]) is not None), None)
            if like is None:
                continue
            for f in fields:
                parts = []
                for s, r in zip(states, rows):
                    x = getattr(s, f)
                    if x is None:  # rows that hold nothing here: zeros
                        shape = list(getattr(like, f).shape)
                        shape[0] = r
                        if f in _STORE_FIELDS:
                            shape[_units(f, self.group, self.bits)[0]] = 0
                        x = mx.zeros(shape, getattr(like, f).dtype)
                    if f in _STORE_FIELDS and x.shape[2 if f[0] == "v" else -1] < self._units_of(f, width):
                        axis, _ = _units(f, self.group, self.bits)
                        pad = [(0, 0)] * x.ndim
                        pad[axis] = (0, self._units_of(f, width) - x.shape[axis])
                        x = mx.pad(x, pad)
                    parts.append(x)
                setattr(out, f, mx.concatenate(parts, axis=0))
        return out

    def _units_of(self, field: str, width: int) -> int:
        """Entries of ``field`` along its token axis for a store ``width`` tokens wide."""
        return width // self.group * _units(field, self.group, self.bits)[1]

    def _cut(self, field: str, x: mx.array, width: int) -> mx.array:
        axis, unit = _units(field, self.group, self.bits)
        n = width // self.group * unit
        return x[..., :n] if axis == -1 else x[:, :, :n]

    # -- eviction ----------------------------------------------------------------------------

    def dispose(self, ev):
        """Move each row's evicted slots into its buffer (in position order); pack whole groups."""
        state = ev.state
        if not isinstance(state, KiviState):
            raise ConfigError(
                "kivi_quant keeps evicted tokens in per-cache state; use it through "
                "CompressedKVCache (which calls init_state), not dispose() alone"
            )
        b, e = ev.evict.shape[0], ev.evict.shape[-1]
        counts = [int(c) for c in ev.counts] if ev.counts else [e] * b
        evict = ev.evict
        if e > 1:  # the row's real entries first, in position order
            pos = mx.take_along_axis(ev.positions, evict, axis=-1)
            if ev.real is not None:
                pos = mx.where(ev.real, pos, mx.array(2**31 - 1, pos.dtype))
            evict = mx.take_along_axis(evict, mx.argsort(pos, axis=-1), axis=-1)
        k_out = mx.take_along_axis(ev.keys, evict[..., None], axis=2)
        v_out = mx.take_along_axis(ev.values, evict[..., None], axis=2)
        ev.state = self._push(_with_rows(state, b), k_out, v_out, counts)
        return ev.keys, ev.values, ev.scores

    def _push(self, state: KiviState, k: mx.array, v: mx.array, counts: list) -> KiviState:
        """Append ``counts[b]`` tokens of ``k``/``v`` ``[B, H, E, D]`` to row ``b``'s buffer and
        move every whole group to the row's store (all rows at once; host-side index plans)."""
        g = self.group
        b, h, e, _ = k.shape
        nb, nq = list(state.n_buf), list(state.n_quant)
        buf_k = state.buf_k if state.buf_k is not None else mx.zeros((b, h, g, k.shape[-1]), k.dtype)
        buf_v = state.buf_v if state.buf_v is not None else mx.zeros((b, h, g, v.shape[-1]), v.dtype)
        total = [x + c for x, c in zip(nb, counts)]
        if state.buf_k is not None and len(set(nb)) == 1 and counts == [e] * b and nb[0] + e < g:
            # a decode step's usual case: every row appends its e tokens at the same buffer slot
            at = mx.array([nb[0]], mx.int32)
            return attrs.evolve(state, buf_k=mx.slice_update(state.buf_k, k, at, axes=(2,)),
                                buf_v=mx.slice_update(state.buf_v, v, at, axes=(2,)), n_buf=total)
        packed = [x // g * g for x in total]
        rest = [x - p for x, p in zip(total, packed)]
        # row b's token j (buffer first, then its new tokens) sits at seq[j] (j < nb) or g + j - nb
        seq_k = mx.concatenate([buf_k, k], axis=2)
        seq_v = mx.concatenate([buf_v, v], axis=2)

        def src(j: np.ndarray) -> np.ndarray:
            lead = np.array(nb)[:, None]
            return np.where(j < lead, j, g + j - lead)

        # the new buffers: tokens packed[b] .. total[b]-1, zeros after
        j = np.array(packed)[:, None] + np.arange(g)[None]
        keep = np.arange(g)[None] < np.array(rest)[:, None]
        idx = np.where(keep, src(j), 0)
        valid = mx.array(keep).reshape(b, 1, g, 1)
        new_k = mx.where(valid, _take(seq_k, 2, idx), mx.zeros((), k.dtype))
        new_v = mx.where(valid, _take(seq_v, 2, idx), mx.zeros((), v.dtype))
        out = attrs.evolve(state, buf_k=new_k, buf_v=new_v, n_buf=rest)
        m = max(packed)
        if m == 0:
            return out
        # pack tokens 0 .. packed[b]-1 of every row (rows with fewer pack groups that are dropped)
        jj = np.arange(m)[None].repeat(b, axis=0)
        idx = np.where(jj < np.array(packed)[:, None], src(jj), 0)
        kq, ks, kb = quantize_keys(_take(seq_k, 2, idx), g, self.bits)
        vq, vs, vb = quantize_values(_take(seq_v, 2, idx), g, self.bits)
        new = dict(kq=kq, ks=ks, kb=kb, vq=vq, vs=vs, vb=vb)
        if len(set(nq)) == 1 and len(set(packed)) == 1:  # rows in step: append
            for f in _STORE_FIELDS:
                old = getattr(state, f)
                axis, _ = _units(f, g, self.bits)
                setattr(out, f, new[f] if old is None or nq[0] == 0 else mx.concatenate([old, new[f]], axis=axis))
        else:  # row b: its store, then its new groups, then zeros (one gather per field)
            old_groups = state.width // g
            width = max(q + p for q, p in zip(nq, packed)) // g
            c = np.arange(width)[None]
            have, add = np.array(nq)[:, None] // g, np.array(packed)[:, None] // g
            groups = np.where(c < have, c, np.where(c < have + add, old_groups + c - have, old_groups + m // g))
            for f in _STORE_FIELDS:
                axis, unit = _units(f, g, self.bits)
                parts = [new[f], _zero_group(new[f], axis, unit)]
                if state.vq is not None:
                    parts.insert(0, getattr(state, f))
                setattr(out, f, _take(mx.concatenate(parts, axis=axis), axis, _group_index(groups, unit)))
        out.n_quant = [q + p for q, p in zip(nq, packed)]
        return out

    def dequantize(self, state: KiviState, dtype=None):
        """``(K, V)`` ``[B, H, W, D]`` of the packed store (row ``b``'s first ``n_quant[b]``
        tokens are its own) in ``dtype`` (default: the cache's); ``(None, None)`` when empty."""
        if state.vq is None or state.width == 0:
            return None, None
        k = _unpack(state.kq, state.ks, state.kb, self.group, self.bits, dtype)
        v = _unpack(state.vq, state.vs, state.vb, self.group, self.bits, dtype)
        return k.swapaxes(-1, -2), v[..., : state.buf_v.shape[-1]]

    # -- attention ---------------------------------------------------------------------------

    def attend(self, state, queries, keys, values, scale, mask, sinks, sdpa):
        """Attention over ``[packed store | buffer | stored slots]`` (see the module doc)."""
        if isinstance(state, KiviState) and not state.n_quant:
            # remember the rows (so a batch that never evicted still stacks right)
            state.n_quant, state.n_buf = [0] * queries.shape[0], [0] * queries.shape[0]
        if not isinstance(state, KiviState) or state.empty:
            return sdpa(queries, keys, values, cache=None, scale=scale, mask=mask, sinks=sinks)
        b, h_q, n, _ = queries.shape
        if n <= QMM_QUERIES and state.width:
            extra = self.quantized_keys(state, values.shape[-1])
            buf_k, buf_v, buf_ok = self._buffer(state)
            if buf_k.shape[2]:
                extra.append(_float_keys(buf_k.swapaxes(-1, -2), buf_v, buf_ok))
            out, _ = ops.attention(queries, keys, values, scale, mask=mask, extra=extra, sinks=sinks)
            return out
        # a chunk: one float32 key block [dequantized store | buffer | stored slots]
        old_k, old_v, ok = self.dequantized(state)
        x = old_k.shape[2]
        keys = mx.concatenate([old_k, keys.astype(mx.float32)], axis=2)
        values = mx.concatenate([old_v, values.astype(mx.float32)], axis=2)
        mask = _prepend_visible(mask, ok, b, x, n, keys.shape[2] - x)
        block = max(16, min(ops.QUERY_BLOCK, LOGITS_PER_BLOCK // max(b * h_q * keys.shape[2], 1)))
        out, _ = ops.attention(queries, keys, values, scale, mask=mask, sinks=sinks, block=block)
        return out

    def _buffer(self, state: KiviState):
        """Every row's buffered tokens ``[B, H, n, D]`` float32 (``n`` = the fullest row's) and
        which are real (``[B, n]`` bool, or None when all are)."""
        b, nbw = len(state.n_buf), max(state.n_buf)
        ok = None if all(x == nbw for x in state.n_buf) else (
            mx.arange(nbw).reshape(1, nbw) < mx.array(state.n_buf).reshape(b, 1))
        return state.buf_k[:, :, :nbw].astype(mx.float32), state.buf_v[:, :, :nbw].astype(mx.float32), ok

    def _store_ok(self, state: KiviState):
        width = state.width
        if all(q == width for q in state.n_quant):
            return None
        return mx.arange(width).reshape(1, width) < mx.array(state.n_quant).reshape(len(state.n_quant), 1)

    def dequantized(self, state: KiviState):
        """``(K, V, ok)``: the store and the buffer as float32 ``[B, H, X, D]`` keys and values
        (``X`` = store width + the fullest buffer) and ``ok`` ``[B, X]`` (None: every column
        is real in every row)."""
        buf_k, buf_v, buf_ok = self._buffer(state)
        if not state.width:
            return buf_k, buf_v, buf_ok
        kd, vd = self.dequantize(state, mx.float32)
        k = mx.concatenate([kd, buf_k], axis=2)
        v = mx.concatenate([vd, buf_v], axis=2)
        return k, v, _cat_valid(self._store_ok(state), buf_ok, len(state.n_quant), state.width, buf_k.shape[2])

    def quantized_keys(self, state: KiviState, dv: int) -> list:
        """The packed store as :class:`kvcompress.ops.ExtraKeys` read by ``quantized_matmul``
        (``q K^T`` on ``K^T``'s codes, ``p V`` on ``V``'s; a row's unused columns masked)."""
        width, ok = state.width, self._store_ok(state)
        qargs = dict(group_size=self.group, bits=self.bits)

        def logits(q):  # q [B, H, G, n, D] float32, scaled
            bb, h, gg, m, d = q.shape
            s = ops.quantized_matmul(q.reshape(bb, h, gg * m, d), state.kq, state.ks, state.kb, **qargs)
            return _mask_cols(s.reshape(bb, h, gg, m, width), ok)

        def output(p):  # p [B, H, G, n, W]
            bb, h, gg, m, w = p.shape
            o = ops.quantized_matmul(p.reshape(bb, h, gg * m, w), state.vq, state.vs, state.vb, **qargs)
            return o[..., :dv].reshape(bb, h, gg, m, dv)

        return [ops.ExtraKeys(logits=logits, output=output)]


def _prepend_visible(mask, ok, b: int, x: int, n: int, t: int):
    """The mask over ``[x extra keys | t stored slots]`` from the stored slots' ``mask`` (None,
    ``"causal"`` or an array ``[.., n, t]``): every query sees the extra keys that ``ok``
    ``[B, x]`` marks (None: all of them)."""
    if x == 0:
        return mask
    if ok is None and (mask is None or isinstance(mask, str)):
        return mask  # still bottom-right aligned: the extra keys precede every query's slots
    if mask is None:
        base = mx.ones((1, 1, n, t), mx.bool_)
    elif isinstance(mask, str):
        base = ops.visibility(mx.arange(t, dtype=mx.int32), mx.arange(t - n, t, dtype=mx.int32))[None, None]
    else:
        base = mask if mask.ndim == 4 else mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        if base.dtype != mx.bool_:
            raise ValueError("kivi_quant: additive attention masks are not supported with a quantized store")
    rows = max(b, base.shape[0])
    heads = base.shape[1]
    left = mx.ones((rows, 1, 1, x), mx.bool_) if ok is None else ok.reshape(ok.shape[0], 1, 1, x)
    left = mx.broadcast_to(left, (rows, heads, n, x))
    return mx.concatenate([left, mx.broadcast_to(base, (rows, heads, n, t))], axis=-1)


def _cat_valid(a, b_ok, rows: int, wa: int, wb: int):
    if a is None and b_ok is None:
        return None
    a = mx.ones((rows, wa), mx.bool_) if a is None else a
    b_ok = mx.ones((rows, wb), mx.bool_) if b_ok is None else b_ok
    return mx.concatenate([a, b_ok], axis=1)


def _mask_cols(logits: mx.array, ok) -> mx.array:
    """Mask the columns ``ok`` ``[B, X]`` marks False (a row's unused store or buffer slots)."""
    if ok is None:
        return logits
    return mx.where(ok[:, None, None, None, :], logits, ops.NEG)


def _float_keys(keys_t: mx.array, values: mx.array, ok) -> ops.ExtraKeys:
    """Float32 extra keys ``K^T`` ``[B, H, D, X]`` and values ``[B, H, X, D_v]``."""
    return ops.ExtraKeys(logits=lambda q: _mask_cols(ops.grouped_matmul(q, keys_t), ok),
                         output=lambda p: ops.grouped_matmul(p, values))
