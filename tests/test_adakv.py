"""AdaKV's head-wise budgets (selector ``adaptive``, method ``adakv``): a layer's heads share
``H x C`` slots, hold different counts when their scores say so, never more bytes than uniform
budgets, and every head keeps its protected tokens and its ``alpha x C`` best."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcompress
from conftest import make_caches, tiny_llama
from kvcompress import ConfigError
from kvcompress.contexts import LayerInfo
from kvcompress_adakv import AdaptiveSelector, head_best
from test_lowbit import kernel  # noqa: F401  (the fixture: the built module, or a skip with the reason)

D = 16


def naive_head_best(scores, owner, positions, g, k):
    """Each head's ``k`` best slots by (score, position), both descending (all of a head holding fewer)."""
    out = np.zeros(scores.shape, bool)
    for idx in np.ndindex(*scores.shape[:-1]):
        kk = int(k[idx[0]])
        for h in range(g):
            slots = np.flatnonzero(owner[idx] == h)
            order = sorted(slots, key=lambda t: (scores[idx][t], positions[idx][t]), reverse=True)
            out[idx][order[: max(kk, 0)]] = True
    return out


@pytest.mark.parametrize("g", [1, 2, 4])
@pytest.mark.parametrize("shape", [(1, 1, 12), (2, 3, 17)])
@pytest.mark.parametrize("k", [0, 1, 3, 20, "rows"])
def test_head_best_matches_a_numpy_reference(g, shape, k):
    """Exactly ``min(k, held)`` per head, ties (equal scores, protected slots at +inf) to the
    newer token, so a head of equal scores still leaves slots to evict."""
    rng = np.random.default_rng(g * 31 + shape[-1])
    scores = rng.standard_normal(shape).astype(np.float32)
    scores[..., ::5] = 0.5  # ties
    scores[..., 1::7] = np.inf  # protected slots rank first
    owner = rng.integers(-1, g, shape).astype(np.int32)
    positions = np.where(owner >= 0, rng.permuted(np.broadcast_to(np.arange(shape[-1]), shape), axis=-1), -1)
    ks = np.array([2, 5][: shape[0]]) if k == "rows" else np.full(shape[0], k)
    arg = mx.array(ks.reshape(-1, 1, 1), dtype=mx.int32) if k == "rows" else k
    got = np.array(head_best(mx.array(scores), mx.array(owner), mx.array(positions, dtype=mx.int32), g, arg))
    np.testing.assert_array_equal(got, naive_head_best(scores, owner, positions, g, ks))
    for idx in np.ndindex(*shape[:-1]):
        for h in range(g):
            assert got[idx][owner[idx] == h].sum() == min(ks[idx[0]], (owner[idx] == h).sum())
    flat = np.zeros(shape, np.float32)  # every score equal: the newest k of each head
    got = np.array(head_best(mx.array(flat), mx.array(owner), mx.array(positions, dtype=mx.int32), g, arg))
    np.testing.assert_array_equal(got, naive_head_best(flat, owner, positions, g, ks))


def _concentrated_and_spread(budget=12, alpha=0.1, n=48, seed=0):
    """One cache (2 KV heads, GQA 2) fed keys where head 0's queries single out two keys and
    head 1's attend evenly: scored by SnapKV's window, head 0 needs few tokens, head 1 many
    (one slot per eviction, ``step=1``, so the row is full after every step)."""
    model = tiny_llama(n_layers=1, hidden=64, heads=4, kv_heads=2)
    (c,) = kvcompress.make_prompt_cache(model, "adakv", budget=budget, recent=2, kernel=1, alpha=alpha, step=1)
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, 2, n, D)).astype(np.float32)
    q = np.zeros((1, 4, n, D), np.float32)
    q[:, :2] = 12.0 * k[:, 0, [5, 9]].mean(axis=1, keepdims=True)[:, None]  # head 0's two query heads
    v = rng.standard_normal((1, 2, n, D)).astype(np.float32)
    c.update_and_fetch(mx.array(k), mx.array(v))
    c.observe(mx.array(q), D**-0.5)
    for i in range(6):  # decode: new tokens, the same query pattern
        c.update_and_fetch(mx.array(k[:, :, i : i + 1]), mx.array(v[:, :, i : i + 1]))
        c.observe(mx.array(q[:, :, i : i + 1]), D**-0.5)
    return c, int(np.argmax(k[0, 0] @ q[0, 0, 0]))


def test_heads_hold_different_counts_when_scores_say_so_within_the_layer_total():
    c, top = _concentrated_and_spread()
    pos = np.array(c.head_view()[2])[0]
    counts = (pos >= 0).sum(-1)
    assert counts.sum() == 2 * c.budget  # the layer's total H x C, held
    assert counts[0] < counts[1], counts  # the spread head keeps more
    floor = math.ceil(0.1 * c.budget)
    assert counts.min() >= floor + 2  # alpha x C best, plus its recent window
    assert top in pos[0]  # the key head 0 attends most


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_bytes_held_never_exceed_uniform_budgets(kv_heads, kernels, request, monkeypatch):
    """Same feed, same budget: ``adakv``'s slots (keys, values, positions, scores) hold no more
    bytes than ``snapkv``'s (uniform budgets over the same scores), measured from the arrays the
    caches hold; decode's column lists (one int32 per slot a head holds, plus a column per head
    per token since the last eviction) and per-head counts come on top, and are counted (none
    where the CPU kernels' owner softmax attends: it lists nothing)."""
    from kvcompress.engine import heads

    if kernels:
        request.getfixturevalue("kernel")
    else:
        monkeypatch.setattr(heads, "owner_softmax", lambda: None)
    model = tiny_llama(n_layers=2, hidden=64, heads=4, kv_heads=kv_heads, seed=kv_heads)
    tokens = mx.array(np.random.default_rng(1).integers(1, 97, (2, 90)), dtype=mx.int32)
    held, extra, caches = {}, {}, {}
    for method in ("adakv", "snapkv"):
        cache = caches[method] = kvcompress.make_prompt_cache(model, method, budget=48)
        for i in range(0, 60, 20):
            model(tokens[:, i : i + 20], cache=cache)
        for i in range(60, 90):
            model(tokens[:, i : i + 1], cache=cache)
        mx.eval([c.state for c in cache])
        extra[method] = [c.parts.slots.extra_nbytes() for c in cache]
        held[method] = [c.nbytes - x for c, x in zip(cache, extra[method])]
        assert all(c.evictions > 0 for c in cache)
    assert all(a <= b for a, b in zip(held["adakv"], held["snapkv"])), held
    assert extra["snapkv"] == [0, 0]
    for c, x in zip(caches["adakv"], extra["adakv"]):  # [B, R, g, W] int32 lists + [B, R, g] counts
        rows, g = 2 * (kv_heads // c.heads_per_row), c.heads_per_row
        step = c.method.selector.evict_count(1, c.budget)
        if kernels or g == 1:
            assert x == 0
        else:
            assert 0 < x <= 4 * rows * g * (g * c.budget + step + 1)


def test_one_head_per_row_is_snapkv():
    """``heads=1``: every row one head, so the adaptive selector is the lowest-score selector."""
    model = tiny_llama(n_layers=2, hidden=64, heads=4, kv_heads=2, seed=3)
    tokens = mx.array(np.random.default_rng(2).integers(1, 97, (1, 80)), dtype=mx.int32)
    out = {}
    for method, extra in (("adakv", {"heads": 1, "alpha": 0.0, "step": 1}), ("snapkv", {})):
        cache = kvcompress.make_prompt_cache(model, method, budget=36, **extra)
        logits = [model(tokens[:, :50], cache=cache)]
        logits += [model(tokens[:, i : i + 1], cache=cache) for i in range(50, 80)]
        out[method] = ([np.sort(np.array(c.head_view()[2]), -1) for c in cache], logits)
    for a, b in zip(out["adakv"][0], out["snapkv"][0]):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(out["adakv"][1], out["snapkv"][1]):
        assert mx.array_equal(a, b)


def test_refused_under_tensor_parallelism_over_every_head():
    sel = AdaptiveSelector()
    with pytest.raises(ConfigError, match="tensor parallelism"):
        sel.head_group(LayerInfo(tp_size=2), 4)
    assert sel.head_group(LayerInfo(tp_size=2, kv_replicated=True), 1) == 1
    assert AdaptiveSelector(heads=2).head_group(LayerInfo(tp_size=2), 4) == 2
    with pytest.raises(ConfigError, match="must divide"):
        AdaptiveSelector(heads=3).head_group(LayerInfo(), 4)


@settings(max_examples=15, deadline=None)
@given(
    budget=st.integers(8, 24), prompt=st.integers(1, 70), chunk=st.integers(1, 24),
    decode=st.integers(0, 10), alpha=st.sampled_from([0.0, 0.2, 0.5]), n_sink=st.integers(0, 3),
    batch=st.integers(1, 2), seed=st.integers(0, 2**16), step=st.sampled_from([1, 3, 16]),
)
def test_head_wise_invariants_every_step(budget, prompt, chunk, decode, alpha, n_sink, batch, seed, step):
    """After every step: each row's heads hold ``g x`` tokens_kept slots, at most ``H x C`` once
    decoding; each head's positions are distinct, seen, include the newest token and its sinks;
    each head keeps at least ``min(seen, ceil(alpha x C))`` tokens; an eviction frees a multiple
    of ``step`` slots, so a row holds more than ``H x C - step`` once over budget."""
    model = tiny_llama(n_layers=1, hidden=64, heads=4, kv_heads=2, seed=seed % 7)
    budget += step - 1  # the slots an eviction may round up by are reserved (below: refused)
    (c,) = make_caches(model, "adakv", budget, recent=2, alpha=alpha, n_sink=n_sink, step=step)
    rng = np.random.default_rng(seed)
    tokens = mx.array(rng.integers(1, 97, (batch, prompt + decode)), dtype=mx.int32)
    steps = [(i, min(i + chunk, prompt)) for i in range(0, prompt, chunk)]
    steps += [(i, i + 1) for i in range(prompt, prompt + decode)]
    for i, j in steps:
        model(tokens[:, i:j], cache=[c])
        pos = np.array(c.head_view()[2])
        counts = (pos >= 0).sum(-1)  # [B, H]
        assert (counts.sum(-1) == 2 * c.tokens_kept).all()
        if j - i == 1 and j > prompt:  # (the freed slots a row refills in place count in its width)
            assert c.tokens_kept <= c.size() <= c.budget
        if j - i == 1 and j > max(prompt, c.budget):
            assert (counts.sum(-1) > 2 * c.budget - step).all() and (counts.sum(-1) <= 2 * c.budget).all()
        assert counts.min() >= min(j, math.ceil(alpha * c.budget))
        for p in pos.reshape(-1, pos.shape[-1]):
            p = p[p >= 0]
            assert len(set(p.tolist())) == p.size and p.max() == j - 1
            assert set(range(min(n_sink, j))) <= set(p.tolist())


def test_composes_with_a_query_free_scorer_and_refuses_one_that_mixes_heads():
    """Head-wise budgets over KeyDiff (a scorer that tells heads apart) run and hold the layer
    total; a scorer that does not declare ``head_groups`` is refused when the cache is built."""
    from kvcompress.errors import CompositionError

    model = tiny_llama(n_layers=1, hidden=64, heads=4, kv_heads=2, seed=4)
    (c,) = kvcompress.make_prompt_cache(model, None, scorer="keydiff", selector="adaptive",
                                        disposition="drop", budget={"name": "uniform", "budget": 16})
    tokens = mx.array(np.random.default_rng(4).integers(1, 97, (1, 60)), dtype=mx.int32)
    model(tokens[:, :40], cache=[c])
    for i in range(40, 60):
        model(tokens[:, i : i + 1], cache=[c])
    counts = (np.array(c.head_view()[2])[0] >= 0).sum(-1)
    assert counts.sum() == 2 * c.budget and c.evictions > 0
    with pytest.raises(CompositionError, match="head_groups"):
        kvcompress.make_prompt_cache(model, None, scorer="tova", selector="adaptive",
                                     disposition="drop", budget={"name": "uniform", "budget": 16})


@pytest.mark.parametrize("prompt", [20, 31, 40, 60])
@pytest.mark.parametrize("step", [1, 4, 9])
@pytest.mark.parametrize("evict_step", [1, 16])
def test_make_mask_width_is_the_step_rule_with_head_groups(prompt, step, evict_step):
    """Bug (issue 24): ``make_mask`` re-derived the eviction count without the head-group
    factor, so a 20-token adakv cache of budget 32 (40 slots for 2 heads) predicted 35 keys for
    a 4-token step that attends 24. The width asked before a step is what the step attends (as
    for snapkv with the same budget when each eviction frees exactly what it must, ``step=1``;
    the default frees 16 slots at a time, so the rows hold fewer)."""
    model = tiny_llama(kv_heads=2)
    widths = {}
    for method in ("snapkv", "adakv"):
        extra = {"step": evict_step} if method == "adakv" else {}
        cache = kvcompress.make_prompt_cache(model, method, budget=32, recent=4, **extra)
        ids = mx.array(np.random.default_rng(prompt).integers(1, 90, (1, prompt + step)), dtype=mx.int32)
        model(ids[:, :prompt], cache=cache)
        predicted = [c.make_mask(step, return_array=True) for c in cache]
        model(ids[:, prompt:], cache=cache)
        for c, m in zip(cache, predicted):
            if step == 1:
                assert m is None
                continue
            assert m.shape == (step, c.size()), (method, m.shape, c.size())
        widths[method] = [c.size() for c in cache]
    if evict_step == 1:
        assert widths["adakv"] == widths["snapkv"]
    else:
        assert all(a <= b for a, b in zip(widths["adakv"], widths["snapkv"]))


def test_step_rounds_evictions_up_and_reserves_room_for_them():
    """``step`` frees whole multiples of ``step`` slots; the budget must leave the ``step - 1``
    extra slots evictable, and a smaller one is refused naming the smallest that builds."""
    sel = AdaptiveSelector(recent=4, alpha=0.2, step=16)
    assert [sel.evict_count(e, b) for e, b in ((1, 64), (3, 4096), (16, 64), (17, 64))] == [16, 16, 16, 32]
    assert sel.reserved(64) == max(4, math.ceil(0.2 * 64)) + 15
    assert AdaptiveSelector(recent=4, alpha=0.2).evict_count(3, 512) == 3  # the component's default: exact
    with pytest.raises((TypeError, ValueError)):
        AdaptiveSelector(step=-1)
    model = tiny_llama(n_layers=1, hidden=64, heads=4, kv_heads=2)
    with pytest.raises(ConfigError, match="smallest budget that builds is 48"):
        kvcompress.make_prompt_cache(model, "adakv", budget=40, step=16)
    assert kvcompress.make_prompt_cache(model, "adakv", budget=48, step=16)[0].method.selector.step == 16


@pytest.mark.parametrize("budget, step", [(32, 1), (64, 2), (512, 16), (2048, 64), (2049, 65)])
def test_default_step_grows_with_the_budget(budget, step):
    """``step = 0`` (adakv's default): ``ceil(C / 32)`` slots per eviction, so a long budget
    selects rarely (decode speed) and a short one keeps its row nearly full; the room it
    reserves (``step - 1`` slots) follows."""
    sel = kvcompress.build_method("adakv").selector
    assert sel.step == 0
    assert [sel.evict_count(e, budget) for e in (1, step, step + 1)] == [step, step, 2 * step]
    assert sel.reserved(budget) == AdaptiveSelector(recent=32, alpha=0.2, step=step).reserved(budget)


def test_freed_slots_are_refilled_in_place_within_the_budgets_width():
    """An eviction frees ``step`` slots of a row; the next tokens go into them without
    compacting the row (decode attention reads each head's column list, which empty slots do
    not widen), but only while the row is no wider than its budget: a chunk that left it wider
    is compacted, so ``size()`` never exceeds the budget after a decode step."""
    model = tiny_llama(n_layers=1, hidden=64, heads=4, kv_heads=2, seed=5)
    tokens = mx.array(np.random.default_rng(5).integers(1, 97, (1, 140)), dtype=mx.int32)
    (c,) = kvcompress.make_prompt_cache(model, "adakv", budget=48, recent=2, step=16)
    model(tokens[:, :47], cache=[c])
    model(tokens[:, 47:53], cache=[c])  # 12 slots after a nearly full row: wider than 2 x 48
    assert c.parts.slots.n > 2 * c.budget
    holes = 0
    for i in range(53, 140):
        model(tokens[:, i : i + 1], cache=[c])
        assert c.tokens_kept <= c.size() <= c.budget
        holes += c.parts.slots.n > max(c.parts.rows.held)
    assert holes > 0  # steps that kept freed slots to refill
