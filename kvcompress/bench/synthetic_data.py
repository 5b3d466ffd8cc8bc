"""Seeded synthetic K/V streams and the output-perturbation measure of the synthetic workload.

The generator's parameters are read from a :class:`~kvcompress.bench.synthetic.SyntheticSettings`.

1. **Data** (seeded, :func:`make_data`). Per (batch, KV head), keys come from ``n_clusters``
   Gaussian centres plus noise, ``k_t = c_{z_t} + sigma * eps_t`` (``z_t`` uniform), values are
   ``N(0, I)``. A fraction ``hot_frac`` of positions are *heavy hitters*. The query of token ``i``
   (one per query head) aims at a key it may attend, ``q_i = g * (k_j + tau * eps)``, with ``j``
   a heavy hitter ``<= i`` (probability ``p_hot``), one of the last ``recent_window`` tokens
   (``p_recent``) or any token ``<= i`` (the rest). Attention is therefore peaked on ``j`` and
   its cluster, as in a trained model, and some tokens matter much more than others.
2. **Feed** (:func:`feed`). The keys/values enter a cache through ``update_and_fetch``: the first
   ``T - n_decode`` tokens as prefill chunks of ``prefill_step`` tokens (default 512), then
   ``n_decode`` single-token decode steps. After every step the step's queries are given to
   ``cache.observe(queries, scale)`` -- the call the SDPA wrapper makes in a real model --
   so the real scoring path runs (``score_source == "queries"``).
3. **Probe** (:func:`perturbation`). ``n_probe`` fresh queries per head, drawn like the queries
   of a token at position ``T``, attend (a) every key/value (the full cache) and (b) the
   keys/values the compressed cache returned on its last step. The *output perturbation* is the
   mean cosine distance ``1 - cos(o_full, o_comp)`` over batch, query heads and probes, with
   ``o = softmax(q K^T / sqrt(d)) V`` computed in float32 (lower is better; 0 = identical).
"""

from __future__ import annotations

from typing import Optional

import attrs
import mlx.core as mx
import numpy as np

__all__ = ["SyntheticData", "make_data", "feed", "attention_output", "perturbation", "probe_stats"]


@attrs.frozen
class SyntheticData:
    """One seeded stream: keys/values and step queries ``[B, H_kv|H_q, T, D]`` in the storage
    dtype (as a model would pass them), probe queries ``[B, H_q, P, D]`` float32, softmax
    ``scale`` and the heavy-hitter positions ``hot`` ``[B, H_kv, n_hot]``."""

    keys: mx.array
    values: mx.array
    queries: mx.array
    probes: mx.array
    scale: float
    hot: np.ndarray


def _targets(rng, pos: np.ndarray, hot: np.ndarray, s) -> np.ndarray:
    """Target key index for a query at each position in ``pos`` (see module docstring)."""
    u = rng.random(pos.shape)
    r = rng.random(pos.shape)
    n_hot = np.searchsorted(hot, pos, side="right")
    hot_pick = hot[np.minimum((r * n_hot).astype(np.int64), max(len(hot) - 1, 0))]
    window = np.minimum(s.recent_window, pos + 1)
    recent_pick = pos - (r * window).astype(np.int64)
    any_pick = (r * (pos + 1)).astype(np.int64)
    use_hot = (u < s.p_hot) & (n_hot > 0)
    use_recent = ~use_hot & (u < s.p_hot + s.p_recent)
    return np.where(use_hot, hot_pick, np.where(use_recent, recent_pick, any_pick))


def make_data(s, seq_len: int, seed: int, scenario: str = "structured") -> SyntheticData:
    """Seeded K/V and queries (numpy ``default_rng(seed)``; see module docstring).

    ``scenario="iid"``: keys, values, step queries and probes all i.i.d. ``N(0, I)``.
    """
    rng = np.random.default_rng(seed)
    B, H, Hq, D, T = s.batch, s.n_kv_heads, s.n_q_heads, s.head_dim, seq_len
    g = Hq // H
    dt = getattr(mx, s.dtype)
    if scenario == "iid":
        keys = rng.standard_normal((B, H, T, D), dtype=np.float32)
        values = rng.standard_normal((B, H, T, D), dtype=np.float32)
        queries = rng.standard_normal((B, Hq, T, D), dtype=np.float32)
        probes = rng.standard_normal((B, Hq, s.n_probe, D), dtype=np.float32)
        hot = np.zeros((B, H, 0), dtype=np.int64)
    else:
        centers = rng.standard_normal((B, H, s.n_clusters, D), dtype=np.float32)
        z = rng.integers(0, s.n_clusters, size=(B, H, T))
        keys = np.take_along_axis(centers, z[..., None], axis=2)
        keys = keys + s.key_noise * rng.standard_normal((B, H, T, D), dtype=np.float32)
        values = rng.standard_normal((B, H, T, D), dtype=np.float32)
        n_hot = max(1, int(round(s.hot_frac * T)))
        hot = np.stack(
            [np.sort(rng.choice(T, size=n_hot, replace=False)) for _ in range(B * H)]
        ).reshape(B, H, n_hot)

        def draw(positions: np.ndarray) -> np.ndarray:
            out = np.empty((B, Hq, len(positions), D), dtype=np.float32)
            for b in range(B):
                for hq in range(Hq):
                    h = hq // g
                    tgt = _targets(rng, positions, hot[b, h], s)
                    noise = s.query_noise * rng.standard_normal((len(positions), D), dtype=np.float32)
                    out[b, hq] = s.query_gain * (keys[b, h, tgt] + noise)
            return out

        queries = draw(np.arange(T))
        probes = draw(np.full(s.n_probe, T - 1))
    return SyntheticData(
        keys=mx.array(keys).astype(dt),
        values=mx.array(values).astype(dt),
        queries=mx.array(queries).astype(dt),
        probes=mx.array(probes),
        scale=D**-0.5,
        hot=hot,
    )


def _state_arrays(cache) -> list:
    return [x for x in cache.state if isinstance(x, mx.array)]


def feed(cache, data: SyntheticData, n_decode: int, prefill_step: Optional[int] = None,
         observe: bool = True):
    """Run ``data`` through ``cache`` (prefill chunk(s), then decode steps); return the K/V the
    last step attended. ``observe`` calls ``cache.observe`` after every step (compressed caches)."""
    T = data.keys.shape[2]
    n_dec = min(n_decode, T - 1)
    P = T - n_dec
    step = prefill_step or P
    k = v = None

    def one(s: int, e: int):
        nonlocal k, v
        k, v = cache.update_and_fetch(data.keys[..., s:e, :], data.values[..., s:e, :])
        if observe:
            cache.observe(data.queries[..., s:e, :], data.scale)
        mx.eval(k, v, _state_arrays(cache))

    for s in range(0, P, step):
        one(s, min(s + step, P))
    for t in range(P, T):
        one(t, t + 1)
    return k, v


def attention_output(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """``softmax(q K^T * scale) V`` in float32 with GQA: q ``[B,Hq,P,D]``, k/v ``[B,H,T,D]``."""
    B, Hq, P, D = q.shape
    H = k.shape[1]
    qg = q.astype(mx.float32).reshape(B, H, Hq // H, P, D)
    kf = mx.expand_dims(k.astype(mx.float32), 2)
    vf = mx.expand_dims(v.astype(mx.float32), 2)
    w = mx.softmax((qg * scale) @ kf.swapaxes(-1, -2), axis=-1)
    return (w @ vf).reshape(B, Hq, P, v.shape[-1])


def perturbation(probes, full_kv, comp_kv, scale: float) -> float:
    """Mean cosine distance ``1 - cos(o_full, o_comp)`` over batch, query heads and probes."""
    a = attention_output(probes, *full_kv, scale)
    b = attention_output(probes, *comp_kv, scale)
    cos = (a * b).sum(-1) / (mx.linalg.norm(a, axis=-1) * mx.linalg.norm(b, axis=-1) + 1e-12)
    # 1 - cos >= 0; clamp float rounding (identical outputs give ~ -1e-8)
    return max(0.0, float(mx.mean(1.0 - cos).item()))


def probe_stats(data: SyntheticData) -> dict:
    """How peaked full-cache probe attention is: mean top-1 weight and effective support
    ``1 / sum_j p_j^2`` (tokens), averaged over heads and probes."""
    B, Hq, P, D = data.probes.shape
    H = data.keys.shape[1]
    qg = data.probes.reshape(B, H, Hq // H, P, D)
    k = mx.expand_dims(data.keys.astype(mx.float32), 2)
    w = mx.softmax((qg * data.scale) @ k.swapaxes(-1, -2), axis=-1)
    return {
        "top1_weight": float(w.max(-1).mean().item()),
        "effective_support": float((1.0 / (w * w).sum(-1)).mean().item()),
    }
