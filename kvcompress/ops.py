"""Attention math shared by the cache engine and the components (public helpers for plugins).

One mask rule and one masked attention serve the whole project:

* :func:`visibility` -- key ``j`` is visible to query ``i`` iff ``0 <= p_j <= q_i`` (``p_j = -1``
  marks an empty slot: padding or a freed slot). Because every slot remembers its position,
  this is exact whatever the slot order, after any eviction, for any batch row.
* :func:`attention` -- float32 softmax attention in query blocks, under the slot positions'
  visibility or under the mask mlx-lm hands a layer (None, ``"causal"`` or an array), returning the output, the
  attention mass ``A_j = sum_i w_i softmax_j(q_i . k_j * scale)`` per key (mean over the query
  heads of each GQA group, or per query head), or both from one softmax. Extra key blocks
  (e.g. a quantized store) join the same softmax through :class:`ExtraKeys`.
* :func:`lowest_k` -- the ``k`` slots with the smallest ``(score, position)``: ties break by
  position, so the choice never depends on where a token sits in storage or in a batch.
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

import attrs
import mlx.core as mx

from kvcompress._exp import _exp_nonpositive
from kvcompress._lowbit import prepare as prepare_quantized_matmul  # re-exported: build it before timing
from kvcompress._lowbit import quantized_matmul  # re-exported: the few-row low-bit product
from kvcompress._lowbit import row_softmax
from kvcompress.storage import QuantizedSlots, for_step, keys_product, values_product

__all__ = ["COMPILE", "EVAL_BLOCKS_ABOVE", "FAST_SOFTMAX_MAX", "NEG", "QUERY_BLOCK", "ExtraKeys", "attention", "attention_mass", "grouped_matmul", "owner_mask", "prepare_quantized_matmul", "quantized_matmul", "visibility", "lowest_k", "sortable_bits"]

#: Whether decode-path functions run ``mx.compile``d (False with ``KVCOMPRESS_NO_COMPILE=1``:
#: eagerly, e.g. to debug); components with compiled decode functions read this switch too.
COMPILE = os.environ.get("KVCOMPRESS_NO_COMPILE", "") in ("", "0")
#: The logit given to invisible keys: finite, so a query that sees nothing gets no NaN.
NEG = -3.0e38
#: Queries per block: bounds the ``[.., block, T]`` float32 logits of a long chunk.
QUERY_BLOCK = 256
#: A chunk whose logits (all blocks) exceed this many floats has its blocks evaluated one at a
#: time (the bound needs it; below, the blocks stay one lazy graph: no synchronisation)
EVAL_BLOCKS_ABOVE = 1 << 24


def visibility(key_positions: mx.array, query_positions: mx.array) -> mx.array:
    """Bool ``[B, H, N, T]``: ``0 <= p_j <= q_i``; ``key_positions`` ``[B, H, T]`` int (``-1`` =
    empty slot), ``query_positions`` ``[B, 1, N]`` (or broadcastable to it, e.g. ``[N]``)."""
    kp = key_positions[..., None, :]
    qp = query_positions[..., :, None]
    return (kp >= 0) & (kp <= qp)


@attrs.frozen
class ExtraKeys:
    """Keys held outside the stored slots that every query sees (e.g. a quantized store).

    ``logits(q)`` maps scaled float32 queries ``[B, H_kv, G, n, D]`` to ``[B, H_kv, G, n, X]``;
    ``output(p)`` maps their softmax weights ``[B, H_kv, G, n, X]`` to ``[B, H_kv, G, n, D_v]``.
    They precede the stored slots in the softmax.
    """

    logits: Callable[[mx.array], mx.array]
    output: Callable[[mx.array], mx.array]


#: shapeless: its graph is element-wise only (no reduction), so one trace serves every shape
_exp_cpu = mx.compile(_exp_nonpositive, shapeless=True) if COMPILE else _exp_nonpositive


#: logits up to this many elements (1 MiB of float32) take the CPU path of :func:`_softmax`:
#: decode steps and scoring windows. MLX runs the compiled :func:`_exp_nonpositive` as several
#: fused kernels whose outputs it allocates together (~8x the logits' bytes, transient), so
#: larger logits (prompt chunks) keep ``mx.softmax`` and its single output buffer
FAST_SOFTMAX_MAX = 1 << 18


def _softmax(x: mx.array) -> mx.array:
    """Float32 softmax over the last axis: ``mx.softmax``, except on the CPU, where MLX's
    element-wise ``exp`` (~12 ns per element) dominates attention (a decode step over a long
    store, SnapKV-style window re-scoring, a prompt chunk): there the CPU kernels' vectorised
    row softmax (:func:`kvcompress._lowbit.row_softmax`, ~6x ``mx.softmax`` on a prompt
    chunk's logits), or where it is not built, for small logits, ``e = exp(x - max x)`` from
    the compiled :func:`_exp_nonpositive` (3x faster on decode-sized logits; both are closer to
    the exact ``e^z`` than MLX's)."""
    if mx.default_device() != mx.cpu or x.shape[-1] == 0:
        return mx.softmax(x, axis=-1)
    kernel = row_softmax() if x.dtype == mx.float32 else None
    if kernel is not None:
        return kernel(x)
    if x.size > FAST_SOFTMAX_MAX:
        return mx.softmax(x, axis=-1)
    e = _exp_cpu(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _exp_shifted(x: mx.array) -> mx.array:
    """``e^(x - max x)`` over the last axis of float32 ``x`` (unnormalised: a caller that sums
    in its own order), by the CPU kernels where :func:`_softmax` uses them."""
    kernel = row_softmax()  # (None off the CPU)
    if kernel is not None:
        return kernel(x, normalize=False)
    z = x - x.max(axis=-1, keepdims=True)
    return _exp_cpu(z) if mx.default_device() == mx.cpu else mx.exp(z)


def _f32(x: mx.array) -> mx.array:
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def _split_groups(queries: mx.array, h_kv: int) -> int:
    h_q = queries.shape[1]
    if h_q % h_kv:
        raise ValueError(f"query heads ({h_q}) must be a multiple of KV heads ({h_kv})")
    return h_q // h_kv


def attention(
    queries: mx.array,
    keys: mx.array,
    values: Optional[mx.array],
    scale: float,
    key_positions: Optional[mx.array] = None,
    query_positions: Optional[mx.array] = None,
    *,
    mask=None,
    bias: Optional[mx.array] = None,
    query_weight: Optional[mx.array] = None,
    mass: Optional[str] = None,
    last: Optional[int] = None,
    extra: Sequence[ExtraKeys] = (),
    sinks: Optional[mx.array] = None,
    owner: Optional[mx.array] = None,
    heads_per_row: int = 1,
    block: int = QUERY_BLOCK,
):
    """Masked float32 attention of ``queries`` over the stored slots (plus ``extra``).

    queries ``[B, H_q, N, D]`` at ``query_positions`` ``[B, 1, N]``; keys/values
    ``[B, H_kv, T, D]`` at ``key_positions`` ``[B, H_kv, T]`` (see :func:`visibility`), float or
    low-bit (:class:`kvcompress.storage.QuantizedSlots`, read through quantized products). Without
    positions, ``mask`` says what each query sees, as in mlx-lm's attention: None (every key),
    ``"causal"`` (bottom-right aligned: query ``i`` sees keys ``0 .. T - N + i``), or an array
    ``[N, T]``, ``[B, N, T]``, ``[B, 1 | H_q, N, T]`` (bool: True = visible; else additive).
    ``bias`` (same shapes as an array ``mask``) is added to the logits first: a model's own
    additive scores, e.g. MLA's RoPE part (DeepSeek-V3 passes it as its attention mask).
    ``query_weight`` ``[B, 1, N]`` weights each query in the mass (0 for padding queries);
    ``last`` keeps only the last ``last`` queries; ``mass`` is ``None`` (no mass), ``"group"``
    (``[B, H_kv, T]``, mean over each GQA group), ``"heads"`` (``[B, H_kv, G, T]``) or ``"max"``
    (``[B, H_kv, T]``: ``max_{h in group, i} w_i softmax_j(q_{h,i} . k_j * scale)``, the largest
    attention weight key ``j`` receives from any query of its group; zero-weight queries count 0)
    or ``"weights"`` (the probabilities themselves, ``[B, H_kv, G, N', T]``, unweighted).
    ``values=None`` computes the mass only. With head groups (:func:`owner_mask`), each row of
    ``keys`` holds the slots of ``heads_per_row`` KV heads and ``owner`` ``[B, H_kv, T]`` says
    whose each slot is: a query head sees only its own KV head's slots, and the ``"group"`` mass
    of a slot is the mean over that KV head's query heads. Returns ``(out [B, H_q, N', D_v] in
    the queries' dtype or None, mass or None)``.
    """
    quantized = isinstance(keys, QuantizedSlots) or isinstance(values, QuantizedSlots)
    plain = (queries.shape[2] == 1 and mask is None and values is not None and bias is None and query_weight is None
             and not extra and sinks is None and not quantized)  # a decode step: straight-line paths
    if plain and mass == "group" and key_positions is None and owner is None:
        return _one_query(queries, keys, values, scale)
    if (plain and owner is not None and heads_per_row > 1 and key_positions is not None and mass in (None, "group")
            and last is None and mx.default_device() == mx.cpu
            and queries.shape[0] * queries.shape[1] * keys.shape[2] <= FAST_SOFTMAX_MAX):
        return _one_query_owned(queries, keys, values, scale, key_positions, query_positions, owner, heads_per_row, mass)
    if quantized:  # low-bit slots (kvcompress.storage): codes read directly, or dequantized for a chunk
        keys, values = for_step(keys, queries.shape[2]), for_step(values, queries.shape[2])
    if mass not in (None, "group", "heads", "max", "weights"):
        raise ValueError(f"mass must be None, 'group', 'heads', 'max' or 'weights', got {mass!r}")
    b, _, n, d = queries.shape
    h_kv, t = keys.shape[1], keys.shape[2]
    g = _split_groups(queries, h_kv)
    start = 0 if last is None else max(n - last, 0)
    q = _f32(queries).reshape(b, h_kv, g, n, d) * scale
    kt = _f32(keys).swapaxes(-1, -2) if isinstance(keys, mx.array) else keys  # [B, H_kv, D, T] (or codes)
    v = None if values is None else _f32(values) if isinstance(values, mx.array) else values
    if key_positions is not None:
        qpos = mx.broadcast_to(query_positions, (query_positions.shape[0], 1, n)) if query_positions.ndim == 3 \
            else mx.broadcast_to(query_positions.reshape(1, 1, n), (1, 1, n))
    # a causal block never sees the keys after its last query: skip them (unless the mass needs all)
    cut = key_positions is None and isinstance(mask, str) and mask == "causal" and mass is None
    outs, total = [], None
    settle = b * h_kv * g * (n - start) * t > EVAL_BLOCKS_ABOVE
    for i0 in range(start, n, block):
        i1 = min(i0 + block, n)
        qb = q if (i0, i1) == (0, n) else q[:, :, :, i0:i1]
        if settle and (outs or total is not None):
            _finish_block(outs[-1] if outs else None, total)
        parts = [e.logits(qb) for e in extra]
        if key_positions is not None:
            vis = visibility(key_positions, qpos[..., i0:i1])[:, :, None]  # [B, H|1, 1, nb, T]
        else:
            vis = _block_mask(mask, i0, i1, n, t, h_kv, g)
        tb = t - n + i1 if cut else t
        logits = grouped_matmul(qb, kt if tb == t else kt[..., :tb]) if isinstance(kt, mx.array) else \
            keys_product(qb, kt, tb)
        if bias is not None:
            add = _block_mask(bias, i0, i1, n, t, h_kv, g).astype(mx.float32)
            logits = logits + (add if tb == t else add[..., :tb])
        if owner is not None:
            mine = owner_mask(owner, g, heads_per_row)[:, :, :, None, :]  # [B, H_kv, G, 1, T]
            vis = mine if vis is None else (vis & mine if vis.dtype == mx.bool_ else mx.where(mine, vis, NEG))
        if vis is not None:
            vis = vis if tb == t else vis[..., :tb]
            logits = mx.where(vis, logits, NEG) if vis.dtype == mx.bool_ else logits + vis.astype(mx.float32)
        parts.append(logits)
        if sinks is not None:
            sink = sinks.astype(mx.float32).reshape(1, h_kv, g, 1, 1)
            parts.append(mx.broadcast_to(sink, (b, h_kv, g, i1 - i0, 1)))
        logits = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
        w = _softmax(logits)
        x0 = sum(p.shape[-1] for p in parts[: len(extra)])
        ws = w[..., x0 : x0 + tb] if (x0 or sinks is not None) else w
        if v is not None:
            out = grouped_matmul(ws, v if tb == t else v[..., :tb, :]) if isinstance(v, mx.array) else \
                values_product(ws, v)
            x = 0
            for e, p in zip(extra, parts):
                out = out + e.output(w[..., x : x + p.shape[-1]])
                x += p.shape[-1]
            outs.append(out)
        if mass == "weights":
            total = ws if total is None else mx.concatenate([total, ws], axis=-2)
        elif mass is not None:
            wm = ws if query_weight is None else ws * query_weight[:, :, None, i0:i1, None].astype(mx.float32)
            if mass == "max":
                s = wm.max(axis=-2)
                total = s if total is None else mx.maximum(total, s)
            else:
                s = wm.sum(axis=-2)  # [B, H_kv, G, T]
                total = s if total is None else total + s
    out = None
    if v is not None:
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
        out = out.reshape(b, h_kv * g, n - start, -1).astype(queries.dtype)
    if mass is not None:
        if total is None:
            total = mx.zeros((b, h_kv, g, 0, t) if mass == "weights" else (b, h_kv, g, t), mx.float32)
        if mass == "group":
            total = total.mean(axis=2) if g > 1 else total[:, :, 0]
            if owner is not None and heads_per_row > 1:  # each slot was seen by its own heads only
                total = total * heads_per_row
        elif mass == "max":
            total = total.max(axis=2)
    return out, total


def grouped_matmul(x: mx.array, y: mx.array) -> mx.array:
    """``x`` ``[B, H, G, n, K]`` times ``y`` ``[B, H, K, M]`` -> ``[B, H, G, n, M]``: each KV head's
    ``G * n`` query rows in one matrix product (a batch broadcast over ``G`` costs MLX's CPU
    matmul several times more: it runs ``G`` times as many products of ``n`` rows)."""
    b, h, g, n, k = x.shape
    return (x.reshape(b, h, g * n, k) @ y).reshape(b, h, g, n, y.shape[-1])


def _one_query(queries, keys, values, scale):
    """:func:`attention` of one query per head seeing every slot, with the ``"group"`` mass:
    the same operations as the general path (so the same bits), without its per-call branching
    (a decode step of every mass-scoring cache comes here; its graph is built while the step
    before computes, on the same cores: measured ~1.5% of cam's and h2o's decode speed)."""
    b, h_q, _, d = queries.shape
    h_kv = keys.shape[1]
    g = _split_groups(queries, h_kv)
    q = _f32(queries).reshape(b, h_kv, g, 1, d) * scale
    w = _softmax(grouped_matmul(q, _f32(keys).swapaxes(-1, -2)))  # [B, H_kv, G, 1, T]
    out = grouped_matmul(w, _f32(values)).reshape(b, h_q, 1, -1).astype(queries.dtype)
    total = w.sum(axis=-2)
    return out, (total.mean(axis=2) if g > 1 else total[:, :, 0])


def _owned_core(q, kt, v, owner, pos, qpos, ids):
    """``q [B, R, G, D]`` (scaled) over ``kt [B, R, D, T]``, ``v``: head ``k`` sees slot ``t`` iff
    ``owner[t] == ids[k]`` and ``0 <= pos[t] <= qpos`` (:func:`attention`'s mask and softmax)."""
    vis = (owner[:, :, None, :] == ids) & (pos[:, :, None, :] >= 0) & (pos[:, :, None, :] <= qpos)
    w = _softmax(mx.where(vis, q @ kt, NEG))
    return w @ v, w


#: shapeless: one trace serves every store width (a cache below its budget grows every step)
_OWNED = mx.compile(_owned_core, shapeless=True) if COMPILE else _owned_core


def _one_query_owned(queries, keys, values, scale, key_positions, query_positions, owner, heads_per_row, mass):
    """A decode step over head-group rows (small logits, CPU) as one compiled graph: the general
    path's operations, the same bits, ~1.5x faster."""
    b, h_q, _, d = queries.shape
    r = keys.shape[1]
    g = h_q // r
    ids = _query_heads(g, heads_per_row, owner.dtype)
    q = _f32(queries).reshape(b, r, g, d) * scale
    out, w = _OWNED(q, _f32(keys).swapaxes(-1, -2), _f32(values), owner, key_positions,
                    query_positions.reshape(-1, 1, 1, 1), ids)
    out = out.reshape(b, h_q, 1, -1).astype(queries.dtype)
    return out, (w.mean(axis=2) * heads_per_row if mass == "group" else None)


def _finish_block(out, total) -> None:
    """Evaluate the previous query block before the next is built (chunks over
    :data:`EVAL_BLOCKS_ABOVE` logits). MLX allocates an op's output when it dispatches the op, so
    a lazy graph of blocks (even chained with ``mx.depends``) holds every block's logits at once,
    which defeats the blocking. Inside ``mx.compile`` nothing can be evaluated: the blocks then
    stay one lazy graph (same values, more memory)."""
    try:
        mx.eval([x for x in (out, total) if x is not None])
    except ValueError:  # "[eval] ... during function transformations like compile"
        pass


def _block_mask(mask, i0: int, i1: int, n: int, t: int, h_kv: int, g: int):
    """Rows ``i0:i1`` of an mlx-lm attention mask, broadcastable to ``[B, H_kv, G, rows, T]``
    (bool: True = visible; a float array is additive); None for no mask."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported attention mask {mask!r}; expected None, 'causal' or an array")
        ar = mx.arange(t - n + i0, t - n + i1, dtype=mx.int32)
        return visibility(mx.arange(t, dtype=mx.int32), ar)  # key j visible iff j <= T - N + i
    m = mask[..., i0:i1, :]
    if m.ndim == 3:
        return m[:, None, None]
    if m.ndim == 4:
        return m[:, :, None] if m.shape[1] == 1 else m.reshape(m.shape[0], h_kv, g, i1 - i0, m.shape[-1])
    if m.ndim != 2:
        raise ValueError(f"attention mask must have 2, 3 or 4 dims, got shape {mask.shape}")
    return m


def attention_mass(queries, keys, scale, key_positions, query_positions, *, query_weight=None, last=None,
                   bias=None, owner=None, heads_per_row=1):
    """``[B, H_kv, T]`` float32: :func:`attention`'s mass (mean over each GQA group) alone."""
    return attention(queries, keys, None, scale, key_positions, query_positions, query_weight=query_weight,
                     mass="group", last=last, bias=bias, owner=owner, heads_per_row=heads_per_row)[1]


def owner_mask(owner: mx.array, group: int, heads_per_row: int) -> mx.array:
    """``[B, R, group, T]`` bool: query head ``k`` of a row (``group`` query heads, ``heads_per_row``
    KV heads) sees slot ``t`` iff ``owner[t]`` is its GQA group's KV head (:func:`_query_heads`)."""
    return owner[:, :, None, :] == _query_heads(group, heads_per_row, owner.dtype)


def _query_heads(group: int, heads_per_row: int, dtype) -> mx.array:
    """``[1, 1, group, 1]``: each query head's KV head within its row, ``k // (group / heads_per_row)``."""
    return (mx.arange(group, dtype=dtype) // (group // heads_per_row)).reshape(1, 1, group, 1)


def sortable_bits(x: mx.array) -> mx.array:
    """float32 -> uint32 whose unsigned order is the float order (-inf < ... < +inf)."""
    u = x.astype(mx.float32).view(mx.uint32)
    neg = (u >> 31).astype(mx.bool_)
    return mx.where(neg, ~u, u | mx.array(0x80000000, mx.uint32))


def _lowest_one(key: mx.array, positions: mx.array, exclude: mx.array) -> mx.array:
    key = mx.where(exclude, mx.inf, key)
    low = key.min(axis=-1, keepdims=True)
    big = mx.array(2**31 - 1, positions.dtype)
    return mx.argmin(mx.where(key <= low, positions, big), axis=-1, keepdims=True).astype(mx.int32)


# a decode step's choice as one compiled function (fewer primitives: the CPU pays per primitive)
_LOWEST_ONE = mx.compile(_lowest_one) if COMPILE else _lowest_one


def lowest_k(key: mx.array, positions: mx.array, k: int, ordered: bool = False,
             exclude: Optional[mx.array] = None) -> mx.array:
    """Slot indices ``[B, H, k]`` int32 of the ``k`` smallest ``(key, position)`` pairs.

    ``key`` ``[B, H, T]`` (``+inf`` for slots that must not be chosen), ``positions`` the slots'
    token positions; ``exclude`` ``[B, H, T]`` bool: slots that must not be chosen either (as if
    their key were ``+inf``). Ties in ``key`` go to the lower position, so the set is the same
    for any slot order. With ``ordered`` the result is sorted, smallest first.
    """
    if k == 1:
        return _LOWEST_ONE(key, positions, mx.array(False) if exclude is None else exclude)
    if exclude is not None:
        key = mx.where(exclude, mx.inf, key)
    comp = (sortable_bits(key).astype(mx.uint64) << 32) | (
        (positions.astype(mx.int64) + 2**31).astype(mx.uint64)
    )
    if k >= key.shape[-1]:
        idx = mx.argsort(comp, axis=-1)[..., :k]
        return idx.astype(mx.int32)
    idx = mx.argpartition(comp, kth=k - 1, axis=-1)[..., :k]
    if ordered:
        order = mx.argsort(mx.take_along_axis(comp, idx, axis=-1), axis=-1)
        idx = mx.take_along_axis(idx, order, axis=-1)
    return idx.astype(mx.int32)
