"""Tests of the example plugin on its own: the math, the registration, a cache run.

Run from this folder after ``pip install -e .``: ``python -m pytest -q``.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest

import kvcompress
from kvcompress import CompositionError, LayerInfo, Observation, build_method
from kvcompress_knorm import KeyNormScorer, key_norm_score


def _keys(shape, seed, dtype=mx.float32):
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_score_is_negative_l2_norm(dtype):
    k = _keys((2, 3, 11, 8), seed=0, dtype=dtype)
    s = key_norm_score(k)
    ref = -np.linalg.norm(np.array(k.astype(mx.float32)), axis=-1)
    assert s.dtype == mx.float32 and s.shape == (2, 3, 11)
    np.testing.assert_allclose(np.array(s), ref, rtol=1e-5, atol=1e-6)


def test_observe_is_query_free():
    """The score ignores the previous scores, the queries and the proxy flag."""
    k = _keys((1, 2, 6, 4), seed=1)
    pos = mx.broadcast_to(mx.arange(6, dtype=mx.int32), (1, 2, 6))
    outs = []
    for q_seed, proxy in [(2, False), (3, True)]:
        obs = Observation(
            queries=_keys((1, 4, 2, 4), q_seed), keys=k, positions=pos,
            query_positions=mx.array([[[4, 5]]], dtype=mx.int32), n_new=2, scale=0.5,
            offset=mx.full((1, 1, 1), 6, mx.int32), offsets=(6,), layer=LayerInfo(), n_valid=(2,), proxy=proxy,
        )
        outs.append(np.array(KeyNormScorer().observe(mx.full((1, 2, 6), 7.0), obs)))
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[0], np.array(key_norm_score(k)))


def test_registered_through_the_entry_point():
    reg = kvcompress.get_registry()
    assert reg.component("scorer", "knorm").cls is KeyNormScorer
    assert reg.provider("scorer", "knorm").dist == "kvcompress-knorm"
    assert reg.method("knorm").scorer == "knorm"
    assert build_method("knorm").scorer.provides == frozenset({"key_norm"})


def test_gated_merge_is_rejected_at_build_time():
    with pytest.raises(CompositionError, match="attention_mass"):
        build_method(scorer="knorm", selector="lowest", disposition="gated_merge", budget="uniform")


def test_cache_keeps_the_lowest_norm_keys():
    """The paper's rule (no sinks, no recent window), fed token by token: the cache keeps the
    (budget - 1) lowest-norm old keys + the newest."""
    budget, n = 6, 20
    method = build_method("knorm", budget=budget, n_sink=0, recent_ratio=0.0)
    cache = kvcompress.CompressedKVCache(method, budget)
    k = _keys((1, 2, n, 4), seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no model: key-as-query proxy warning
        for t in range(n):
            cache.update_and_fetch(k[:, :, t : t + 1], k[:, :, t : t + 1])
    norms = np.linalg.norm(np.array(k), axis=-1)  # [1, 2, n]
    pos = np.sort(np.array(cache.state[-3]), axis=-1)  # state ends with keys, values, positions, scores, meta
    for h in range(2):
        old = np.argsort(norms[0, h, : n - 1], kind="stable")[: budget - 1]
        np.testing.assert_array_equal(pos[0, h], np.sort(np.append(old, n - 1)))


def test_defaults_keep_sinks_and_the_recent_half():
    """The method's defaults (ours): 4 sinks and the newest half of the budget stay; the other
    slots hold the lowest-norm keys among the rest."""
    budget, n, n_sink = 12, 40, 4
    method = build_method("knorm", budget=budget)
    assert (method.selector.n_sink, method.selector.recent_ratio) == (n_sink, 0.5)
    cache = kvcompress.CompressedKVCache(method, budget)
    k = _keys((1, 2, n, 4), seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for t in range(n):
            cache.update_and_fetch(k[:, :, t : t + 1], k[:, :, t : t + 1])
    pos = np.sort(np.array(cache.state[-3]), axis=-1)
    for h in range(2):
        kept = set(pos[0, h].tolist())
        assert set(range(n_sink)) <= kept and set(range(n - budget // 2, n)) <= kept
        assert len(kept) == budget
