"""Selection contracts of the sibling methods, each against a naive NumPy reference.

* SnapKV: the cache's scores equal the reference's pooled observation-window attention (max,
  avg, none; GQA; batch 2), and the kept set is the top ``C - 1 - w`` prefix plus the window;
  a short chunk uses its own queries; decode re-scoring pools slots in *position* order.
* TOVA: one score per layer (identical across heads), equal to the head-averaged last-query
  attention; the kept set is its top ``C - 1``; slot layouts stay identical across heads.
* StreamingLLM: exactly the sinks plus the most recent tokens, for any chunking (hypothesis).
* ChunkKV: evicts exactly the lowest-sum complete unprotected chunks; what remains is whole
  chunks; sinks, window and the open chunk survive (hypothesis over chunkings and sizes).
* PyramidKV: per-layer budgets are non-increasing, within a token of the linear schedule, and
  their mean is exactly the uniform budget.
* Position shift: attended keys sit at contiguous positions, which gives StreamingLLM's logits.
"""

from __future__ import annotations

import math

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcompress
from conftest import tiny_llama
from kvcompress import CompressedKVCache, ConfigError

D = 8
SCALE = D**-0.5


# ------------------------------------------------------------------------------------------------
# Driving one cache with random keys, values and real queries
# ------------------------------------------------------------------------------------------------


class Driver:
    """One :class:`CompressedKVCache` fed random K/V and observed with random queries."""

    def __init__(self, method, budget, b=1, hq=4, hkv=2, seed=0, **params):
        m = kvcompress.build_method(method, budget=budget, **params)
        self.cache = CompressedKVCache(m, budget)
        self.rng = np.random.default_rng(seed)
        self.b, self.hq, self.hkv = b, hq, hkv
        self.queries = []  # every step's queries, in order

    def _rand(self, *shape):
        return mx.array(self.rng.standard_normal(shape).astype(np.float32))

    def step(self, s: int):
        k, v = self._rand(self.b, self.hkv, s, D), self._rand(self.b, self.hkv, s, D)
        q = self._rand(self.b, self.hq, s, D)
        keys, _ = self.cache.update_and_fetch(k, v)
        self.cache.observe(q, SCALE)
        self.queries.append(np.array(q))
        return np.array(keys)

    def last_queries(self, m: int) -> np.ndarray:
        return np.concatenate(self.queries, axis=2)[:, :, -m:]

    @property
    def pos(self) -> np.ndarray:
        if self.cache.empty():
            return np.zeros((self.b, self.hkv, 0), np.int32)
        return np.array(self.cache._pos)

    @property
    def scores(self) -> np.ndarray:
        if self.cache.empty():
            return np.zeros((self.b, self.hkv, 0), np.float32)
        return np.array(self.cache._score)


def kept_sets(pos: np.ndarray) -> list[list[set]]:
    return [[set(pos[b, h].tolist()) for h in range(pos.shape[1])] for b in range(pos.shape[0])]


# ------------------------------------------------------------------------------------------------
# NumPy references
# ------------------------------------------------------------------------------------------------


def np_softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def np_pool(x, k, mode):
    """torch.nn.functional.{max,avg}_pool1d(kernel k, stride 1, padding k // 2)."""
    if mode == "none" or k == 1:
        return x
    r = k // 2
    pad = np.full(r, 0.0 if mode == "avg" else -np.inf)
    win = np.lib.stride_tricks.sliding_window_view(np.concatenate([pad, x, pad]), k)
    return win.mean(-1) if mode == "avg" else win.max(-1)


def np_snapkv(q_win, keys, pos, p0, kernel, pooling):
    """SnapKV per query head (window attention summed, prefix pooled), then mean per KV head."""
    b_, hq, m, _ = q_win.shape
    hkv, t = keys.shape[1], keys.shape[2]
    g = hq // hkv
    out = np.zeros((b_, hkv, t))
    q_pos = p0 + np.arange(m)
    for b in range(b_):
        for h in range(hq):
            kv = h // g
            logits = q_win[b, h].astype(np.float64) @ keys[b, kv].T.astype(np.float64) * SCALE
            logits = np.where(pos[b, kv][None, :] <= q_pos[:, None], logits, -np.inf)
            a = np_softmax(logits).sum(0)
            order = np.argsort(pos[b, kv])
            a_sorted = a[order]
            prefix = pos[b, kv][order] < p0  # the leading part in position order
            res = a_sorted.copy()
            res[prefix] = np_pool(a_sorted[prefix], kernel, pooling)
            out[b, kv, order] += res / g
    return out


def np_tova(q_last, keys):
    """Attention of the last query, averaged over all query heads: ``[B, T]``."""
    b_, hq = q_last.shape[:2]
    g = hq // keys.shape[1]
    out = np.zeros((b_, keys.shape[2]))
    for b in range(b_):
        for h in range(hq):
            logits = keys[b, h // g].astype(np.float64) @ q_last[b, h, 0].astype(np.float64) * SCALE
            out[b] += np_softmax(logits) / hq
    return out


def np_chunk_evict(scores, pos, offset, n_evict, c, n_sink, recent):
    """Positions of the ceil(E / c) lowest-sum complete unprotected chunks of one head."""
    prot = (pos < n_sink) | ((pos >= offset - recent) if recent else np.zeros_like(pos, bool))
    open_chunk = (offset - 1) // c if offset % c else None
    chunks: dict = {}
    for j, p in enumerate(pos):
        chunks.setdefault(int(p) // c, []).append(j)
    cands = [
        (float(scores[js].astype(np.float64).sum()), q)
        for q, js in chunks.items()
        if len(js) == c and not prot[js].any() and q != open_chunk
    ]
    k = math.ceil(n_evict / c)
    assert len(cands) >= k, "the reserved() bound must leave enough complete chunks"
    chosen = [q for _, q in sorted(cands)[:k]]
    return {int(pos[j]) for q in chosen for j in chunks[q]}


# ------------------------------------------------------------------------------------------------
# SnapKV
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["max", "avg", "none"])
@pytest.mark.parametrize("b,hq,hkv", [(1, 4, 2), (2, 2, 2), (2, 8, 2)], ids=["gqa2", "mha-b2", "gqa4-b2"])
def test_snapkv_scores_and_kept_set_match_reference(pooling, b, hq, hkv):
    budget, w, kernel, t = 24, 6, 5, 40
    d = Driver("snapkv", budget, b=b, hq=hq, hkv=hkv, seed=1, recent=w, kernel=kernel, pooling=pooling)
    keys = d.step(t)  # one prefill chunk, longer than the budget: scored, not yet evicted
    ref = np_snapkv(d.last_queries(w), keys, d.pos, t - w, kernel, pooling)
    np.testing.assert_allclose(d.scores, ref, rtol=1e-5, atol=1e-6)

    d.step(1)  # the first decode step evicts down to budget - 1 old tokens, then appends
    n_keep = budget - 1 - w
    for bi in range(b):
        for h in range(hkv):
            kept = set(d.pos[bi, h].tolist()) - {t}
            window = set(range(t - w, t))
            assert window <= kept and len(kept) == budget - 1
            pre = ref[bi, h, : t - w]
            kept_pre = np.array(sorted(kept - window))
            if pooling == "max":  # max pooling makes plateaus: any top-k of the plateau is valid
                lost = np.setdiff1d(np.arange(t - w), kept_pre)
                assert pre[kept_pre].min() >= pre[lost].max() - 1e-6
            else:
                assert set(kept_pre.tolist()) == set(np.argsort(-pre)[:n_keep].tolist())


def test_snapkv_short_chunk_uses_its_own_queries():
    d = Driver("snapkv", 200, recent=8, kernel=3, pooling="avg")
    d.step(30)
    keys = d.step(5)  # N < w: the window is this chunk's 5 queries
    ref = np_snapkv(d.last_queries(5), keys, d.pos, 30, 3, "avg")
    np.testing.assert_allclose(d.scores, ref, rtol=1e-5, atol=1e-6)


def test_snapkv_decode_interval_rescores_in_position_order():
    """interval=3: every 3rd decode offset re-scores with the last w queries across steps; slot
    reuse has scrambled slot order, so the pooling must follow positions."""
    w, kernel, budget = 5, 3, 20
    d = Driver("snapkv", budget, b=2, seed=3, recent=w, kernel=kernel, pooling="avg", interval=3)
    d.step(30)
    events = 0
    for _ in range(12):
        keys = d.step(1)
        off = d.cache.offset
        pos = d.pos
        new_slot = pos == off - 1
        if off % 3 == 0:
            ref = np_snapkv(d.last_queries(w), keys, pos, off - w, kernel, "avg")
            np.testing.assert_allclose(d.scores, ref, rtol=1e-5, atol=1e-6)
            events += 1
        else:
            assert (d.scores[new_slot] == 0).all()  # a new token waits, protected, for an event
        assert (np.sort(pos, -1)[..., -w:] == np.arange(off - w, off)).all()  # window kept
    assert events == 4
    assert not (np.diff(d.pos, axis=-1) > 0).all(), "slot reuse should have scrambled slot order"


def test_snapkv_row_events_follow_the_row_not_the_batch():
    """In a right-padded batch chunk a row that brings one real token has a decode step (no
    re-scoring with interval 0), one that brings several has a chunk: each row scores exactly as
    it does alone."""
    from kvcompress import BatchCompressedKVCache

    m = kvcompress.build_method("snapkv", budget=64, recent=4, kernel=3, pooling="avg")
    rng = np.random.default_rng(7)

    def rand(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    k1, v1, q1 = rand(2, 2, 12, D), rand(2, 2, 12, D), rand(2, 4, 12, D)
    k2, v2, q2 = rand(2, 2, 5, D), rand(2, 2, 5, D), rand(2, 4, 5, D)
    batch = BatchCompressedKVCache.merge([CompressedKVCache(m, 64), CompressedKVCache(m, 64)])
    batch.update_and_fetch(k1, v1)
    batch.observe(q1, SCALE)
    batch.prepare(lengths=[5, 1], right_padding=[0, 4])
    batch.update_and_fetch(k2, v2)
    batch.observe(q2, SCALE)
    batch.finalize()
    assert batch.offset.tolist() == [17, 13]
    for r, n in ((0, 5), (1, 1)):
        solo = CompressedKVCache(m, 64)
        solo.update_and_fetch(k1[r : r + 1], v1[r : r + 1])
        solo.observe(q1[r : r + 1], SCALE)
        before = np.array(solo._score)
        solo.update_and_fetch(k2[r : r + 1, :, :n], v2[r : r + 1, :, :n])
        solo.observe(q2[r : r + 1, :, :n], SCALE)
        if n == 1:  # a decode step leaves the chunk's scores, the new token enters at 0
            np.testing.assert_array_equal(np.array(solo._score)[..., :12], before)
        pos, score = np.array(batch._pos[r]), np.array(batch._score[r])
        for h in range(2):
            got = dict(zip(pos[h].tolist(), score[h].tolist()))
            got.pop(-1, None)
            want = dict(zip(np.array(solo._pos[0, h]).tolist(), np.array(solo._score[0, h]).tolist()))
            assert sorted(got) == sorted(want)
            np.testing.assert_allclose([got[p] for p in sorted(want)], [want[p] for p in sorted(want)],
                                       rtol=1e-5, atol=1e-6)


def test_snapkv_rejects_even_kernel():
    with pytest.raises(ConfigError, match="kernel"):
        kvcompress.build_method("snapkv", kernel=4)


# ------------------------------------------------------------------------------------------------
# TOVA
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("b,hq,hkv", [(2, 4, 2), (1, 4, 4)], ids=["gqa-b2", "mha"])
def test_tova_head_shared_scores_and_top_k(b, hq, hkv):
    budget = 12
    d = Driver("tova", budget, b=b, hq=hq, hkv=hkv, seed=4)
    keys = d.step(20)
    for _ in range(15):
        ref = np_tova(d.last_queries(1), keys)  # the step's last query, mean over all heads
        scores = d.scores
        assert (scores == scores[:, :1]).all(), "one score per layer: identical across heads"
        np.testing.assert_allclose(scores[:, 0], ref, rtol=1e-5, atol=1e-7)
        before = d.pos
        keys = d.step(1)
        pos = d.pos
        assert (pos == pos[:, :1]).all(), "slots must stay aligned across heads"
        for bi in range(b):
            kept_old = set(pos[bi, 0].tolist()) - {d.cache.offset - 1}
            top = set(before[bi, 0, np.argsort(-ref[bi])[: budget - 1]].tolist())
            assert kept_old == top


# ------------------------------------------------------------------------------------------------
# StreamingLLM
# ------------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    steps=st.lists(st.integers(1, 7), min_size=1, max_size=20),
    n_sink=st.sampled_from([0, 1, 4]),
    extra=st.integers(1, 12),
    b=st.sampled_from([1, 2]),
)
def test_streaming_llm_keeps_exactly_sinks_and_recent(steps, n_sink, extra, b):
    budget = n_sink + extra
    d = Driver("streaming_llm", budget, b=b, n_sink=n_sink)
    for s in steps:
        d.step(s)
        n, off = d.cache.size(), d.cache.offset
        expect = set(range(min(n_sink, off))) | set(range(off - (n - min(n_sink, off)), off))
        assert len(expect) == n
        assert all(k == expect for row in kept_sets(d.pos) for k in row)


# ------------------------------------------------------------------------------------------------
# ChunkKV
# ------------------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    steps=st.lists(st.integers(1, 9), min_size=2, max_size=14),
    c=st.sampled_from([1, 2, 3, 5]),
    n_sink=st.sampled_from([0, 3]),
    recent=st.sampled_from([0, 4]),
    slack=st.integers(1, 8),
    seed=st.integers(0, 2**16),
)
def test_chunk_selector_evicts_lowest_whole_chunks(steps, c, n_sink, recent, slack, seed):
    method = "chunkkv" if recent else "tova_chunk"  # SnapKV's window needs w >= 1
    sel = kvcompress.build_method(method, chunk=c, n_sink=n_sink, recent=recent).selector
    budget = sel.reserved(64) + slack
    d = Driver(method, budget, b=2, seed=seed, chunk=c, n_sink=n_sink, recent=recent)
    for s in [budget + 3, *steps]:  # the first chunk overflows: every later step may evict
        n, off, pos, scores = d.cache.size(), d.cache.offset, d.pos, d.scores
        n_evict = max(n - (budget - 1), 0) if n + s > budget else 0
        d.step(s)
        new = set(range(off, off + s))
        after = d.pos
        for bi in range(2):
            for h in range(2):
                gone = set(pos[bi, h].tolist()) - set(after[bi, h].tolist())
                expect = np_chunk_evict(scores[bi, h], pos[bi, h], off, n_evict, c, n_sink, recent) if n_evict else set()
                assert gone == expect
                kept = set(after[bi, h].tolist())
                assert set(range(min(n_sink, off + s))) <= kept and new <= kept
                # whole chunks: every chunk other than the open one is complete
                counts = np.bincount(after[bi, h] // c)
                open_chunk = (off + s - 1) // c
                assert ((counts[:open_chunk] == 0) | (counts[:open_chunk] == c)).all()
        assert d.cache.size() == n + s - len(gone) <= max(budget, n + s)


def test_chunk_selector_reserved_bound_is_tight_enough():
    """At budget = reserved + 1 the cache keeps working; below it, creation fails clearly."""
    m = kvcompress.build_method("chunkkv", chunk=5, recent=8, n_sink=2)
    r = m.selector.reserved(100)
    with pytest.raises(ConfigError, match="leaves no room to evict"):
        CompressedKVCache(m, r)
    d = Driver("chunkkv", r + 1, chunk=5, recent=8, n_sink=2, seed=5)
    for s in [r + 4, 1, 1, 7, 1, 3, 1, 1]:
        d.step(s)
    assert d.cache.evictions > 0 and d.cache.size() <= r + 1 + 6


def test_chunkkv_layer_reuse_shares_evictions_within_groups():
    model = tiny_llama(n_layers=4, seed=2)
    tokens = mx.array(np.random.default_rng(0).integers(0, 97, (1, 90)), dtype=mx.int32)

    def run(reuse):
        cache = kvcompress.make_prompt_cache(model, "chunkkv", budget=40, recent=8, chunk=4, reuse_layers=reuse)
        for i in range(0, 80, 16):
            model(tokens[:, i : i + 16], cache=cache)
        for i in range(80, 90):
            model(tokens[:, i : i + 1], cache=cache)
        return [np.array(c._pos) for c in cache]

    shared = run(2)
    assert np.array_equal(shared[0], shared[1]) and np.array_equal(shared[2], shared[3])
    own = run(1)
    assert np.array_equal(own[0], shared[0])  # layer 0 selects on its own scores either way
    # at least one follower layer would have chosen differently on its own scores
    assert not (np.array_equal(own[1], shared[1]) and np.array_equal(own[3], shared[3]))


def test_chunkkv_reuse_falls_back_when_layer_budgets_differ():
    model = tiny_llama(n_layers=3, seed=3)
    cache = kvcompress.make_prompt_cache(
        model,
        {
            "scorer": "snapkv", "selector": "chunk", "disposition": "drop",
            "budget": {"name": "pyramid", "budget": 40, "beta": 4.0},
            "params": {"recent": 4, "chunk": 3, "reuse_layers": 3, "n_sink": 0},
        },
    )
    budgets = [c.budget for c in cache]
    assert len(set(budgets)) == 3
    tokens = mx.array(np.random.default_rng(1).integers(0, 97, (1, 120)), dtype=mx.int32)
    for i in range(0, 120, 12):
        model(tokens[:, i : i + 12], cache=cache)
    for c in cache:
        assert c.evictions > 0 and c.size() <= c.budget - 1 + 12
        counts = np.bincount(np.array(c._pos)[0, 0] // 3)
        assert ((counts[:-2] == 0) | (counts[:-2] == 3)).all()


# ------------------------------------------------------------------------------------------------
# PyramidKV budgets
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_layers", [1, 2, 3, 5, 32, 80])
@pytest.mark.parametrize("budget,window", [(64, 0), (100, 8), (512, 32), (2048, 8), (160, 64)])
@pytest.mark.parametrize("beta", [2.0, 20.0])
def test_pyramid_mean_is_uniform_budget_and_linear(n_layers, budget, window, beta):
    info = kvcompress.ModelInfo(n_layers=n_layers)
    m = kvcompress.build_method("h2o_pyramid", budget=budget, recent=window, beta=beta, n_sink=4)
    got = m.budget.layer_budgets(info)
    uniform = kvcompress.build_method("h2o", budget=budget).budget.layer_budgets(info)
    assert len(got) == n_layers and sum(got) == sum(uniform) == n_layers * budget
    assert all(a >= b for a, b in zip(got, got[1:])), "budgets must not grow with depth"
    # every layer can evict past the selector's sinks and its recent window (recent_ratio=0.5)
    assert all(m.selector.reserved(b) < b for b in got)
    if n_layers > 1:
        from kvcompress_pyramidkv import smallest_budget

        p = budget - window
        lo = max(p / beta, smallest_budget(window, 4, 0.5) - window)
        hi = 2 * p - lo
        real = [window + hi - layer * (hi - lo) / (n_layers - 1) for layer in range(n_layers)]
        assert max(abs(g - r) for g, r in zip(got, real)) < 1.0 + 1e-9


@pytest.mark.parametrize("method", ["pyramidkv", "h2o_pyramid", "snapkv_merge"])
@pytest.mark.parametrize("n_layers", [5, 32])
@pytest.mark.parametrize("budget", [64, 128, 1024])
def test_pyramid_defaults_floor_every_layer_at_half_the_mean_prefix(method, n_layers, budget):
    """The registered pyramids default to beta = 2 (ours): the top layer keeps at least half the
    mean prefix (held through decode, PyramidKV's beta = 20 leaves a 5-layer model's top layer
    w + (C - w) / 20 tokens); the paper's beta stays a parameter."""
    info = kvcompress.ModelInfo(n_layers=n_layers)
    m = kvcompress.build_method(method, budget=budget)
    w = m.budget.recent
    got = m.budget.layer_budgets(info)
    assert m.budget.beta == 2.0 and sum(got) == n_layers * budget
    assert min(got) - w >= (budget - w) / 2 - 1 and max(got) - w <= 1.5 * (budget - w) + 1
    paper = kvcompress.build_method(method, budget=budget, beta=20.0).budget.layer_budgets(info)
    assert min(paper) < min(got)


def test_pyramid_needs_room_past_window_and_sinks():
    with pytest.raises(ConfigError, match="prefix tokens"):
        kvcompress.build_method("h2o_pyramid", budget=8, recent=4, n_sink=4).budget.layer_budgets(
            kvcompress.ModelInfo(n_layers=4)
        )


# ------------------------------------------------------------------------------------------------
# StreamingLLM position shift
# ------------------------------------------------------------------------------------------------


def _rope_each(rope, x, positions):
    """Reference: rotate every slot separately with the module itself."""
    out = np.zeros(x.shape, np.float32)
    for b in range(x.shape[0]):
        for h in range(x.shape[1]):
            for j in range(x.shape[2]):
                out[b, h, j] = np.array(rope(x[b : b + 1, h : h + 1, j : j + 1], offset=int(positions[b, h, j])))[0, 0, 0]
    return out


@pytest.mark.parametrize("traditional", [False, True])
def test_shift_rotates_keys_to_contiguous_positions(traditional):
    from kvcompress._state import flatten_state, restore_state
    from kvcompress_streaming_llm import PositionShift, rope_params
    from kvcompress_streaming_llm.shift import ShiftState

    rope = nn.RoPE(D, traditional=traditional, base=500.0)
    rng = np.random.default_rng(6)
    k0 = mx.array(rng.standard_normal((2, 2, 6, D)).astype(np.float32))
    pos = np.stack([np.stack([rng.permutation([0, 1, 5, 9, 12, 13]) for _ in range(2)]) for _ in range(2)])
    stored = mx.array(_rope_each(rope, k0, pos))
    disp = PositionShift()
    fresh = disp.init_state(kvcompress.LayerInfo())
    assert fresh == ShiftState() and not fresh.shifted  # nothing evicted: nothing to shift
    assert disp.view_keys(attrs.evolve(fresh, rope=rope_params(rope)), stored, mx.array(pos, dtype=mx.int32),
                          mx.full((2, 1, 1), 14, mx.int32)) is stored
    state = ShiftState(rope=rope_params(rope), shifted=True)  # bound to the model, after an eviction
    offset = mx.full((2, 1, 1), 14, mx.int32)
    view = disp.view_keys(state, stored, mx.array(pos, dtype=mx.int32), offset)
    rank = np.argsort(np.argsort(pos, -1), -1)
    np.testing.assert_allclose(np.array(view), _rope_each(rope, k0, 14 - 6 + rank), atol=2e-5)
    # StreamingLLM: query at the cache length n, keys at their ranks 0..n-1 -- same logits
    q0 = mx.array(rng.standard_normal((2, 2, 1, D)).astype(np.float32))
    ours = np.array(rope(q0, offset=14 - 1) @ view.swapaxes(-1, -2))
    ref = np.array(rope(q0, offset=5) @ mx.array(_rope_each(rope, k0, rank)).swapaxes(-1, -2))
    np.testing.assert_allclose(ours, ref, atol=2e-5)
    # the rotation survives save/load: the state flattens into cache.state and restores
    restored = restore_state(disp, *flatten_state(state))
    assert restored.shifted and restored.rope == state.rope
    assert mx.array_equal(disp.view_keys(restored, stored, mx.array(pos, dtype=mx.int32), offset), view)


class _Pinned:
    """Reference layer cache: given keys/values, a chosen RoPE offset, appends new tokens."""

    def __init__(self, keys, values, offset):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, k, v):
        self.keys = mx.concatenate([self.keys, k], axis=2)
        self.values = mx.concatenate([self.values, v], axis=2)
        self.offset += k.shape[2]
        return self.keys, self.values

    def make_mask(self, n, window_size=None, return_array=False):
        return None if n == 1 else "causal"


def test_streaming_llm_shift_decode_equals_reference_streaming_llm():
    """After eviction, a decode step with ``streaming_llm_shift`` gives the logits of a cache
    that holds the sinks + recent tokens re-rotated to positions 0..n-1, with the query at n."""
    from kvcompress_streaming_llm import rope_params

    model = tiny_llama(n_layers=2, seed=8)
    budget, n_sink = 10, 2
    cache = kvcompress.make_prompt_cache(model, "streaming_llm_shift", budget=budget, n_sink=n_sink)
    tokens = mx.array(np.random.default_rng(2).integers(0, 97, (1, 40)), dtype=mx.int32)
    for i in range(0, 30, 6):
        model(tokens[:, i : i + 6], cache=cache)
    for i in range(30, 35):
        model(tokens[:, i : i + 1], cache=cache)
    rp = rope_params(model.layers[0].self_attn.rope)
    ref = []
    for c in cache:
        k, v = c.keys_and_values()
        pos = np.array(c._pos)[0, 0]
        order = np.argsort(pos)
        keep = order[[*range(n_sink), *range(n_sink + 1, len(order))]]  # the oldest non-sink leaves
        kk = k[:, :, mx.array(keep)]
        delta = mx.broadcast_to(mx.array(np.arange(len(keep)) - pos[keep]), kk.shape[:3])
        kk = rp.rotate(kk, delta)  # from true positions to ranks 0..n-1
        ref.append(_Pinned(kk, v[:, :, mx.array(keep)], len(keep)))
    ours = model(tokens[:, 35:36], cache=cache)
    theirs = model(tokens[:, 35:36], cache=ref)
    assert np.abs(np.array(ours) - np.array(theirs)).max() < 1e-4
    model2 = tiny_llama(n_layers=2, seed=8)
    plain = kvcompress.make_prompt_cache(model2, "streaming_llm", budget=budget, n_sink=n_sink)
    for i in range(0, 30, 6):
        model2(tokens[:, i : i + 6], cache=plain)
    for i in range(30, 36):
        out = model2(tokens[:, i : i + 1], cache=plain)
    assert np.abs(np.array(out) - np.array(ours)).max() > 1e-3, "the shift must change the attention"


def test_shift_refuses_rope_it_cannot_shift():
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

    from kvcompress_streaming_llm import rope_params

    with pytest.raises(ConfigError, match="DynamicNTKScalingRoPE"):
        rope_params(DynamicNTKScalingRoPE(8, 128, False, 10000.0, 2.0))
