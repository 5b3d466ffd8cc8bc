"""Blockwise float32 attention weights from observed queries (private helper)."""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx

_QUERY_BLOCK = 256


def _block_mask(mask: Any, i0: int, i1: int, n: int, t: int, n_kv: int, group: int):
    """The part of ``mask`` for query rows ``i0:i1`` as a bool/additive array or None."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unsupported attention mask {mask!r}; expected None, 'causal' or an array")
        q_pos = mx.arange(t - n + i0, t - n + i1)[:, None]
        return q_pos >= mx.arange(t)[None]
    m = mask[..., i0:i1, :]
    if m.ndim == 4 and m.shape[1] not in (1,):
        b = m.shape[0]
        m = m.reshape(b, n_kv, group, i1 - i0, m.shape[-1])
    elif m.ndim == 4:
        m = mx.expand_dims(m, 2)
    return m


def attention_mass(
    queries: mx.array,
    keys: mx.array,
    scale: float,
    mask: Any = None,
    last: Optional[int] = None,
    block: int = _QUERY_BLOCK,
) -> mx.array:
    """Sum over queries of ``softmax(q k^T * scale)`` per key, mean over each GQA group.

    queries ``[B, H_q, N, D]``, keys ``[B, H_kv, T, D]`` -> ``[B, H_kv, T]`` float32.
    """
    b, h_q, n, d = queries.shape
    h_kv, t = keys.shape[1], keys.shape[2]
    if h_q % h_kv:
        raise ValueError(f"query heads ({h_q}) must be a multiple of KV heads ({h_kv})")
    group = h_q // h_kv
    start = 0 if last is None else max(n - last, 0)
    q = queries if queries.dtype == mx.float32 else queries.astype(mx.float32)
    q = q.reshape(b, h_kv, group, n, d) * scale
    k = keys if keys.dtype == mx.float32 else keys.astype(mx.float32)
    kt = mx.expand_dims(k, 2).swapaxes(-1, -2)  # [B, H_kv, 1, D, T]
    total = None
    for i0 in range(start, n, block):
        i1 = min(i0 + block, n)
        qb = q if (i0, i1) == (0, n) else q[:, :, :, i0:i1, :]
        logits = qb @ kt  # [B, H_kv, G, nb, T]
        m = _block_mask(mask, i0, i1, n, t, h_kv, group)
        if m is not None:
            if m.dtype == mx.bool_:
                logits = mx.where(m, logits, -mx.inf)
            else:
                logits = logits + m.astype(mx.float32)
        w = mx.softmax(logits, axis=-1).sum(axis=(2, 3))  # [B, H_kv, T]
        total = w if total is None else total + w
    if total is None:
        return mx.zeros((b, h_kv, t), dtype=mx.float32)
    return total / group if group > 1 else total


def attention_with_mass(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: Any = None,
    block: int = _QUERY_BLOCK,
) -> tuple[mx.array, mx.array]:
    """Attention output and :func:`attention_mass` from one softmax, in query blocks.

    Used for multi-token steps of a compressing cache: the softmax weights the output needs are
    the ones the scorer sums, so computing them once saves a second pass over ``N x T``.
    Returns ``(out [B, H_q, N, D_v] in the queries' dtype, mass [B, H_kv, T] float32)``.
    """
    b, h_q, n, d = queries.shape
    h_kv, t = keys.shape[1], keys.shape[2]
    group = h_q // h_kv
    q = queries.astype(mx.float32).reshape(b, h_kv, group, n, d) * scale
    kt = mx.expand_dims(keys.astype(mx.float32), 2).swapaxes(-1, -2)  # [B, H_kv, 1, D, T]
    v = mx.expand_dims(values.astype(mx.float32), 2)  # [B, H_kv, 1, T, Dv]
    outs, total = [], None
    for i0 in range(0, n, block):
        i1 = min(i0 + block, n)
        qb = q if (i0, i1) == (0, n) else q[:, :, :, i0:i1, :]
        logits = qb @ kt
        m = _block_mask(mask, i0, i1, n, t, h_kv, group)
        if m is not None:
            logits = mx.where(m, logits, -mx.inf) if m.dtype == mx.bool_ else logits + m.astype(mx.float32)
        w = mx.softmax(logits, axis=-1)
        outs.append(w @ v)  # [B, H_kv, G, nb, Dv]
        s = w.sum(axis=(2, 3))
        total = s if total is None else total + s
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    out = out.reshape(b, h_q, n, -1).astype(queries.dtype)
    return out, (total / group if group > 1 else total)
