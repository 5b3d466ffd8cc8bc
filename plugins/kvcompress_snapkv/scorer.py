"""SnapKV's observation-window score (Li et al., 2024, "SnapKV: LLM Knows What You are Looking
for Before Generation", Sec. 4.1 / Listing 1).

For the last ``w`` queries of a step (the *observation window*) and every stored key ``j``::

    A_{h,j} = sum_{i in window} softmax_j(q_{h,i} . k_j * scale)        (causal by position)
    S_{h,j} = pool_k(A_h)_j           over the prefix (non-window) keys, in position order
    s_j     = mean_{h in GQA group} S_{h,j}

``pool_k`` is a stride-1, same-length 1-D pooling of odd kernel ``k`` with padding ``k // 2``:
max pooling pads with ``-inf``, average pooling pads with zeros and always divides by ``k``
(``torch.nn.functional.{max,avg}_pool1d``, as the reference calls them). Window keys act as
padding for the prefix, exactly as the reference pools ``attn[..., :-w]`` alone; their own
score is their raw (group-mean) mass. The selector then keeps the top ``C - w`` prefix slots and
protects the window (``lowest`` with ``recent = w``).

Pooling is done per query head, then averaged over the heads sharing a KV head (kvpress's GQA
rule; the reference selects per query head, which stores ``H_q`` heads). Slots are pooled in
*position* order: decode reuses freed slots, so slot order is not position order.

When scores are recomputed (an *event*, per row): on every step that brings the row more than
one real token (prefill chunks), and, if ``interval > 0``, on steps that bring it one token
(decode) at an offset that is a multiple of ``interval``. A row's event does not depend on the
batch: a row whose part of a right-padded batch chunk is one real token has a decode step.
Between events scores are left unchanged and a new token enters at 0.

* ``interval = 0`` (default; the reference compresses once, at prefill): each multi-token step
  is one SnapKV compression with that row's last ``min(N, w)`` real queries (a chunked prefill
  runs SnapKV per chunk). The cache keeps the prompt tokens SnapKV chose, and generated tokens
  leave, oldest first, as they fall out of the protected window.
* ``interval > 0`` (decode-time re-scoring, as kvpress's ``DecodingPress`` does): the window is
  the last ``w`` queries the layer saw *across* steps (decode queries included), held in the
  scorer's state (:class:`WindowState`: it travels with copies, saves, loads and batch rows);
  every ``interval`` steps all stored slots are re-scored with it. With ``interval <= w`` every
  generated token is scored while still protected, so it then competes with the prompt tokens
  on equal terms.
"""

from __future__ import annotations

from functools import reduce
from typing import ClassVar, Literal, Optional

import attrs
import mlx.core as mx
from attrs.validators import ge, in_, instance_of

from kvcompress import rows_field
from kvcompress.ops import attention

__all__ = ["SnapKVScorer", "WindowState", "window_mass", "pool_by_position", "pool1d"]

POOLINGS = ("max", "avg", "none")


def _odd(_inst, attribute, value):
    if value % 2 != 1:
        raise ValueError(f"{attribute.name} must be odd (same-length pooling), got {value}")


def window_mass(queries, keys, positions, query_positions, scale, query_weight=None, owner=None,
                heads_per_row=1) -> mx.array:
    """``A[b, h_kv, g, j]``: attention of the window queries summed per query head, float32.

    queries ``[B, H_q, m, D]`` at ``query_positions`` ``[B, 1, m]``; keys ``[B, H_kv, T, D]`` at
    ``positions``. Query ``i`` sees key ``j`` iff ``0 <= p_j <= q_i``
    (:func:`kvcompress.ops.visibility`). Returns ``[B, H_kv, G, T]`` with ``G = H_q // H_kv``.
    """
    return attention(
        queries, keys, None, scale, positions, query_positions, query_weight=query_weight, mass="heads",
        owner=owner, heads_per_row=heads_per_row,
    )[1]


def pool1d(x: mx.array, kernel: int, pooling: str, segment=None) -> mx.array:
    """Same-length stride-1 pooling over the last axis (padding ``kernel // 2`` each side).

    ``segment`` (broadcastable to ``x``): a neighbour in another segment counts as padding (the
    heads of a head group, sorted one after the other)."""
    if pooling == "none" or kernel == 1:
        return x
    r = kernel // 2
    t = x.shape[-1]
    fill = 0.0 if pooling == "avg" else -mx.inf
    pad = mx.full(x.shape[:-1] + (r,), fill, dtype=x.dtype)
    xp = mx.concatenate([pad, x, pad], axis=-1)
    shifted = [xp[..., i : i + t] for i in range(kernel)]
    if segment is not None:
        seg = mx.broadcast_to(segment, x.shape)
        sp = mx.concatenate([mx.full(seg.shape[:-1] + (r,), -2, seg.dtype), seg,
                             mx.full(seg.shape[:-1] + (r,), -2, seg.dtype)], axis=-1)
        shifted = [mx.where(sp[..., i : i + t] == seg, v, fill) for i, v in enumerate(shifted)]
    if pooling == "avg":
        return reduce(mx.add, shifted) / kernel
    return reduce(mx.maximum, shifted)


def pool_by_position(x: mx.array, positions: mx.array, window: mx.array, kernel: int, pooling: str,
                     owner=None) -> mx.array:
    """Pool ``x`` ``[B, H, G, T]`` along slots sorted by ``positions`` ``[B, H, T]``.

    ``window`` ``[B, H, T]`` bool marks observation-window slots (and empty ones): they pad the
    prefix's pooling and keep their raw value. With head groups, ``owner`` ``[B, H, T]``: each
    head's slots are pooled among themselves.
    """
    if pooling == "none" or kernel == 1:
        return x
    key = positions if owner is None else mx.where(positions >= 0, owner * (1 << 25) + positions, -1)
    order = mx.argsort(key, axis=-1)
    inv = mx.argsort(order, axis=-1)
    xs = mx.take_along_axis(x, order[:, :, None, :], axis=-1)
    ws = mx.take_along_axis(window, order, axis=-1)[:, :, None, :]
    fill = 0.0 if pooling == "avg" else -mx.inf
    seg = None if owner is None else mx.take_along_axis(owner, order, axis=-1)[:, :, None, :]
    pooled = pool1d(mx.where(ws, fill, xs), kernel, pooling, seg)
    pooled = mx.where(ws, xs, pooled)
    return mx.take_along_axis(pooled, inv[:, :, None, :], axis=-1)


@attrs.define
class WindowState:
    """The last ``w`` queries a layer saw (``interval > 0``), per row: ``queries``
    ``[B, H_q, w, D]`` and their positions ``[B, 1, w]`` (``-1``: not yet filled)."""

    queries: Optional[mx.array] = rows_field()
    positions: Optional[mx.array] = rows_field(fill=-1)


def _last_real(queries: mx.array, qpos: mx.array, n_valid: tuple, w: int):
    """Each row's last ``min(n_valid, w)`` real queries, right-aligned in ``w`` columns
    (``[B, H_q, w, D]``, positions ``[B, 1, w]`` with ``-1`` where a row has fewer)."""
    n = queries.shape[2]
    if all(v == n for v in n_valid) and n >= w:
        return queries[:, :, n - w :], qpos[..., n - w :]
    idx = mx.array(n_valid, dtype=mx.int32).reshape(-1, 1, 1) - w + mx.arange(w, dtype=mx.int32).reshape(1, 1, w)
    ok = idx >= 0
    idx = mx.maximum(idx, 0)
    q = mx.take_along_axis(queries, mx.broadcast_to(idx[..., None], (queries.shape[0], 1, w, 1)), axis=2)
    pos = mx.where(ok, mx.take_along_axis(qpos, idx, axis=-1), -1)
    return q, pos


@attrs.frozen
class SnapKVScorer:
    """SnapKV observation-window score; see the module docstring for the math.

    Parameters: ``recent`` (w, the observation window; the same name sizes the ``lowest``
    selector's protected window, so one value sets both), ``kernel`` (odd pooling size k),
    ``pooling`` (``"max"``, ``"avg"`` or ``"none"``), ``interval`` (decode re-scoring period;
    0 = prefill only).
    """

    recent: int = attrs.field(default=32, validator=[instance_of(int), ge(1)])
    kernel: int = attrs.field(default=7, validator=[instance_of(int), ge(1), _odd])
    pooling: Literal["max", "avg", "none"] = attrs.field(default="max", validator=in_(POOLINGS))
    interval: int = attrs.field(default=0, validator=[instance_of(int), ge(0)])

    requires: ClassVar[frozenset] = frozenset({"queries", "positions"})
    provides: ClassVar[frozenset] = frozenset({"attention_mass", "window_attention", "head_groups"})

    def init_state(self, layer) -> Optional[WindowState]:
        return WindowState() if self.interval > 0 else None

    def events(self, obs) -> list:
        """Per row: whether this step recomputes the row's scores (from the row's own real
        tokens in the step, never from the batch's step size)."""
        valid = obs.n_valid or (obs.n_new,) * len(obs.offsets)
        return [v > 1 or (v == 1 and self.interval > 0 and o % self.interval == 0) for v, o in zip(valid, obs.offsets)]

    def observe(self, scores, obs):
        events = self.events(obs)
        if self.interval == 0 and not any(events):
            return scores
        w = self.recent
        q, qpos = _last_real(obs.queries, obs.query_positions, obs.n_valid, w)
        if self.interval > 0:
            st = obs.state
            if st is not None and st.queries is not None and st.queries.shape[1:] == q.shape[1:] \
                    and st.queries.dtype == q.dtype:
                both_q = mx.concatenate([st.queries, q], axis=2)
                both_p = mx.concatenate([st.positions, qpos], axis=2)
                # keep each row's last w filled entries (empty ones, position -1, sort first)
                t = both_p.shape[-1]
                order = mx.argsort(mx.where(both_p >= 0, t + mx.arange(t), mx.arange(t)), axis=-1)[..., t - w :]
                q = mx.take_along_axis(both_q, mx.broadcast_to(order[..., None], (q.shape[0], 1, w, 1)), axis=2)
                qpos = mx.take_along_axis(both_p, order, axis=-1)
            obs.state = WindowState(queries=q, positions=qpos)
        if not any(events):
            return scores
        mass = window_mass(q, obs.keys, obs.positions, qpos, obs.scale, (qpos >= 0).astype(mx.float32),
                           obs.owner, obs.heads_per_row)
        first = mx.where(qpos >= 0, qpos, 2**30).min(axis=-1, keepdims=True)  # [B, 1, 1]
        window = (obs.positions >= first) | (obs.positions < 0)
        new = pool_by_position(mass, obs.positions, window, self.kernel, self.pooling, obs.owner).mean(axis=2)
        if obs.owner is not None and obs.heads_per_row > 1:  # each slot's own query heads only
            new = new * obs.heads_per_row
        if all(events):
            return new
        return mx.where(mx.array(events).reshape(-1, 1, 1), new, scores)
