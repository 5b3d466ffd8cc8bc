"""Scores come from the real queries when the attention wrapper is installed, and from the
key-as-query proxy (with a RuntimeWarning) when the model's attention bypasses it."""

from __future__ import annotations

import warnings

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import kvcompress
import kvcompress.engine.attend as kvc_engine
from conftest import make_caches, tiny_llama
from kvcompress import CompressedKVCache
from test_cache_protocol import _kv, feed, fresh_tiny, positions, token_ids

METHODS = sorted(kvcompress.get_registry().methods)


# ------------------------------------------------------------------------------------------------
# 12. real queries vs the key-as-query proxy
# ------------------------------------------------------------------------------------------------


class _BypassAttention(nn.Module):
    """Attention that calls ``mx.fast.scaled_dot_product_attention`` directly (not mlx-lm's)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.n_heads = self.n_kv_heads = heads
        self.head_dim = dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def __call__(self, x, cache):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.n_heads, -1).transpose(0, 2, 1, 3) for t in mx.split(self.qkv(x), 3, -1))
        q = mx.fast.rope(q, self.head_dim, traditional=False, base=1e4, scale=1.0, offset=cache.offset)
        k = mx.fast.rope(k, self.head_dim, traditional=False, base=1e4, scale=1.0, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5,
                                                 mask="causal" if n > 1 else None)
        return self.o(o.transpose(0, 2, 1, 3).reshape(b, n, -1))


class _Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.self_attn = _BypassAttention(dim, heads)

    def __call__(self, x, cache):
        return x + self.self_attn(x, cache)


class _BypassModel(nn.Module):
    def __init__(self, vocab=50, dim=32, heads=4, n_layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = [_Block(dim, heads) for _ in range(n_layers)]

    def __call__(self, tokens, cache):
        h = self.embed(tokens)
        for layer, c in zip(self.layers, cache):
            h = layer(h, c)
        return self.embed.as_linear(h)


@pytest.fixture
def fresh_proxy_warning(monkeypatch):
    """The proxy warning is issued once per process; let this test see it."""
    monkeypatch.setattr(kvc_engine, "_proxy_warned", False)


def test_bypassing_attention_falls_back_to_proxy_with_warning(fresh_proxy_warning):
    mx.random.seed(0)
    model = _BypassModel()
    mx.eval(model.parameters())
    cache = kvcompress.make_prompt_cache(model, "h2o", budget=8, n_sink=1, recent_ratio=0.0)
    assert not kvcompress.is_installed(model)
    tokens = token_ids(20, vocab=50, seed=10)
    with pytest.warns(RuntimeWarning, match="proxy"):
        feed(model, cache, tokens[:, :12], step=6)
    for i in range(12, 20):
        model(tokens[:, i : i + 1], cache=cache)
    for c in cache:
        assert c.score_source == "proxy" and c.diagnostics["score_source"] == "proxy"
        assert c.evictions > 0 and c.size() == 8
        assert float(c.slot_scores.sum()) > 0  # the proxy did score


def test_direct_update_without_observe_uses_proxy(fresh_proxy_warning):
    c = CompressedKVCache(kvcompress.build_method("h2o", budget=4, n_sink=1, recent_ratio=0.0), 4)
    c.update_and_fetch(*_kv(s=3, seed=1))
    assert c.score_source == "none"
    with pytest.warns(RuntimeWarning, match="scaled_dot_product_attention"):
        c.update_and_fetch(*_kv(s=1, seed=2))
    assert c.score_source == "proxy"
    # the proxy scored the first 3 slots with causal key-as-query attention: each key row sums to 1
    assert np.allclose(np.array(c.slot_scores[..., :3]).sum(-1), 3.0, atol=1e-5)


@pytest.mark.parametrize("method", METHODS)
def test_wrapper_installed_by_make_prompt_cache_uses_real_queries(method):
    model = tiny_llama(seed=11)
    cache = make_caches(model, method, 8)
    assert kvcompress.is_installed(model)
    n = 2 * max(c.budget for c in cache) + 4
    tokens = token_ids(n, seed=12)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        feed(model, cache, tokens, step=n // 4)
        feed(model, cache, token_ids(5, seed=13), step=1)
    for c in cache:
        assert c.score_source == "queries" and c.evictions > 0
        assert c.diagnostics["proxy_steps"] == 0 and c.diagnostics["query_steps"] == len(range(0, n, n // 4)) + 5


def test_fused_chunk_attention_matches_sdpa_and_seeds_the_mass():
    """A compressing prefill chunk computes attention and H2O mass from one softmax
    (:func:`kvcompress.ops.attention`): the output equals mlx's fast attention and the mass
    equals the separate blockwise computation."""
    from kvcompress import ops

    mx.random.seed(3)
    q = mx.random.normal((2, 8, 37, 16))
    k = mx.random.normal((2, 2, 90, 16))
    v = mx.random.normal((2, 2, 90, 16))
    kpos = mx.broadcast_to(mx.arange(90, dtype=mx.int32), (2, 2, 90))
    qpos = mx.arange(53, 90, dtype=mx.int32).reshape(1, 1, 37)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")
    out, mass = ops.attention(q, k, v, 0.25, kpos, qpos, mass="group", block=16)
    assert mx.allclose(out, ref, atol=1e-5).item()
    assert mx.allclose(mass, ops.attention_mass(q, k, 0.25, kpos, qpos), atol=1e-5).item()
    assert mx.allclose(mass.sum(-1), mx.full((2, 2), 37.0), atol=1e-3).item()  # each query sums to 1


def test_compressing_chunk_seeds_the_scorer_with_the_fused_mass(monkeypatch):
    """Inside a model, a compressing chunk of an h2o cache takes the fused path (the mass is
    handed to the scorer, not recomputed) and its output equals the plain path's."""
    from kvcompress import ops

    model = fresh_tiny()
    tokens = token_ids(40, seed=14)
    fused = kvcompress.make_prompt_cache(model, "h2o", budget=12, recent_ratio=0.0)
    plain = kvcompress.make_prompt_cache(model, "h2o", budget=12, recent_ratio=0.0)
    h2o = type(plain[0].method.scorer)
    unfused = type("Unfused", (h2o,), {"requires": h2o.requires - {"step_mass"}})
    for c in plain:  # the plain sdpa path: the scorer computes its own mass
        c.replace_method(attrs.evolve(c.method, scorer=unfused(**attrs.asdict(c.method.scorer, recurse=False))))
    calls = []
    original = ops.attention

    def spy(*args, **kw):
        calls.append(args[2] is not None and kw.get("mass") == "group")  # output and mass at once
        return original(*args, **kw)

    monkeypatch.setattr(ops, "attention", spy)
    a = feed(model, fused, tokens, step=10)
    assert sum(calls) == 3 * len(model.layers)  # chunks 2-4 compress; the first does not
    b = feed(model, plain, tokens, step=10)
    assert float(mx.abs(a - b).max()) < 1e-4
    for x, y in zip(fused, plain):
        assert np.array_equal(positions(x), positions(y))
        np.testing.assert_allclose(np.array(x.slot_scores), np.array(y.slot_scores), rtol=1e-4, atol=1e-5)
