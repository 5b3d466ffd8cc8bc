"""``Rows`` (``kvcompress/engine/rows.py``): the per-row host facts and the one eviction rule,
tested without a model; then the rule against what real caches do."""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcompress
from kvcompress import BatchCompressedKVCache, CompressedKVCache
from kvcompress.engine import Rows, room_to_evict

row = st.tuples(st.integers(0, 64), st.integers(1, 16), st.integers(1, 9))  # held tokens, budget, step


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(row, min_size=1, max_size=4), g=st.integers(1, 3))
def test_need_keeps_budget_minus_one_tokens_and_ignores_the_step_size(rows, g):
    r = Rows(8)
    r.held = [g * min(n, b) for n, b, _ in rows]  # a row holds at most its budget between steps
    r.budget = [b for _, b, _ in rows]
    valid = [v for _, _, v in rows]
    need = r.need(valid, g)
    longer = r.need([v + b for v, b in zip(valid, r.budget)], g)  # every row over its budget
    for n, b, v, e, e_long in zip(r.held, r.budget, valid, need, longer):
        if n + g * v <= g * b:
            assert e == 0  # it fits: nothing leaves
        else:
            assert n - e == min(n, g * (b - 1))  # budget - 1 old tokens stay (if it held as many)
            assert e_long == e  # the count does not depend on S (what makes a trimmed step exact)


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 4), min_size=1, max_size=4), data=st.data())
def test_take_and_concat_are_inverse(sizes, data):
    parts = []
    for k in sizes:
        p = Rows(16, [data.draw(st.integers(-3, 40)) for _ in range(k)])
        p.held = [data.draw(st.integers(0, 16)) for _ in range(k)]
        p.evicted = [data.draw(st.integers(0, 9)) for _ in range(k)]
        p.passed = [data.draw(st.integers(0, 9)) for _ in range(k)]
        parts.append(p)
    whole = Rows.concat(parts, 16)
    assert len(whole) == sum(sizes)
    start = 0
    for p in parts:
        back = whole.take(list(range(start, start + len(p))))
        assert (back.held, back.offset, back.budget, back.evicted, back.passed) == (
            p.held, p.offset, p.budget, p.evicted, p.passed)
        start += len(p)
    # an empty single cache (no row yet) counts as one empty row where caches are merged
    assert len(Rows.concat([Rows(16), *parts], 16, empty_as_row=True)) == 1 + sum(max(k, 1) for k in sizes)


def test_right_padding_counts_until_finalize():
    r = Rows(16, [0, 0])
    r.pending, r.right = [3, 5], [2, 0]
    valid = r.take_valid(5)
    assert valid == [3, 5]
    r.advance(5, valid)
    assert r.offset == [5, 5] and r.seen() == [3, 5]
    r.finalize()
    assert r.offset == [3, 5] and r.pad is None and r.pending is None


@pytest.mark.parametrize("method", ["h2o", "snapkv", "chunkkv", "adakv", "streaming_llm"])
def test_room_to_evict_is_what_building_a_cache_checks(method):
    m = kvcompress.build_method(method, budget=64)
    for b in range(1, 80):
        if room_to_evict(m.selector, b):
            CompressedKVCache(m, b)
        else:
            with pytest.raises(kvcompress.ConfigError, match="no room to evict"):
                CompressedKVCache(m, b)


@pytest.mark.parametrize("method", ["h2o", "chunkkv", "adakv"])
@pytest.mark.parametrize("batch", [1, 2])
def test_held_after_is_what_the_step_then_holds(method, batch):
    """``held_after(S)`` (what ``make_mask`` reads) equals the widest row's tokens per head
    right after the step's eviction, before its ``S`` tokens are stored."""
    budget, h, d = 96, 4, 8
    m = kvcompress.build_method(method, budget=budget)
    c = (CompressedKVCache(m, budget) if batch == 1 else BatchCompressedKVCache(m, budget, [0] * batch))
    mx.random.seed(0)
    for S in (64, 40, 1, 1, 17, 1, 120, 1, 1):
        want = c.held_after(S)
        k = mx.random.normal((batch, h, S, d))
        c.update_and_fetch(k, mx.random.normal((batch, h, S, d)))
        c.observe(mx.random.normal((batch, h, S, d)), d ** -0.5)
        g = c.heads_per_row
        assert max(-(-n // g) for n in c.rows_held) == want + S
