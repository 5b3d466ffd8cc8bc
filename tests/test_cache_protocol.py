"""mlx-lm cache-protocol guarantees of :class:`kvcompress.CompressedKVCache`.

* ``state`` is valid after every prefill chunk of ``generate_step`` and rebuilds the cache;
  ``nbytes`` is the bytes of the arrays actually held; in decode the buffers stay within one
  allocation step of the budget (exactly the budget, constant, with the ``lowest`` selector).
* Save/load round trip: a restored cache continues with identical logits and diagnostics; mixed
  lists with plain mlx-lm caches load too.
* ``trim`` is exact within the last step (before or after eviction: the cache is then what it
  would be had the trimmed tokens never been fed) and raises, changing nothing, beyond it.
* Decode holds the budget; sinks and the recent window always stay; positions are unique per
  head.
* Bad input raises and leaves the cache untouched; impossible budgets fail at creation.
* Scores come from the real queries when the attention wrapper is installed, and from the
  key-as-query proxy (with a RuntimeWarning) when the model's attention bypasses it.
"""

from __future__ import annotations

import json
import warnings

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache, RotatingKVCache

import kvcompress
import kvcompress._engine_attend as kvc_engine
from conftest import assert_step_accounting, make_caches, tiny_llama
from kvcompress import CompressedKVCache, ConfigError, KVCompressError
from kvcompress._state import derived_arrays, flatten_state

METHODS = sorted(kvcompress.get_registry().methods)


def token_ids(n: int, vocab: int = 97, seed: int = 0, batch: int = 1) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, vocab, size=(batch, n)), dtype=mx.int32)


def fresh_tiny(**kw):
    """A new tiny model per test: components may bind to a model instance (``bind``)."""
    return tiny_llama(**kw)




def feed(model, cache, tokens: mx.array, step: int) -> mx.array:
    """Feed ``tokens`` [B, L] in chunks of ``step``; return the last chunk's logits."""
    out = None
    for i in range(0, tokens.shape[1], step):
        out = model(tokens[:, i : i + step], cache=cache)
    mx.eval(out)
    return out


def _attributes(obj) -> list:
    if obj is None:
        return []
    if attrs.has(type(obj)):
        return list(attrs.asdict(obj, recurse=False).values())
    return list(vars(obj).values()) if hasattr(obj, "__dict__") else []


def _arrays_in(obj) -> list:
    """The non-scalar mx.arrays an object references directly (attrs slots or __dict__)."""
    return [v for v in _attributes(obj) if isinstance(v, mx.array) and v.ndim > 0]


def _walk_arrays(obj, depth: int = 2) -> list:
    """Non-scalar mx.arrays reachable from ``obj`` through up to ``depth`` attribute hops."""
    out = _arrays_in(obj)
    if depth:
        for v in _attributes(obj):
            if not isinstance(v, mx.array) and (attrs.has(type(v)) or hasattr(v, "__dict__")):
                out += _walk_arrays(v, depth - 1)
    return out


def component_state_arrays(c) -> list:
    """The arrays of every component state the cache holds (what ``cache.state`` carries)."""
    return [a for st in c._states.values() for a in flatten_state(st)[1]]


# Host-side bookkeeping arrays of O(B * H) entries the cache keeps between steps (the slot the
# last single token went into, the cached offset array of a batch cache); not storage.
# transient step bookkeeping (like the queries an undo record keeps): the step's token ids
_BOOKKEEPING = {"_last_slots", "_off_arr", "_tokens", "_step_tokens", "_undo_tokens"}


def assert_nbytes_honest(c) -> None:
    """``nbytes`` == the cache's own buffers (found by walking the object, not its bookkeeping)
    plus the arrays of the component states it holds, and every array those states actually
    hold is among the counted bytes."""
    own = sum(a.nbytes for k, a in vars(c).items()
              if isinstance(a, mx.array) and a.ndim > 0 and k not in _BOOKKEEPING)
    held = component_state_arrays(c) + [a for st in c._states.values() for a in derived_arrays(st)]
    declared = sum(a.nbytes for a in held)  # saved state, and what components derived (not saved)
    assert c.nbytes == own + declared
    assert sum(a.nbytes for st in c._states.values() for a in _walk_arrays(st)) <= declared


def stored_arrays(c) -> tuple:
    """``(keys, values, positions, scores)`` as ``state`` lists them (after any disposition
    arrays, before the metadata string)."""
    st = c.state
    assert isinstance(st[-1], str)
    return tuple(st[-5:-1])


def positions(c) -> np.ndarray:
    """Held positions per (row, KV head) (-1: empty); head-wise budgets gather each head's slots."""
    return np.array(c.head_view()[2])


def snapshot(c) -> tuple:
    """A deep copy of everything observable about a cache."""
    st = c.state
    arrays = tuple(np.array(a) for a in st[:-1])
    return (c.offset, c.size(), c.nbytes, st[-1], arrays, json.dumps(c.diagnostics, sort_keys=True))


def assert_same_snapshot(a, b):
    assert a[:4] == b[:4]
    assert len(a[4]) == len(b[4])
    for x, y in zip(a[4], b[4]):
        assert x.dtype == y.dtype and np.array_equal(x, y)
    assert a[5] == b[5]


# ------------------------------------------------------------------------------------------------
# 5. state after every prefill chunk; nbytes
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("step", [5, 64])
@pytest.mark.parametrize("method", METHODS)
def test_state_valid_after_every_generate_step_chunk(method, step):
    model = fresh_tiny()
    cache = make_caches(model, method, 12)
    prompt = token_ids(3 * max(c.budget for c in cache) + 5, seed=1)[0]
    seen = []

    def progress(done, total):
        # called by generate_step right after its own mx.eval([c.state for c in cache])
        seen.append(done)
        for c in cache:
            st = c.state
            mx.eval([a for a in st if isinstance(a, mx.array)])
            meta = json.loads(st[-1])
            if done == 0:
                assert c.empty() and meta["rows_off"] == meta["rows_n"] == [] and c.offset == 0
                continue
            g = max(meta["g"], 1)  # KV heads per storage row (head-wise budgets store g per row)
            assert meta["rows_off"] == [c.offset] and meta["rows_n"] == [c.tokens_kept * g]
            if done < total:
                assert c.offset == done
            k, v, pos, score = stored_arrays(c)
            assert k.shape[2] == v.shape[2] == pos.shape[-1] == score.shape[-1] == c.size() * g
            assert pos.dtype == mx.int32 and score.dtype == mx.float32
            pos = c._positions()  # without the head-group owner bits
            assert (np.array(pos) < c.offset).all()
            assert ((np.array(pos) >= 0).sum(-1) == c.tokens_kept * g).all()  # held slots, per row
            assert np.isfinite(np.array(score)).all()
            r = CompressedKVCache.from_state(st)
            assert (r.offset, r.size(), r.evictions, r.budget) == (c.offset, c.size(), c.evictions, c.budget)
            assert mx.array_equal(r.keys_and_values()[0], c.keys_and_values()[0])
            assert len(r.state) == len(st)

    out = list(generate_step(prompt, model, prompt_cache=cache, prefill_step_size=step,
                             max_tokens=4, prompt_progress_callback=progress))
    assert len(out) == 4
    assert seen[0] == 0 and seen[-1] == len(prompt)
    assert len(seen) >= 2 + (len(prompt) - 2) // step
    assert all(c.evictions > 0 for c in cache)


@pytest.mark.parametrize("method", METHODS)
def test_nbytes_is_held_arrays_and_bounded_at_budget(method):
    model = fresh_tiny()
    cache = make_caches(model, method, 16)
    n_prompt = 2 * max(c.budget for c in cache)
    n_decode = 30
    tokens = token_ids(n_prompt + n_decode, seed=2, batch=2)
    for c in cache:
        assert_nbytes_honest(c)
        assert c.nbytes < 1024  # nothing but small component state before any token
    feed(model, cache, tokens[:, :n_prompt], step=7)
    for c in cache:
        assert_nbytes_honest(c)
    # a disposition that keeps evicted tokens (attends them) may grow; everyone else is bounded
    keeps_evicted = "attend" in cache[0]._hooks["disposition"]
    exact = cache[0].method.config.selector.name == "lowest"
    steady = None
    for i in range(n_prompt, n_prompt + n_decode):
        mx.eval(model(tokens[:, i : i + 1], cache=cache))
        for c in cache:
            assert_nbytes_honest(c)
            assert c.size() <= c.budget
            # never more than one allocation step beyond what a step attends
            assert c.keys.shape[2] <= c.budget - 1 + c.step
        if i < n_prompt + 2 or keeps_evicted:
            continue  # the first decode step compacts the over-budget prefill tail
        if exact:
            # steady state: decode reuses the freed slot, buffers hold exactly the budget
            for c in cache:
                assert c.keys.shape[2] == c.values.shape[2] == c._pos.shape[-1] == c.budget
            now = [c.nbytes for c in cache]
            steady = steady or now
            assert now == steady
    if exact and not keeps_evicted:
        c = cache[0]
        k, v = c.keys_and_values()
        per_slot = (k.nbytes + v.nbytes) // c.budget + 2 * 4 * k.shape[0] * k.shape[1]  # + pos + score
        extra = sum(a.nbytes for a in component_state_arrays(c))
        extra += sum(a.nbytes for st in c._states.values() for a in derived_arrays(st))
        assert steady[0] == per_slot * c.budget + extra


# ------------------------------------------------------------------------------------------------
# 6. save / load
# ------------------------------------------------------------------------------------------------


def _same_diagnostics(a, b) -> bool:
    """Equal diagnostics; ``nbytes`` may only shrink (a loaded cache holds no spare capacity), so
    the byte compression may only grow."""
    da, db = dict(a.diagnostics), dict(b.diagnostics)
    smaller = db.pop("nbytes") <= da.pop("nbytes")
    return smaller and db.pop("compression_bytes") >= da.pop("compression_bytes") and da == db


def _continue(model, cache, tokens):
    return [model(tokens[:, i : i + 1], cache=cache) for i in range(tokens.shape[1])]


@pytest.mark.parametrize("method", METHODS)
def test_save_load_round_trip_continues_identically(method, tmp_path):
    model = fresh_tiny()
    cache = make_caches(model, method, 12)
    n_prompt = 2 * max(c.budget for c in cache) + 6
    tokens = token_ids(n_prompt + 20, seed=3, batch=2)
    feed(model, cache, tokens[:, :n_prompt], step=8)
    _continue(model, cache, tokens[:, n_prompt : n_prompt + 6])  # decode with eviction
    assert all(c.evictions > 0 for c in cache)
    path = str(tmp_path / "cache.safetensors")
    kvcompress.save_prompt_cache(path, cache, {"note": "round trip"})
    loaded, meta = kvcompress.load_prompt_cache(path, return_metadata=True)
    assert meta == {"note": "round trip"}
    assert [type(c) for c in loaded] == [CompressedKVCache] * len(cache)
    for a, b in zip(cache, loaded):
        assert _same_diagnostics(a, b)
        assert a.method.config == b.method.config and a.budget == b.budget and a.layer == b.layer
        sa, sb = a.state, b.state
        assert sa[-1] == sb[-1] and len(sa) == len(sb)
        for x, y in zip(sa[:-1], sb[:-1]):  # component state arrays, keys, values, positions, scores
            assert x.dtype == y.dtype and mx.array_equal(x, y)

    rest = tokens[:, n_prompt + 6 :]
    for x, y in zip(_continue(model, cache, rest), _continue(model, loaded, rest)):
        assert mx.array_equal(x, y)
    for a, b in zip(cache, loaded):
        assert _same_diagnostics(a, b)
        assert np.array_equal(positions(a), positions(b))


def test_save_load_mixed_with_mlx_lm_caches(tmp_path):
    model = tiny_llama(n_layers=3, seed=4)
    tokens = token_ids(40, seed=5)
    method = kvcompress.build_method("h2o", budget=10, recent_ratio=0.0)
    kvcompress.install(model)
    cache = [CompressedKVCache(method, 10, layer=0), KVCache(), CompressedKVCache(method, 10, layer=2)]
    feed(model, cache, tokens[:, :30], step=6)
    path = str(tmp_path / "mixed.safetensors")
    kvcompress.save_prompt_cache(path, cache)
    loaded = kvcompress.load_prompt_cache(path)
    assert [type(c) for c in loaded] == [CompressedKVCache, KVCache, CompressedKVCache]
    assert loaded[1].offset == 30 and loaded[0].offset == 30 and loaded[0].size() == 10 + 5
    rest = tokens[:, 30:]
    for x, y in zip(_continue(model, cache, rest), _continue(model, loaded, rest)):
        assert mx.array_equal(x, y)

    # files written by mlx-lm itself, with its other cache classes, load through kvcompress
    plain = [KVCache(), RotatingKVCache(max_size=16, keep=4), KVCache()]
    feed(model, plain, tokens[:, :20], step=20)
    path = str(tmp_path / "plain.safetensors")
    mlx_cache.save_prompt_cache(path, plain)
    loaded = kvcompress.load_prompt_cache(path)
    assert [type(c) for c in loaded] == [KVCache, RotatingKVCache, KVCache]
    assert [c.offset for c in loaded] == [20, 20, 20]


def test_save_load_empty_cache(tmp_path):
    model = fresh_tiny()
    cache = kvcompress.make_prompt_cache(model, "cam", budget=8, n_sink=2, recent_ratio=0.0)
    path = str(tmp_path / "empty.safetensors")
    kvcompress.save_prompt_cache(path, cache)
    loaded = kvcompress.load_prompt_cache(path)
    assert all(c.empty() and c.offset == 0 and c.size() == 0 for c in loaded)
    tokens = token_ids(12, seed=6)
    assert mx.array_equal(feed(model, cache, tokens, 5), feed(model, loaded, tokens, 5))


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
        g = max(c._g, 1)
        assert c.offset == c.size() == c.tokens_kept == 15 and c._pos.shape[-1] == c._score.shape[-1] == 15 * g
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
    if c._g <= 1:
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
    g, slots = max(a._g, 1), np.array(a._pos)  # storage rows: g slots per token with head groups
    assert ((slots == -1).sum(-1) == g * (a.size() - a.tokens_kept)).all()
    if "evict_count" not in a._hooks["selector"]:  # one slot freed and reused, then trimmed
        assert ((slots == -1).sum(-1) == g).all() and a.size() == a.budget
    _drive_direct(a, np.random.default_rng(4), [1, 1, 2, 1])
    _drive_direct(b, np.random.default_rng(4), [1, 1, 2, 1])
    _assert_same_cache(a, b)


@pytest.mark.parametrize("method", ["h2o", "snapkv", "streaming_llm", "knorm"])
def test_a_long_step_is_trimmable_only_whole_when_scores_need_its_queries(method):
    """Steps of more than 16 tokens keep no queries to re-observe with: a query-scored cache can
    only drop such a step whole; a query-free scorer re-scores without them."""
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


# ------------------------------------------------------------------------------------------------
# 8. decode holds the budget, sinks stay, positions unique
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_decode_holds_budget_keeps_sinks_unique_positions(method):
    model = tiny_llama(seed=9)
    for layer in model.model.layers:  # content-dependent attention, so heads keep different tokens
        layer.self_attn.q_proj.weight = layer.self_attn.q_proj.weight * 8.0
    cache = make_caches(model, method, 12)
    n_prompt = max(c.budget for c in cache) - 3
    n_decode = 24
    tokens = token_ids(n_prompt + n_decode, seed=9, batch=2)
    feed(model, cache, tokens[:, :n_prompt], step=4)
    full = {c.layer: False for c in cache}
    for i in range(n_prompt, n_prompt + n_decode):
        before = [(c.size(), c.evictions) for c in cache]
        mx.eval(model(tokens[:, i : i + 1], cache=cache))
        for c, (n, e) in zip(cache, before):
            assert c.offset == i + 1
            assert_step_accounting(c, n, e, 1)
            full[c.layer] |= c.size() == c.budget
            if c.method.config.selector.name == "lowest" and full[c.layer]:
                assert c.tokens_kept == c.size() == c.budget  # once full, always full
            assert c.size() <= c.budget
            n_sink = min(getattr(c.method.selector, "n_sink", 0), c.offset)
            pos = positions(c)
            g = max(c._g, 1)
            assert pos.shape[:2] == (2, c.keys.shape[1] * g) and (g > 1 or pos.shape[-1] == c.size())
            empty = np.iinfo(np.int32).max // 2 + np.arange(pos.shape[-1])  # distinct, after every position
            srt = np.sort(np.where(pos >= 0, pos, empty), axis=-1)
            assert (np.diff(srt, axis=-1) > 0).all(), "a position is stored twice in one head"
            assert (srt[..., :n_sink] == np.arange(n_sink)).all(), "an attention sink was evicted"
            assert (pos == i).sum(-1).min() == 1, "the newest token is not stored in every head"
            assert (pos < c.offset).all()
    assert all(full.values()) and all(c.evictions > 0 for c in cache)


def _drive_with_rigged_scores(method, n_sink, recent, budget, rank, steps=30):
    """Decode ``steps`` random tokens, overwriting the scores before every eviction so that the
    oldest (``rank=+1``) or the newest (``rank=-1``) slots score lowest; yields positions."""
    c = CompressedKVCache(
        kvcompress.build_method(method, budget=budget, n_sink=n_sink, recent=recent, recent_ratio=0.0),
        budget,
    )
    for t in range(steps):
        k = mx.random.normal((1, 2, 1, 16), key=mx.random.key(t))
        c.update_and_fetch(k, -k)
        c.observe(mx.random.normal((1, 4, 1, 16), key=mx.random.key(1000 + t)), 0.25)
        c._score = (rank * c._pos).astype(mx.float32)
        yield t, positions(c)


@pytest.mark.parametrize("rank", [1, -1], ids=["oldest-lowest", "newest-lowest"])
@pytest.mark.parametrize("method", ["h2o", "cam"])
def test_sinks_and_recent_window_survive_lowest_scores(method, rank):
    n_sink, recent, budget = 2, 3, 8
    for t, pos in _drive_with_rigged_scores(method, n_sink, recent, budget, rank):
        must = set(range(min(n_sink, t + 1))) | set(range(max(0, t - recent), t + 1))
        for row in pos.reshape(-1, pos.shape[-1]):
            assert must <= set(row.tolist()), f"step {t}: missing {must - set(row.tolist())}"
            assert len(row) == min(t + 1, budget)
    # sanity: without protection the same streams evict the sinks / the recent tokens
    *_, (t, pos) = _drive_with_rigged_scores(method, 0, 0, budget, rank)
    if rank == 1:
        assert (pos >= n_sink).all()
    else:
        assert not (pos == t - 1).any()


# ------------------------------------------------------------------------------------------------
# 9. bad input never corrupts a cache; impossible budgets
# ------------------------------------------------------------------------------------------------


def _kv(b=1, h=2, s=3, d=16, dtype=mx.float32, dv=None, seed=0):
    mx.random.seed(seed)
    k = mx.random.normal((b, h, s, d)).astype(dtype)
    v = mx.random.normal((b, h, s, dv or d)).astype(dtype)
    return k, v


BAD_INPUTS = {
    "int keys": (lambda: _kv()[0].astype(mx.int32), lambda: _kv()[1], TypeError, "floating"),
    "dtype mismatch k/v": (lambda: _kv()[0], lambda: _kv()[1].astype(mx.float16), TypeError, "dtype"),
    "3-d": (lambda: _kv()[0][0], lambda: _kv()[1][0], ValueError, r"\[B, H_kv, S, D\]"),
    "5-d": (lambda: _kv()[0][None], lambda: _kv()[1][None], ValueError, r"\[B, H_kv, S, D\]"),
    "S mismatch": (lambda: _kv(s=3)[0], lambda: _kv(s=4)[1], ValueError, "disagree"),
    "numpy": (lambda: np.zeros((1, 2, 3, 16), np.float32), lambda: _kv()[1], TypeError, "mx.array"),
}
# only detectable once the cache holds something
BAD_FOR_FILLED = {
    "head_dim": (lambda: _kv(d=8)[0], lambda: _kv(d=8)[1], ValueError, "do not match"),
    "value head_dim": (lambda: _kv()[0], lambda: _kv(dv=8)[1], ValueError, "do not match"),
    "kv heads": (lambda: _kv(h=4)[0], lambda: _kv(h=4)[1], ValueError, "do not match"),
    "batch": (lambda: _kv(b=2)[0], lambda: _kv(b=2)[1], ValueError, "rows but the cache holds"),
    "cache dtype": (lambda: _kv(dtype=mx.float16)[0], lambda: _kv(dtype=mx.float16)[1], TypeError,
                    "does not match"),
}


def _filled_cache(stage: str):
    c = CompressedKVCache(kvcompress.build_method("cam", budget=6, n_sink=2, recent_ratio=0.0), 6)
    if stage == "empty":
        return c
    for i in range(4):  # 12 tokens through a budget of 6: evicted and merged
        k, v = _kv(s=3, seed=i + 1)
        c.update_and_fetch(k, v)
        if stage == "evicted" or i < 3:
            c.observe(mx.random.normal((1, 4, 3, 16)), 0.25)
    # stage "pending": the last step's keys wait for observe (a bad call must not score them)
    return c


@pytest.mark.filterwarnings("ignore:kvcompress. the model did not call:RuntimeWarning")
@pytest.mark.parametrize(
    "stage,case",
    [("empty", c) for c in sorted(BAD_INPUTS)]
    + [(s, c) for s in ("evicted", "pending") for c in sorted(BAD_INPUTS) + sorted(BAD_FOR_FILLED)],
)
def test_bad_input_raises_and_leaves_cache_unchanged(stage, case):
    make_k, make_v, exc, msg = {**BAD_INPUTS, **BAD_FOR_FILLED}[case]
    c = _filled_cache(stage)
    if stage != "empty":
        assert c.evictions > 0
    before = snapshot(c)
    pending = c._pending
    with pytest.raises(exc, match=msg):
        c.update_and_fetch(make_k(), make_v())
    assert_same_snapshot(snapshot(c), before)
    assert c._pending is pending
    # and the cache still works afterwards
    k, v = _kv(s=1, seed=99)
    out_k, _ = c.update_and_fetch(k, v)
    assert c.offset == before[0] + 1 and out_k.shape[2] == min(before[1] + 1, 6)


@pytest.mark.parametrize(
    "method,params,reserved",
    [
        ("h2o", dict(budget=4, n_sink=4, recent_ratio=0.0), 4),
        ("h2o", dict(budget=3, n_sink=4, recent_ratio=0.0), 4),
        ("h2o", dict(budget=6, n_sink=2, recent=4, recent_ratio=0.0), 6),
        ("cam", dict(budget=10, n_sink=4, recent=7, recent_ratio=0.0), 11),
        ("cam", dict(budget=10, n_sink=4, recent=0, recent_ratio=0.7), 11),
    ],
)
def test_impossible_budget_raises_config_error_naming_numbers(tiny_model, method, params, reserved):
    with pytest.raises(ConfigError) as err:
        kvcompress.make_prompt_cache(tiny_model, method, **params)
    msg = str(err.value)
    assert f"budget {params['budget']}" in msg and str(reserved) in msg


@pytest.mark.parametrize("budget", [0, -3, 2.5, True])
def test_non_positive_or_non_int_budget_raises(budget):
    method = kvcompress.build_method("h2o", n_sink=0, recent_ratio=0.0)
    with pytest.raises(ConfigError, match="budget"):
        CompressedKVCache(method, budget)


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
        assert float(c._score.sum()) > 0  # the proxy did score


def test_direct_update_without_observe_uses_proxy(fresh_proxy_warning):
    c = CompressedKVCache(kvcompress.build_method("h2o", budget=4, n_sink=1, recent_ratio=0.0), 4)
    c.update_and_fetch(*_kv(s=3, seed=1))
    assert c.score_source == "none"
    with pytest.warns(RuntimeWarning, match="scaled_dot_product_attention"):
        c.update_and_fetch(*_kv(s=1, seed=2))
    assert c.score_source == "proxy"
    # the proxy scored the first 3 slots with causal key-as-query attention: each key row sums to 1
    assert np.allclose(np.array(c._score[..., :3]).sum(-1), 3.0, atol=1e-5)


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
        assert c._proxy_steps == 0 and c._query_steps == len(range(0, n, n // 4)) + 5


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
    for c in plain:
        c._wants_mass = False  # the plain sdpa path: the scorer computes its own mass
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
        np.testing.assert_allclose(np.array(x._score), np.array(y._score), rtol=1e-4, atol=1e-5)
