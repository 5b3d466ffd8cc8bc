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

When scores are recomputed (an *event*): on every multi-token step (prefill chunks), and, if
``interval > 0``, on decode steps whose offset is a multiple of ``interval``. Between events
scores are left unchanged and a new token enters at 0.

* ``interval = 0`` (default; the reference compresses once, at prefill): each multi-token step
  is one SnapKV compression with that step's last ``min(N, w)`` queries (a chunked prefill runs
  SnapKV per chunk). The cache keeps the prompt tokens SnapKV chose, and generated tokens leave,
  oldest first, as they fall out of the protected window. The scorer keeps no state outside
  ``cache.state``, so save/load continues exactly.
* ``interval > 0`` (decode-time re-scoring, as kvpress's ``DecodingPress`` does): the window is
  the last ``w`` queries the layer saw *across* steps, kept per layer in the cache's shared dict
  (decode queries included); every ``interval`` steps all stored slots are re-scored with it.
  With ``interval <= w`` every generated token is scored while still protected, so it then
  competes with the prompt tokens on equal terms. This window is not part of ``cache.state``:
  after a save/load it restarts from the queries seen since.
"""

from __future__ import annotations

from functools import reduce
from typing import ClassVar, Literal

import attrs
import mlx.core as mx
from attrs.validators import ge, in_, instance_of

__all__ = ["SnapKVScorer", "window_mass", "pool_by_position", "pool1d"]

POOLINGS = ("max", "avg", "none")


def _odd(_inst, attribute, value):
    if value % 2 != 1:
        raise ValueError(f"{attribute.name} must be odd (same-length pooling), got {value}")


def window_mass(queries: mx.array, keys: mx.array, positions: mx.array, q_pos0: int, scale: float) -> mx.array:
    """``A[b, h_kv, g, j]``: attention of the window queries summed per query head, float32.

    queries ``[B, H_q, m, D]`` at positions ``q_pos0 .. q_pos0 + m - 1``; keys ``[B, H_kv, T, D]``
    at ``positions`` ``[B, H_kv, T]``. Query ``i`` sees key ``j`` iff ``p_j <= q_pos0 + i``.
    Returns ``[B, H_kv, G, T]`` with ``G = H_q // H_kv``.
    """
    b, h_q, m, d = queries.shape
    h_kv = keys.shape[1]
    if h_q % h_kv:
        raise ValueError(f"query heads ({h_q}) must be a multiple of KV heads ({h_kv})")
    g = h_q // h_kv
    q = queries.astype(mx.float32).reshape(b, h_kv, g, m, d) * scale
    k = mx.expand_dims(keys.astype(mx.float32), 2)  # [B, H_kv, 1, T, D]
    logits = q @ k.swapaxes(-1, -2)  # [B, H_kv, G, m, T]
    q_pos = mx.arange(q_pos0, q_pos0 + m, dtype=mx.int32)
    seen = positions[:, :, None, None, :] <= q_pos[:, None]  # [B, H_kv, 1, m, T]
    w = mx.softmax(mx.where(seen, logits, -mx.inf), axis=-1)
    return w.sum(axis=-2)


def pool1d(x: mx.array, kernel: int, pooling: str) -> mx.array:
    """Same-length stride-1 pooling over the last axis (padding ``kernel // 2`` each side)."""
    if pooling == "none" or kernel == 1:
        return x
    r = kernel // 2
    t = x.shape[-1]
    fill = 0.0 if pooling == "avg" else -mx.inf
    pad = mx.full(x.shape[:-1] + (r,), fill, dtype=x.dtype)
    xp = mx.concatenate([pad, x, pad], axis=-1)
    shifted = [xp[..., i : i + t] for i in range(kernel)]
    if pooling == "avg":
        return reduce(mx.add, shifted) / kernel
    return reduce(mx.maximum, shifted)


def pool_by_position(x: mx.array, positions: mx.array, window: mx.array, kernel: int, pooling: str) -> mx.array:
    """Pool ``x`` ``[B, H, G, T]`` along slots sorted by ``positions`` ``[B, H, T]``.

    ``window`` ``[B, H, T]`` bool marks observation-window slots: they pad the prefix's pooling
    and keep their raw value.
    """
    if pooling == "none" or kernel == 1:
        return x
    order = mx.argsort(positions, axis=-1)
    inv = mx.argsort(order, axis=-1)
    xs = mx.take_along_axis(x, order[:, :, None, :], axis=-1)
    ws = mx.take_along_axis(window, order, axis=-1)[:, :, None, :]
    fill = 0.0 if pooling == "avg" else -mx.inf
    pooled = pool1d(mx.where(ws, fill, xs), kernel, pooling)
    pooled = mx.where(ws, xs, pooled)
    return mx.take_along_axis(pooled, inv[:, :, None, :], axis=-1)


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
    provides: ClassVar[frozenset] = frozenset({"attention_mass", "window_attention"})

    def is_event(self, n_new: int, offset: int) -> bool:
        """Whether this step recomputes the scores."""
        return n_new > 1 or (self.interval > 0 and offset % self.interval == 0)

    def observe(self, scores, obs):
        entries = self._remember(obs)
        if not self.is_event(obs.n_new, obs.offset):
            return scores
        q = entries[0][0] if len(entries) == 1 else mx.concatenate([e[0] for e in entries], axis=2)
        m = min(q.shape[2], self.recent)
        q = q[:, :, q.shape[2] - m :]
        p0 = obs.offset - m
        mass = window_mass(q, obs.keys, obs.positions, p0, obs.scale)
        window = obs.positions >= p0
        return pool_by_position(mass, obs.positions, window, self.kernel, self.pooling).mean(axis=2)

    def _remember(self, obs) -> list:
        """The window queries as ``[(queries, first position), ...]``: this step's last
        ``min(N, w)``, or (``interval > 0``) the layer's last ``w`` across steps."""
        q, n, w = obs.queries, obs.queries.shape[2], self.recent
        if n >= w or self.interval == 0:
            m = min(n, w)
            if self.interval == 0:
                return [(q[:, :, n - m :] if n > m else q, obs.offset - m)]
            # a contiguous copy, so the stored window does not pin the whole chunk's queries
            entries = [(mx.contiguous(q[:, :, n - m :]) if n > m else q, obs.offset - m)]
        else:
            entries = list(obs.shared.get(("snapkv.window", obs.layer), ()))
            if entries:
                last_q, last_p0 = entries[-1]
                contiguous = last_p0 + last_q.shape[2] == obs.offset - n
                if not contiguous or last_q.shape[:2] != q.shape[:2] or last_q.dtype != q.dtype:
                    entries = []  # after a trim, a reload or a proxy step: start a new window
            entries.append((q, obs.offset - n))
            total = sum(e[0].shape[2] for e in entries)
            while total - entries[0][0].shape[2] >= w:
                total -= entries.pop(0)[0].shape[2]
        obs.shared[("snapkv.window", obs.layer)] = entries
        return entries
