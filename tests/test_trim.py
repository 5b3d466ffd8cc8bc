"""``trim`` is exact within the last step (before or after eviction: the cache is then what it
would be had the trimmed tokens never been fed) and raises, changing nothing, beyond it."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache

import kvcompress
from conftest import make_caches, require_method, tiny_llama
from kvcompress import KVCompressError
from test_cache_protocol import (
    _continue, assert_same_snapshot, component_state_arrays, feed, fresh_tiny, positions, snapshot, token_ids,
)

METHODS = sorted(kvcompress.get_registry().methods)


# ------------------------------------------------------------------------------------------------
# 7. trim
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_trim_within_the_last_step_behaves_like_kvcache(method):
    """Before any eviction, trimming tokens of the last step is KVCache's trim: the same offset
    and stored tokens, and re-fed tokens give the same logits (speculative decoding's undo)."""
    model = fresh_tiny()
    tokens = token_ids(30, seed=7, batch=2)
    cache = kvcompress.make_prompt_cache(model, method, budget=4096)
    ref = [KVCache() for _ in model.layers]
    feed(model, cache, tokens[:, :20], step=10)  # steps of 10: the last step holds tokens 10..19
    feed(model, ref, tokens[:, :20], step=10)
    assert mlx_cache.can_trim_prompt_cache(cache)
    assert all(c.can_trim(n) for c in cache for n in (0, 1, 5, 10))
    assert mlx_cache.trim_prompt_cache(cache, 5) == mlx_cache.trim_prompt_cache(ref, 5) == 5
    for c in cache:
        g = c.heads_per_row
        assert c.offset == c.size() == c.tokens_kept == 15 and c.slot_positions.shape[-1] == c.slot_scores.shape[-1] == 15 * g
        assert (positions(c) == np.arange(15)).all()
    # speculative-decoding style: re-feed different tokens at the trimmed positions
    a = feed(model, cache, tokens[:, 20:30], step=4)
    b = feed(model, ref, tokens[:, 20:30], step=4)
    assert mx.array_equal(a, b)
    assert all(c.evictions == 0 for c in cache)


@pytest.mark.parametrize("method", METHODS)
def test_trim_beyond_the_last_step_raises_and_changes_nothing(method):
    """Older tokens already shaped scores (and, after eviction, what was evicted): trimming into
    them raises before anything changes, and the cache continues as if never asked."""
    model = fresh_tiny()
    cache = make_caches(model, method, 10)
    twin = make_caches(model, method, 10)
    tokens = token_ids(3 * max(c.budget for c in cache) + 3, seed=8)
    n = tokens.shape[1] - 3
    for cc in (cache, twin):
        feed(model, cc, tokens[:, :n], step=8)
        mx.eval(model(tokens[:, n : n + 1], cache=cc))  # a one-token step: only it can leave
    assert all(c.evictions > 0 for c in cache)
    before = [snapshot(c) for c in cache]
    assert mlx_cache.can_trim_prompt_cache(cache)  # is_trimmable: mlx-lm accepts the cache
    for c, s in zip(cache, before):
        assert c.is_trimmable() and c.can_trim(1) and not c.can_trim(2)
        with pytest.raises(KVCompressError, match="cannot trim 2 token"):
            c.trim(2)
        assert_same_snapshot(snapshot(c), s)
    with pytest.raises(KVCompressError):
        mlx_cache.trim_prompt_cache(cache, 5)
    for c, s in zip(cache, before):
        assert_same_snapshot(snapshot(c), s)
    rest = tokens[:, n + 1 :]
    for x, y in zip(_continue(model, cache, rest), _continue(model, twin, rest)):
        assert mx.array_equal(x, y)


def _drive_direct(c, rng, steps):
    """Feed ``steps`` (token counts) of random keys/values and real queries straight to a cache."""
    for s in steps:
        k = mx.array(rng.standard_normal((1, 2, s, 16)).astype(np.float32))
        v = mx.array(rng.standard_normal((1, 2, s, 16)).astype(np.float32))
        q = mx.array(rng.standard_normal((1, 4, s, 16)).astype(np.float32) * 3)
        if {"tokens", "predictions"} & c.method.scorer.requires:  # what the model hook hands over
            c.hand_tokens(mx.array(rng.integers(0, 97, (1, s)), dtype=mx.int32))
        c.update_and_fetch(k, v)
        c.observe(q, 0.25)


def _canonical(c):
    """What a cache holds, independent of its slot layout: per (row, head) the held slots sorted
    by position -- ``(positions, keys, values, scores)`` -- plus the component state arrays and
    the metadata without the group id (which is per prompt)."""
    *_, text = c.state
    meta = json.loads(text)
    for k in ("group", "n"):
        meta.pop(k)
    k, v, pos, score = (np.array(x.astype(mx.float32)) for x in c.head_view())
    pos = pos.astype(np.int32)
    order = np.argsort(np.where(pos >= 0, pos, np.iinfo(np.int32).max), axis=-1)
    if c.heads_per_row <= 1:
        order = order[..., : c.tokens_kept]
    held = (
        np.take_along_axis(pos, order, -1),
        np.take_along_axis(k, order[..., None], 2),
        np.take_along_axis(v, order[..., None], 2),
        np.take_along_axis(score, order, -1),
    )
    return held, [np.array(a) for a in component_state_arrays(c)], meta


def _assert_same_cache(a, b):
    """The same tokens at the same positions with the same keys, values and component state;
    scores (and merged values) equal up to float32 summation order: a slot layout that differs
    sums the softmax, and the losers merged into one target, in another order. Without merges
    the keys and values are the fed ones, bit for bit."""
    (pa, ka, va, sa), xa, ma = _canonical(a)
    (pb, kb, vb, sb), xb, mb = _canonical(b)
    assert ma == mb
    assert np.array_equal(pa, pb)
    np.testing.assert_allclose(ka, kb, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(va, vb, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sa, sb, rtol=1e-5, atol=1e-6)
    if a.method.config.disposition.name != "gated_merge":
        assert np.array_equal(ka, kb) and np.array_equal(va, vb)
    assert len(xa) == len(xb) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(xa, xb))


@pytest.mark.parametrize("method", METHODS)
def test_trim_after_eviction_is_exact_within_the_last_step(method):
    """Fed a step of S tokens and trimmed by k < S, a cache that has evicted holds what the cache
    fed only the first S - k tokens holds (scores re-observed from the remaining queries), and
    both continue alike; fully trimming a decode step leaves a freed slot that the next token
    reuses, after which it is again the cache that never saw the trimmed token."""
    model = tiny_llama(n_layers=1, hidden=64, heads=4, kv_heads=2)

    def pair():
        out = []
        for _ in range(2):
            (c,) = make_caches(model, method, 10)
            rng = np.random.default_rng(0)
            _drive_direct(c, rng, [c.budget + 2] * 3)  # over budget: evictions happened
            for _ in range(24):  # decode until the cache is full (chunk selectors free whole chunks)
                _drive_direct(c, rng, [1])
                if c.tokens_kept == c.budget:
                    break
            out.append(c)
        assert out[0].evictions > 0 and out[0].tokens_kept == out[0].budget
        return out

    for S, k in ((6, 2), (6, 5), (16, 9)):
        a, b = pair()
        rng_a, rng_b = np.random.default_rng(1), np.random.default_rng(1)
        _drive_direct(a, rng_a, [S])
        assert a.can_trim(k)
        assert a.trim(k) == k
        ka = mx.array(rng_b.standard_normal((1, 2, S, 16)).astype(np.float32))
        va = mx.array(rng_b.standard_normal((1, 2, S, 16)).astype(np.float32))
        qa = mx.array(rng_b.standard_normal((1, 4, S, 16)).astype(np.float32) * 3)
        if {"tokens", "predictions"} & b.method.scorer.requires:  # the first S - k of the ids a was handed
            b.hand_tokens(mx.array(rng_b.integers(0, 97, (1, S))[:, : S - k], dtype=mx.int32))
        b.update_and_fetch(ka[:, :, : S - k], va[:, :, : S - k])
        b.observe(qa[:, :, : S - k], 0.25)
        assert a.offset == b.offset and a.tokens_kept == b.tokens_kept and a.evictions == b.evictions
        _assert_same_cache(a, b)
        _drive_direct(a, np.random.default_rng(2), [3, 1, 1])
        _drive_direct(b, np.random.default_rng(2), [3, 1, 1])
        _assert_same_cache(a, b)

    # a decode step at full budget, fully trimmed: its eviction stays, its slot is freed
    a, b = pair()
    assert a.tokens_kept == a.budget  # full: the decode step evicts
    _drive_direct(a, np.random.default_rng(3), [1])
    assert a.trim(1) == 1 and a.offset == b.offset
    gone = a.evictions - b.evictions
    assert gone >= 1 and a.tokens_kept == a.budget - gone
    g, slots = a.heads_per_row, np.array(a.slot_positions)  # storage rows: g slots per token with head groups
    assert ((slots == -1).sum(-1) == g * (a.size() - a.tokens_kept)).all()
    if "evict_count" not in a.method.hooks()["selector"]:  # one slot freed and reused, then trimmed
        assert ((slots == -1).sum(-1) == g).all() and a.size() == a.budget
    _drive_direct(a, np.random.default_rng(4), [1, 1, 2, 1])
    _drive_direct(b, np.random.default_rng(4), [1, 1, 2, 1])
    _assert_same_cache(a, b)


@pytest.mark.parametrize("method", ["h2o", "snapkv", "streaming_llm", "keydiff", "knorm"])
def test_a_long_step_is_trimmable_only_whole_when_scores_need_its_queries(method):
    """Steps of more than 16 tokens keep no queries to re-observe with: a query-scored cache can
    only drop such a step whole; a query-free scorer (keydiff built in, knorm from the example
    plugin) re-scores without them."""
    require_method(method)
    model = tiny_llama(n_layers=1, hidden=64, heads=4, kv_heads=2)
    (c,) = make_caches(model, method, 10)
    _drive_direct(c, np.random.default_rng(0), [12, 12, 20])
    queries = "queries" in c.method.scorer.requires
    assert c.can_trim(20) and c.can_trim(3) == (not queries)
    if queries:
        before = snapshot(c)
        with pytest.raises(KVCompressError):
            c.trim(3)
        assert_same_snapshot(snapshot(c), before)
    assert c.trim(20) == 20 and c.offset == 24
