"""mlx-lm cache-protocol guarantees of :class:`kvcompress.CompressedKVCache`.

* ``state`` is valid after every prefill chunk of ``generate_step`` and rebuilds the cache;
  ``nbytes`` is the bytes of the arrays actually held; in decode the buffers stay within one
  allocation step of the budget (exactly the budget, constant, with the ``lowest`` selector).
* Save/load round trip: a restored cache continues with identical logits and diagnostics; mixed
  lists with plain mlx-lm caches load too.
* ``trim``: tests/test_trim.py.
* Decode holds the budget; sinks and the recent window always stay; positions are unique per
  head.
* Bad input and impossible budgets: tests/test_cache_input.py.
* Real queries vs the key-as-query proxy: tests/test_real_queries.py.
"""

from __future__ import annotations

import json

import attrs
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.cache import KVCache, RotatingKVCache

import kvcompress
from conftest import assert_step_accounting, held_tokens, make_caches, tiny_llama
from kvcompress import CompressedKVCache
from kvcompress._state import derived_arrays, flatten_state
from kvcompress.components import KINDS

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


def _states(c) -> list:
    return [c.component_state(kind) for kind in KINDS]


def component_state_arrays(c) -> list:
    """The arrays of every component state the cache holds (what ``cache.state`` carries)."""
    return [a for st in _states(c) for a in flatten_state(st)[1]]


# Host-side bookkeeping arrays of O(B * H) entries the cache keeps between steps (the slot the
# last single token went into: the slots part's ``last``); not storage.
# transient step bookkeeping (like the queries an undo record keeps): the step's token ids
_BOOKKEEPING = {"last", "_tokens", "_step_tokens", "_undo_tokens"}


def _own_arrays(obj):
    """The arrays an engine holds, found by walking it and its parts (objects of
    ``kvcompress.engine``), bookkeeping left out."""
    for name, a in vars(obj).items():
        if name in _BOOKKEEPING:
            continue
        if isinstance(a, mx.array) and a.ndim > 0:
            yield a
        elif type(a).__module__.startswith("kvcompress.engine."):
            yield from _own_arrays(a)


def assert_nbytes_honest(c) -> None:
    """``nbytes`` == the cache's own buffers (found by walking the object, not its bookkeeping)
    plus the arrays of the component states it holds, and every array those states actually
    hold is among the counted bytes."""
    own = sum(a.nbytes for a in _own_arrays(c))
    held = component_state_arrays(c) + [a for st in _states(c) for a in derived_arrays(st)]
    declared = sum(a.nbytes for a in held)  # saved state, and what components derived (not saved)
    assert c.nbytes == own + declared
    assert sum(a.nbytes for st in _states(c) for a in _walk_arrays(st)) <= declared


def stored_arrays(c) -> tuple:
    """``(keys, values, positions, scores)`` as ``state`` lists them (after any disposition
    arrays, before the metadata string)."""
    st = c.state
    assert isinstance(st[-1], str)
    return tuple(st[-5:-1])


def _kv(b=1, h=2, s=3, d=16, dtype=mx.float32, dv=None, seed=0):
    mx.random.seed(seed)
    k = mx.random.normal((b, h, s, d)).astype(dtype)
    v = mx.random.normal((b, h, s, dv or d)).astype(dtype)
    return k, v


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
            pos = c.slot_positions  # without the head-group owner bits
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
    keeps_evicted = "attend" in cache[0].method.hooks()["disposition"]
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
                assert c.keys.shape[2] == c.values.shape[2] == c.slot_positions.shape[-1] == c.budget
            now = [c.nbytes for c in cache]
            steady = steady or now
            assert now == steady
    if exact and not keeps_evicted:
        c = cache[0]
        k, v = c.keys_and_values()
        per_slot = (k.nbytes + v.nbytes) // c.budget + 2 * 4 * k.shape[0] * k.shape[1]  # + pos + score
        extra = sum(a.nbytes for a in component_state_arrays(c))
        extra += sum(a.nbytes for st in _states(c) for a in derived_arrays(st))
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
        before = [(held_tokens(c), c.evictions) for c in cache]
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
            g = c.heads_per_row
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
        c.set_slot_scores((rank * c.slot_positions).astype(mx.float32))
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
