"""CaM (gated merge): the design note's whole "Evidence" list, at primitive and cache level.

Primitives (target and gate here; blend and window in test_cam_blend.py, cache level in
test_cam_cache.py) are the functions of ``plugins/kvcompress_cam/merge.py``: ``GatedMerge.nearest_target``,
``GatedMerge.window_targets``, ``gate_probability``, ``bernoulli_gate`` and
``GatedMerge.dispose``, checked against NumPy references. Cache-level tests drive
:class:`~kvcompress.CompressedKVCache` through random-weight mlx-lm Llamas (batch, GQA) and the
trained stories260K model (skipped when absent).
"""

from __future__ import annotations

import math

import attrs
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcompress import Eviction, LayerInfo
from kvcompress_cam.merge import GatedMerge, MergeState, bernoulli_gate, gate_probability, gate_uniforms

HYP = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------


def rnd(shape, seed, dtype=mx.float32, scale=1.0):
    return mx.array((np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)).astype(dtype)


def arange_pos(b, h, t):
    return mx.broadcast_to(mx.arange(t, dtype=mx.int32), (b, h, t))


def distinct_evict(b, h, t, e, seed, low=0):
    """``[B, H, E]`` distinct slot indices in ``[low, T)`` per (batch, head)."""
    r = np.random.default_rng(seed).random((b, h, t - low))
    return mx.array(np.argsort(r, axis=-1)[..., :e] + low, dtype=mx.int32)


def make_ev(keys, values, scores, evict, positions=None, n_sink=0, layer=0, draw_id=0, offset=None, real=None):
    """An :class:`Eviction` as the cache builds it: ``offset`` (tokens seen, default T) per row,
    the sinks protected, a fresh merge counter as the disposition's state."""
    b, h, t, _ = keys.shape
    pos = arange_pos(b, h, t) if positions is None else positions
    offs = tuple(offset) if isinstance(offset, (list, tuple)) else (int(t if offset is None else offset),) * b
    return Eviction(
        keys=keys, values=values, scores=scores, positions=pos, evict=evict, protected=pos < n_sink,
        offset=mx.array(offs, dtype=mx.int32).reshape(b, 1, 1), offsets=offs, layer=LayerInfo(layer=layer),
        counts=(evict.shape[-1],) * b, draw_id=draw_id, real=real, state=MergeState(),
    )


def dispose(disp, ev):
    """``(keys, values, scores, merges)``: ``disp.dispose`` on a fresh copy of ``ev`` (so a
    merge counter starts at 0); ``merges`` is the total the disposition's state counted, or
    None when it counted nothing (no merge was attempted)."""
    ev = attrs.evolve(ev, state=MergeState())
    out = disp.dispose(ev)
    assert isinstance(out, tuple) and len(out) == 3
    m = ev.state.merges if isinstance(ev.state, MergeState) else None
    return (*out, None if m is None else int(m.sum()))


def loser_positions(ev):
    return mx.take_along_axis(ev.positions, ev.evict, axis=-1)


def draws_of(ev, p, seed):
    """``Bernoulli(p)`` as CaM draws it for ``ev``'s losers: keyed by (seed, layer, KV head,
    tokens seen, loser position)."""
    h = ev.keys.shape[1]
    return bernoulli_gate(p, seed, ev.layer.layer, ev.layer.head_ids(h), ev.offset, loser_positions(ev))


def np_(x):
    return np.array(x.astype(mx.float32)) if x.dtype in (mx.float16, mx.bfloat16) else np.array(x)


def effective_weight(before, after, loser, target_slot):
    """``w`` such that ``after[t] = before[t] + w (loser - before[t])``, and the residual."""
    d = loser - before[target_slot]
    delta = after[target_slot] - before[target_slot]
    w = float(delta @ d / (d @ d))
    return w, float(np.linalg.norm(delta - w * d) / np.linalg.norm(d))


def np_nearest(keys, pos, evict, n_sink):
    """NumPy reference of the merge target: argmax cosine over non-sink, non-evicted slots."""
    k = keys / np.linalg.norm(keys, axis=-1, keepdims=True)
    b, h, e = evict.shape
    target = np.full((b, h, e), -1)
    best = np.full((b, h, e), -np.inf)
    for bi in range(b):
        for hi in range(h):
            bad = (pos[bi, hi] < n_sink) | np.isin(np.arange(keys.shape[2]), evict[bi, hi])
            for ei in range(e):
                cos = k[bi, hi] @ k[bi, hi, evict[bi, hi, ei]]
                cos[bad] = -np.inf
                if np.isfinite(cos).any():
                    target[bi, hi, ei] = int(np.argmax(cos))
                    best[bi, hi, ei] = cos.max()
    return target, best


# ------------------------------------------------------------------------------------------
# Merge target
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_nearest_target_is_the_closest_non_sink_survivor(seed):
    b, h, t, d, e, n_sink = 2, 3, 14, 8, 3, 2
    keys = rnd((b, h, t, d), seed, scale=2.0)
    pos = mx.array(np.random.default_rng(seed).permuted(np.tile(np.arange(t), (b, h, 1)), axis=-1), dtype=mx.int32)
    evict = distinct_evict(b, h, t, e, seed + 10)
    target, cos, has = GatedMerge(n_sink=n_sink).nearest_target(keys, pos, evict)
    ref_t, ref_cos = np_nearest(np.array(keys), np.array(pos), np.array(evict), n_sink)
    assert has.all().item()
    np.testing.assert_array_equal(np.array(target), ref_t)
    np.testing.assert_allclose(np.array(cos), ref_cos, atol=1e-5)
    assert target.dtype == mx.int32 and cos.dtype == mx.float32


def test_sinks_and_evicted_slots_are_never_targets():
    loser = np.array([1.0, 0.2, 0.0, 0.0])
    # slot 0: sink identical to the loser; slot 2: another evicted copy; slot 3: cos ~0.7.
    keys = np.stack([loser, [0, 0, 1.0, 0], 3 * loser, [1.0, 1.0, 0, 0], [0, 0, 0, 1.0], loser])
    keys = mx.array(keys[None, None].astype(np.float32))
    evict = mx.array([[[5, 2]]], dtype=mx.int32)
    target, cos, has = GatedMerge(n_sink=1).nearest_target(keys, arange_pos(1, 1, 6), evict)
    assert np.array(target).tolist() == [[[3, 3]]] and has.all().item()
    np.testing.assert_allclose(np.array(cos)[0, 0], [1.2 / math.sqrt(1.04 * 2)] * 2, rtol=1e-5)


@pytest.mark.parametrize("merge", ["sim_weighted", "mean"])
@pytest.mark.parametrize("target", ["nearest", "window"])
def test_no_target_when_only_sinks_remain(merge, target):
    n_sink = 4
    keys, values = rnd((2, 2, n_sink + 1, 8), 0), rnd((2, 2, n_sink + 1, 8), 1)
    scores = mx.ones((2, 2, n_sink + 1))
    evict = mx.full((2, 2, 1), n_sink, dtype=mx.int32)
    gm = GatedMerge(merge=merge, target=target, merge_gate=False, merge_keys=True, n_sink=n_sink)
    if target == "nearest":
        _, _, has = gm.nearest_target(keys, arange_pos(2, 2, n_sink + 1), evict)
        assert not has.any().item()
    else:
        _, valid = gm.window_targets(arange_pos(2, 2, n_sink + 1), evict)
        assert not valid.any().item()
    k, v, s, n = dispose(gm, make_ev(keys, values, scores, evict, n_sink=n_sink))
    assert n== 0  # the loser is simply dropped
    for a, b in [(k, keys), (v, values), (s, scores)]:
        assert mx.array_equal(a, b).item()


# ------------------------------------------------------------------------------------------
# Merge gate
# ------------------------------------------------------------------------------------------


@HYP
@given(
    st.lists(
        st.tuples(st.floats(0, 1e4, width=32), st.floats(0, 1e4, width=32)), min_size=1, max_size=64
    )
)
def test_gate_probability_is_the_clamped_ratio(pairs):
    s_l, s_t = (np.array(x, np.float32) for x in zip(*pairs))
    p = np.array(gate_probability(mx.array(s_l), mx.array(s_t)))
    assert ((p >= 0) & (p <= 1)).all()
    pos = s_t > 0
    with np.errstate(over="ignore"):
        ref = np.clip(s_l[pos] / s_t[pos], 0, 1)
    np.testing.assert_allclose(p[pos], ref, rtol=1e-6)
    assert (p[s_l >= s_t] == 1).all()  # clamped at 1 (includes a zero-score target)


def test_gate_probability_edge_cases():
    s_l = mx.array([0.0, -1.0, 5.0, 1.0, 0.0, 2.0])
    s_t = mx.array([1.0, 1.0, 1.0, 0.0, 0.0, -1.0])
    assert np.array(gate_probability(s_l, s_t)).tolist() == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]


def _keys(b=1, h=8, e=64, offset=300, head_offset=0, pos0=0):
    """Draw indices: global KV heads, tokens seen per row, loser positions ``[b, h, e]``."""
    heads = LayerInfo(head_offset=head_offset).head_ids(h)
    off = mx.array(offset if isinstance(offset, list) else [offset] * b, dtype=mx.int32).reshape(b, 1, 1)
    pos = mx.broadcast_to(mx.arange(pos0, pos0 + e, dtype=mx.int32).reshape(1, 1, e), (b, h, e))
    return heads, off, pos


def test_gate_draws_are_reproducible_and_keyed_by_every_index():
    """Same (seed, layer, heads, offset, positions) -> same draws, whatever mx.random's state;
    changing any one index gives independent-looking draws."""
    p = mx.full((1, 8, 64), 0.5)
    heads, off, pos = _keys()
    base = bernoulli_gate(p, 0, 1, heads, off, pos)
    mx.random.seed(12345)  # the global generator plays no part
    assert mx.array_equal(base, bernoulli_gate(p, 0, 1, heads, off, pos)).item()
    mx.random.seed(999)
    mx.random.uniform(shape=(100,))
    assert mx.array_equal(base, bernoulli_gate(p, 0, 1, heads, off, pos)).item()
    others = [
        bernoulli_gate(p, 1, 1, heads, off, pos),  # seed
        bernoulli_gate(p, 0, 2, heads, off, pos),  # layer
        bernoulli_gate(p, 0, 1, _keys(head_offset=8)[0], off, pos),  # other global KV heads
        bernoulli_gate(p, 0, 1, heads, off + 1, pos),  # one more token seen
        bernoulli_gate(p, 0, 1, heads, off, pos + 64),  # other loser positions
    ]
    for o in others:
        assert 0.3 < np.mean(np.array(o) != np.array(base)) < 0.7  # independent-looking draws
    u = np.array(gate_uniforms(0, 1, heads, off, pos))
    assert u.dtype == np.float32 and 0.0 <= u.min() and u.max() < 1.0


@pytest.mark.parametrize("p", [0.0, 0.05, 0.3, 0.9, 1.0])
def test_bernoulli_gate_frequency_matches_p(p):
    n = 40_000
    heads, off, pos = _keys(h=8, e=n // 8)
    freq = np.array(bernoulli_gate(mx.full((1, 8, n // 8), p), 3, 0, heads, off, pos)).mean()
    assert abs(freq - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-12


def test_gate_draws_are_batch_independent():
    """A row's draws equal its solo draws, whatever its position in the batch and whatever the
    other rows are; a cache holding some of the KV heads (tensor parallelism) draws what those
    heads draw in the whole layer."""
    offsets, starts = [300, 41, 1200], [7, 0, 90]
    solo = [gate_uniforms(5, 2, *_keys(b=1, e=12, offset=o, pos0=s)) for o, s in zip(offsets, starts)]
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        heads = _keys()[0]
        off = mx.array([offsets[i] for i in order], dtype=mx.int32).reshape(3, 1, 1)
        pos = mx.concatenate([_keys(b=1, e=12, pos0=starts[i])[2] for i in order])
        batch = gate_uniforms(5, 2, heads, off, pos)
        for row, i in enumerate(order):
            assert mx.array_equal(batch[row : row + 1], solo[i]).item()
    assert not mx.array_equal(solo[0], solo[1]).item()
    heads_hi, off, pos = _keys(h=4, e=12, offset=300, head_offset=4, pos0=7)
    assert mx.array_equal(gate_uniforms(5, 2, heads_hi, off, pos), solo[0][:, 4:]).item()
    u = np.array(gate_uniforms(0, 0, *_keys(b=64, h=32, e=16, offset=list(range(64))))).ravel()
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean() - 0.5) < 0.01


@pytest.mark.parametrize("target", ["nearest", "window"])
@pytest.mark.parametrize("e", [1, 3])
def test_dispose_of_a_batch_row_equals_its_solo_dispose(target, e):
    """Gated merges of a batch: each row merges exactly as it does alone (its own offset, its
    own losers), wherever it sits in the batch."""
    b, h, t = 3, 4, 20
    keys, values = rnd((b, h, t, 8), 0), rnd((b, h, t, 8), 1)
    scores = mx.abs(rnd((b, h, t), 2)) + 0.05
    pos = mx.array(np.random.default_rng(3).permuted(np.tile(np.arange(t), (b, h, 1)), axis=-1), dtype=mx.int32)
    evict = mx.array(np.stack([[np.random.default_rng(10 * r + hh).choice(np.flatnonzero(np.array(pos)[r, hh] >= 2), e,
                                                                     replace=False) for hh in range(h)]
                               for r in range(b)]), dtype=mx.int32)
    offsets = [37, 250, 21]
    gm = GatedMerge(target=target, merge_window=3, n_sink=2, seed=9)
    whole = dispose(gm, make_ev(keys, values, scores, evict, pos, n_sink=2, layer=1, offset=offsets))
    for order in ([0, 1, 2], [2, 1, 0]):
        idx = mx.array(order)
        perm = dispose(gm, make_ev(keys[idx], values[idx], scores[idx], evict[idx], pos[idx], n_sink=2, layer=1,
                                   offset=[offsets[i] for i in order]))
        for row, r in enumerate(order):
            ev1 = make_ev(keys[r : r + 1], values[r : r + 1], scores[r : r + 1], evict[r : r + 1], pos[r : r + 1],
                          n_sink=2, layer=1, offset=[offsets[r]])
            alone = dispose(gm, ev1)
            for a, x, y in zip(alone[:3], whole[:3], perm[:3]):
                np.testing.assert_allclose(np.array(a)[0], np.array(x)[r], rtol=1e-6, atol=1e-6)
                np.testing.assert_allclose(np.array(a)[0], np.array(y)[row], rtol=1e-6, atol=1e-6)
    assert whole[3] is not None and 0 < whole[3] < b * h * e  # the gate let some through, not all


def _gate_case(h, s_l, s_t, merge="mean", **kw):
    """h heads, each: [sink, target, loser] with loser/target scores s_l/s_t; loser evicted."""
    keys = rnd((1, h, 3, 8), 0)
    values = rnd((1, h, 3, 8), 1)
    scores = mx.broadcast_to(mx.array([1.0, s_t, s_l]), (1, h, 3))
    evict = mx.full((1, h, 1), 2, dtype=mx.int32)
    gm = GatedMerge(merge=merge, n_sink=1, **kw)
    return gm, make_ev(keys, values, scores, evict, n_sink=1)


def _merged(ev, out_scores):
    """Per-head merged flags: the target (slot 1) received the loser's mass."""
    return np.array(out_scores)[0, :, 1] != np.array(ev.scores)[0, :, 1]


def test_low_relative_score_loser_is_usually_dropped():
    """p = 0.05: the gate blocks the large majority of merges, yet it is not a hard block."""
    h = 2000
    gm, ev = _gate_case(h, s_l=0.05, s_t=1.0)
    _, _, s, n = dispose(gm, ev)
    merged = _merged(ev, s)
    assert merged.sum() == n
    assert 0 < merged.mean() < 0.1
    gm_hi, ev_hi = _gate_case(h, s_l=1.0, s_t=1.0)  # comparable mass: p = 1
    assert dispose(gm_hi, ev_hi)[3] == h


@pytest.mark.parametrize("offset", [3, 100])
@pytest.mark.parametrize("layer", [0, 3])
def test_gate_is_eq14_against_the_target_score(layer, offset):
    h = 500
    gm, ev = _gate_case(h, s_l=0.8, s_t=2.0, seed=11)  # p = 0.8 / 2.0 (the sink scores 1.0)
    ev = attrs.evolve(ev, layer=LayerInfo(layer=layer), offset=mx.full((1, 1, 1), offset, mx.int32),
                      offsets=(offset,), draw_id=7)  # the round counter plays no part in the draws
    _, _, s, n = dispose(gm, ev)
    want = np.array(draws_of(ev, mx.full((1, h, 1), 0.4), 11))[0, :, 0]
    np.testing.assert_array_equal(_merged(ev, s), want)
    assert n == want.sum() and 0.3 < want.mean() < 0.5


def test_disabling_the_gate_merges_every_loser_unconditionally():
    h = 300
    gm_off, ev = _gate_case(h, s_l=0.0, s_t=1.0, merge_gate=False)  # p = 0: gate would block all
    k, v, s, n = dispose(gm_off, ev)
    assert n == h
    vals = np.array(ev.values)
    np.testing.assert_allclose(np.array(v)[0, :, 1], (vals[0, :, 1] + vals[0, :, 2]) / 2, rtol=1e-6, atol=1e-6)
    assert dispose(GatedMerge(merge="mean", n_sink=1), ev)[3] == 0
    # Where the gate always opens (p = 1), gate on == gate off, bit for bit.
    gm_on, ev1 = _gate_case(h, s_l=2.0, s_t=1.0)
    on = dispose(gm_on, ev1)
    off = dispose(GatedMerge(merge="mean", n_sink=1, merge_gate=False), ev1)
    for a, b in zip(on, off):
        assert mx.array_equal(a, b).item()
