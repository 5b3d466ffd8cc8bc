"""CaM's decode merge on low-bit slots (``kv_bits``): the rows it reads are gathered from the
codes and the cosine's dot products come from the low-bit product, so a step never dequantizes
the whole store; the choice itself (:func:`~kvcompress_cam.merge.single_choice_fn`) and the blend
are the float path's. Also the pieces both paths share: key norms, the blended row, the writes."""

from __future__ import annotations

import mlx.core as mx

from kvcompress.storage import QuantizedSlots, keys_product, take_slots

__all__ = ["blend_row", "is_low_bit", "stored_rows"]


def _key_norms(keys) -> mx.array:
    """``|k_j|`` ``[..., T]`` float32 of keys ``[..., T, D]``."""
    return mx.sqrt(mx.square(keys.astype(mx.float32)).sum(-1))


def blend_row(xl: mx.array, xt: mx.array, w: mx.array) -> mx.array:
    """The target's new row ``x_t + w (x_l - x_t)`` (float32 arithmetic, in ``xt``'s dtype)."""
    t32 = xt.astype(mx.float32)
    return (t32 + w[..., None] * (xl.astype(mx.float32) - t32)).astype(xt.dtype)


def _write_rows(ev, rows):
    """``(keys, values, scores, merges, norms)``: the rows of :meth:`GatedMerge._nearest_rows`
    written into the stored arrays."""
    target, vrow, krow, s_t, done, norms = rows
    ev.rewritten = (target, krow, vrow)  # only these rows changed (a low-bit store re-stores just them)
    idx = target[..., None]
    values = mx.put_along_axis(ev.values, idx, vrow, axis=2)
    keys = ev.keys if krow is None else mx.put_along_axis(ev.keys, idx, krow, axis=2)
    scores = ev.scores if s_t is None else mx.put_along_axis(ev.scores, target, s_t, axis=-1)
    return keys, values, scores, done, norms


def stored_rows(ev, choose, draw_keys, prev_norms, reuse: bool, merge_keys: bool) -> tuple:
    """:meth:`GatedMerge._nearest_rows` for a low-bit store ``ev.stored`` (one loser per row and
    head): ``(target, value row, key row or None, target score, merges, norms)``, one compiled
    function of the codes per storage and configuration."""
    ks, vs = ev.stored
    key = (ks.bits, vs.bits, ks.group_size, ks.dtype, vs.dtype, id(choose), reuse, merge_keys)
    fn = _FNS.get(key)
    if fn is None:
        fn = _FNS[key] = _compiled(choose, ks, vs, reuse, merge_keys)
    real = ev.real if ev.real is not None else mx.array(True)
    written = ev.written if reuse else ev.evict
    prev = prev_norms if reuse else ev.scores  # (unused without reuse)
    target, vrow, krow, s_new, count, norms = fn(*ks.leaves(), *vs.leaves(), ev.scores, ev.positions, ev.evict,
                                                 real, ev.offset, draw_keys, prev, written)
    return target, vrow, krow if merge_keys else None, s_new, count, None if merge_keys else norms


_FNS: dict = {}


def _compiled(choose, ks, vs, reuse: bool, merge_keys: bool):
    def like(store, codes, scales, biases):
        return QuantizedSlots(codes, scales, biases, store.bits, store.group_size, store.dtype)

    def fn(kc, kscale, kbias, vc, vscale, vbias, scores, positions, evict, real, off, draw_keys, prev, written):
        k, v = like(ks, kc, kscale, kbias), like(vs, vc, vscale, vbias)
        t = positions.shape[-1]
        kl = take_slots(k, evict).dequantize().astype(mx.float32)  # [B, H, 1, D]
        dots = keys_product(kl[:, :, None], k, t)[:, :, 0, 0]  # [B, H, T]: the loser's key . every key
        if reuse:
            norms = mx.put_along_axis(prev, written, _key_norms(take_slots(k, written).dequantize()), axis=-1)
        else:
            norms = _key_norms(k.dequantize())
        target, w, s_new, count = choose(dots, norms, scores, positions, evict, real, off, draw_keys)

        def row(store):
            return blend_row(*(take_slots(store, i).dequantize() for i in (evict, target)), w)

        return target, row(v), row(k) if merge_keys else target, s_new, count, norms

    from kvcompress import ops

    return mx.compile(fn) if ops.COMPILE else fn


def is_low_bit(ev) -> bool:
    """Whether the cache holds this eviction's slots as low-bit codes."""
    return ev.stored is not None and isinstance(ev.stored[0], QuantizedSlots)
