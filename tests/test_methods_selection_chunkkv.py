"""Selection contract of ChunkKV, against a naive NumPy reference.

* ChunkKV: evicts exactly the lowest-sum complete unprotected chunks; what remains is whole
  chunks; sinks, window and the open chunk survive (hypothesis over chunkings and sizes).
* The chunk selector's ``reserved()`` bound is tight enough; layer reuse shares evictions within
  a group, and falls back when layer budgets differ.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcompress
from _methods_selection_helpers import Driver
from conftest import tiny_llama
from kvcompress import CompressedKVCache, ConfigError


# ------------------------------------------------------------------------------------------------
# NumPy reference
# ------------------------------------------------------------------------------------------------


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
        return [np.array(c.slot_positions) for c in cache]

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
        counts = np.bincount(np.array(c.slot_positions)[0, 0] // 3)
        assert ((counts[:-2] == 0) | (counts[:-2] == 3)).all()
