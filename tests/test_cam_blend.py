"""CaM's blend (sim-weighted, mean, keys, mass transfer, several losers per target), the paper's
window rule and ``drop`` == H2O, at the primitive level (NumPy references)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvcompress
from kvcompress_basic import Drop
from kvcompress_cam.merge import GatedMerge

from test_cam import HYP, arange_pos, dispose, distinct_evict, draws_of, effective_weight, make_ev, np_, rnd


# ------------------------------------------------------------------------------------------
# Blend
# ------------------------------------------------------------------------------------------


def _pair(angles, d=8, loser_norm=3.0, seed=0):
    """One head per angle: slot 0 sink, slot 1 target key e0, slot 2 loser key at ``angle``."""
    h = len(angles)
    keys = np.zeros((1, h, 3, d), np.float32)
    keys[0, :, 0, 3] = 1.0
    keys[0, :, 1, 0] = 1.0
    keys[0, :, 2, 0] = loser_norm * np.cos(angles)
    keys[0, :, 2, 1] = loser_norm * np.sin(angles)
    values = rnd((1, h, 3, d), seed)
    # at offset 3 the target (position 1) and the loser (position 2) drew the same attention per
    # query since they arrived: equal prominence, so only the key similarity weighs the blend
    scores = mx.broadcast_to(mx.array([1.0, 2.0, 1.0]), (1, h, 3))
    evict = mx.full((1, h, 1), 2, dtype=mx.int32)
    return make_ev(mx.array(keys), values, scores, evict, n_sink=1, offset=3)


@pytest.mark.parametrize("gate", [True, False])
def test_drop_returns_everything_unchanged(gate):
    ev = make_ev(rnd((2, 3, 10, 8), 0), rnd((2, 3, 10, 8), 1), mx.abs(rnd((2, 3, 10), 2)), distinct_evict(2, 3, 10, 2, 3, low=1), n_sink=1)
    k, v, s, n = dispose(GatedMerge(merge="drop", merge_gate=gate, n_sink=1), ev)
    assert k is ev.keys and v is ev.values and s is ev.scores and n is None  # no merge counted


def test_mean_averages_values():
    ev = _pair(np.linspace(0, np.pi, 7))
    k, v, s, n = dispose(GatedMerge(merge="mean", merge_gate=False, n_sink=1), ev)
    vals = np.array(ev.values)
    np.testing.assert_allclose(np.array(v)[0, :, 1], (vals[0, :, 1] + vals[0, :, 2]) / 2, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.array(v)[0, :, [0, 2]], vals[0, :, [0, 2]])
    assert mx.array_equal(k, ev.keys).item() and n == 7


def test_sim_weighted_absorbs_a_similar_loser_strongly_and_a_dissimilar_one_barely():
    """x_t <- (1 - w) x_t + w x_l with w growing with cos(k_l, k_t): a duplicate key is averaged
    in (w = 1/2); an orthogonal or opposite one barely perturbs; w never exceeds 1/2."""
    angles = np.linspace(0, np.pi, 25)
    ev = _pair(angles)
    _, v, _, _ = dispose(GatedMerge(merge="sim_weighted", merge_gate=False, n_sink=1), ev)
    before, after = np.array(ev.values)[0], np.array(v)[0]
    ws = []
    for hi in range(len(angles)):
        w, resid = effective_weight(before[hi], after[hi], before[hi, 2], 1)
        assert resid < 1e-5  # an affine blend toward the loser, nothing else
        ws.append(w)
    ws = np.array(ws)
    assert ((ws >= -1e-6) & (ws <= 0.5 + 1e-6)).all()
    assert np.all(np.diff(ws) <= 1e-6)  # monotone in similarity
    assert ws[0] > 0.45  # duplicate direction (cos = 1): averaged in
    assert ws[angles >= np.pi / 2].max() < 0.02  # orthogonal / opposite: barely perturbed
    near = np.abs(angles - np.pi / 12).argmin()  # cos ~ 0.97
    far = np.abs(angles - 5 * np.pi / 12).argmin()  # cos ~ 0.26
    assert ws[near] > 2 * ws[far]
    # The weight depends on direction only, not on the loser key's norm.
    _, v2, _, _ = dispose(GatedMerge(merge="sim_weighted", merge_gate=False, n_sink=1), _pair(angles, loser_norm=0.1))
    np.testing.assert_allclose(np.array(v2), np.array(v), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("merge", ["sim_weighted", "mean"])
def test_merge_keys_toggles_key_blending(merge):
    ev = _pair(np.linspace(0, np.pi / 3, 5))
    k_off, v_off, s_off, _ = dispose(GatedMerge(merge=merge, merge_gate=False, n_sink=1), ev)
    k_on, v_on, s_on, _ = dispose(GatedMerge(merge=merge, merge_gate=False, merge_keys=True, n_sink=1), ev)
    k_drop = dispose(Drop(), ev)[0]
    assert mx.array_equal(k_off, k_drop).item() and mx.array_equal(k_off, ev.keys).item()
    assert mx.array_equal(v_on, v_off).item() and mx.array_equal(s_on, s_off).item()
    kb, ka, vb, va = (np.array(x)[0] for x in (ev.keys, k_on, ev.values, v_on))
    for hi in range(5):
        wk, rk = effective_weight(kb[hi], ka[hi], kb[hi, 2], 1)
        wv, _ = effective_weight(vb[hi], va[hi], vb[hi, 2], 1)
        assert rk < 1e-5 and wk == pytest.approx(wv, abs=1e-5) and wk > 0.2
    np.testing.assert_array_equal(ka[:, [0, 2]], kb[:, [0, 2]])


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("target", ["nearest", "window"])
def test_values_only_merge_leaves_keys_identical_to_the_drop_path(dtype, target):
    b, h, t, e = 2, 4, 24, 3
    ev = make_ev(rnd((b, h, t, 8), 0, dtype), rnd((b, h, t, 8), 1, dtype), mx.abs(rnd((b, h, t), 2)),
                 distinct_evict(b, h, t, e, 3, low=2), n_sink=2)
    for gate in (True, False):
        k, v, s, _ = dispose(GatedMerge(merge="sim_weighted", merge_gate=gate, target=target, merge_window=4, n_sink=2), ev)
        assert mx.array_equal(k, dispose(Drop(), ev)[0]).item()
        assert k.dtype == v.dtype == dtype and s.dtype == mx.float32


@pytest.mark.parametrize("merge", ["sim_weighted", "mean"])
@pytest.mark.parametrize("merge_keys", [False, True])
def test_decode_row_update_and_multi_eviction_scatter_agree(merge, merge_keys):
    """One loser (decode's row update) and several losers at once (scatter) blend alike."""
    d = 8
    keys = np.zeros((1, 1, 5, d), np.float32)
    keys[0, 0, 0, 7] = 1  # sink
    keys[0, 0, 1, 0] = 1  # target A
    keys[0, 0, 2, [0, 1]] = [1, 0.3]  # loser A
    keys[0, 0, 3, 4] = 1  # target B (orthogonal to group A)
    keys[0, 0, 4, [4, 5]] = [2, 1.0]  # loser B
    keys = mx.array(keys)
    values, scores = rnd((1, 1, 5, d), 1), mx.array([[[3.0, 1.0, 0.5, 2.0, 0.25]]])
    gm = GatedMerge(merge=merge, merge_gate=False, merge_keys=merge_keys, n_sink=1)
    both = dispose(gm, make_ev(keys, values, scores, mx.array([[[2, 4]]], dtype=mx.int32), n_sink=1))
    for loser, target in [(2, 1), (4, 3)]:
        one = dispose(gm, make_ev(keys, values, scores, mx.array([[[loser]]], dtype=mx.int32), n_sink=1))
        for a, b in zip(both[:3], one[:3]):
            np.testing.assert_allclose(np.array(a)[0, 0, target], np.array(b)[0, 0, target], rtol=1e-6, atol=1e-7)
        assert one[3] == 1
    assert both[3] == 2


def test_mass_moves_to_the_target():
    ev = _pair(np.linspace(0, np.pi / 2, 4))
    ev.scores = mx.broadcast_to(mx.array([5.0, 2.0, 0.75]), (1, 4, 3))
    _, _, s, _ = dispose(GatedMerge(merge="sim_weighted", merge_gate=False, n_sink=1), ev)
    np.testing.assert_allclose(np.array(s)[0, :, 1], 2.75)
    np.testing.assert_array_equal(np.array(s)[0, :, 0], 5.0)


@HYP
@given(
    seed=st.integers(0, 2**16),
    merge=st.sampled_from(["sim_weighted", "mean"]),
    target=st.sampled_from(["nearest", "window"]),
    gate=st.booleans(),
    merge_keys=st.booleans(),
    e=st.integers(1, 4),
    window=st.integers(1, 6),
)
def test_merge_invariants(seed, merge, target, gate, merge_keys, e, window):
    """Only targets change; sinks never do; mass is conserved (moved, never created)."""
    b, h, t, n_sink = 2, 3, 16, 2
    pos = mx.array(np.random.default_rng(seed).permuted(np.tile(np.arange(t), (b, h, 1)), axis=-1), dtype=mx.int32)
    rng = np.random.default_rng(seed)
    # never evict a sink (the selector protects them)
    evict_slots = np.array([[rng.choice(np.flatnonzero(np.array(pos)[bi, hi] >= n_sink), e, replace=False)
                             for hi in range(h)] for bi in range(b)])
    evict = mx.array(evict_slots, dtype=mx.int32)
    ev = make_ev(rnd((b, h, t, 8), seed), rnd((b, h, t, 8), seed + 1), mx.abs(rnd((b, h, t), seed + 2)), evict, pos, n_sink, 0, seed)
    gm = GatedMerge(merge=merge, target=target, merge_gate=gate, merge_keys=merge_keys, merge_window=window, n_sink=n_sink)
    k, v, s, n = dispose(gm, ev)
    if target == "nearest":
        tg = np.array(gm.nearest_target(ev.keys, pos, evict)[0])[..., None]
        ok = np.ones_like(tg, bool)
    else:
        tg, ok = (np.array(x) for x in gm.window_targets(pos, evict))
    evicted = np.zeros((b, h, t), bool)
    np.put_along_axis(evicted, evict_slots, True, -1)
    touched = np.zeros((b, h, t), bool)
    for bi in range(b):
        for hi in range(h):
            touched[bi, hi, tg[bi, hi][ok[bi, hi]]] = True
    assert not (touched & evicted).any() and not (touched & (np.array(pos) < n_sink)).any()
    still = ~touched
    for before, after in [(ev.keys, k), (ev.values, v), (ev.scores, s)]:
        np.testing.assert_array_equal(np.array(after)[still], np.array(before)[still])
    if not merge_keys:
        assert mx.array_equal(k, ev.keys).item()
    s0, s1 = np.array(ev.scores), np.array(s)
    gained = (s1 - s0)[~evicted].sum()
    loser_mass = s0[evicted].sum()
    assert -1e-4 <= gained <= loser_mass + 1e-4
    assert 0 <= n <= b * h * e
    if not gate and target == "nearest":
        # every loser merges, except sim_weighted ones whose blend weight max(cos, 0)/2 is 0
        _, cos, has = gm.nearest_target(ev.keys, pos, evict)
        moving = np.array(has) & ((np.array(cos) > 0) | (merge == "mean"))
        assert n == moving.sum()
        moved_mass = (np.take_along_axis(s0, evict_slots, -1) * moving).sum()
        assert gained == pytest.approx(moved_mass, rel=1e-5, abs=1e-5)
    if n == 0:
        assert gained == 0


# ------------------------------------------------------------------------------------------
# The paper's window rule
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 3, 5, 40])
def test_window_targets_are_the_next_m_kept_tokens(m):
    b, h, t, e, n_sink = 2, 3, 20, 3, 2
    rng = np.random.default_rng(m)
    pos = rng.permuted(np.tile(np.arange(t), (b, h, 1)), axis=-1)
    evict = np.array(distinct_evict(b, h, t, e, m))
    tg, valid = GatedMerge(target="window", merge_window=m, n_sink=n_sink).window_targets(
        mx.array(pos, dtype=mx.int32), mx.array(evict, dtype=mx.int32))
    tg, valid = np.array(tg), np.array(valid)
    assert tg.shape == valid.shape == (b, h, e, min(m, t))
    for bi in range(b):
        for hi in range(h):
            for ei in range(e):
                pl = pos[bi, hi, evict[bi, hi, ei]]
                cand = [j for j in range(t) if pos[bi, hi, j] > pl and pos[bi, hi, j] >= n_sink
                        and j not in evict[bi, hi]]
                want = sorted(cand, key=lambda j: pos[bi, hi, j])[:m]
                assert sorted(tg[bi, hi, ei][valid[bi, hi, ei]]) == sorted(want)


def test_window_rule_adds_v_over_m_and_gates_against_the_window_mean():
    m, h = 3, 400
    t = 8  # slot = position; sink 0; loser 2; window = positions 3, 4, 5
    keys, values = rnd((1, h, t, 8), 0), rnd((1, h, t, 8), 1)
    win_scores = np.array([0.2, 1.0, 2.7], np.float32)  # mean 1.3; the nearest alone would be 0.2
    sc = np.ones((1, h, t), np.float32)
    sc[..., 2] = 0.65
    sc[..., 3:6] = win_scores
    scores = mx.array(sc)
    evict = mx.full((1, h, 1), 2, dtype=mx.int32)
    ev = make_ev(keys, values, scores, evict, n_sink=1, layer=2, draw_id=5)

    # Without the gate: each of the m targets gains v_l / m and mass s_l / m; keys untouched.
    k, v, s, n = dispose(GatedMerge(target="window", merge_window=m, merge_gate=False, n_sink=1), ev)
    vb, va = np.array(values), np.array(v)
    np.testing.assert_allclose(va[0, :, 3:6], vb[0, :, 3:6] + vb[0, :, 2:3] / m, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.delete(va, [3, 4, 5], axis=2), np.delete(vb, [3, 4, 5], axis=2))
    np.testing.assert_allclose(np.array(s)[0, :, 3:6], sc[0, :, 3:6] + 0.65 / m, rtol=1e-6)
    assert mx.array_equal(k, keys).item() and n == h
    k2 = dispose(GatedMerge(target="window", merge_window=m, merge_gate=False, merge_keys=True, n_sink=1), ev)[0]
    np.testing.assert_allclose(np.array(k2)[0, :, 3:6], np.array(keys)[0, :, 3:6] + np.array(keys)[0, :, 2:3] / m, rtol=1e-5, atol=1e-6)

    # With the gate: merge ~ Bernoulli(clamp(s_l / mean(window scores))) = Bernoulli(0.5).
    _, _, s, n = dispose(GatedMerge(target="window", merge_window=m, n_sink=1, seed=4), ev)
    merged = np.array(s)[0, :, 3] != sc[0, :, 3]
    want = draws_of(ev, mx.full((1, h, 1), 0.65 / 1.3), 4)
    np.testing.assert_array_equal(merged, np.array(want)[0, :, 0])
    assert n == merged.sum() and 0.35 < merged.mean() < 0.65


def test_window_with_no_later_token_does_not_merge():
    keys, values = rnd((1, 2, 6, 4), 0), rnd((1, 2, 6, 4), 1)
    ev = make_ev(keys, values, mx.ones((1, 2, 6)), mx.full((1, 2, 1), 5, dtype=mx.int32), n_sink=1)
    k, v, s, n = dispose(GatedMerge(target="window", merge_gate=False, n_sink=1), ev)
    assert n == 0 and mx.array_equal(v, values).item() and mx.array_equal(s, ev.scores).item()


# ------------------------------------------------------------------------------------------
# drop == H2O at the primitive level
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_drop_primitive_equals_h2o_drop(gate, dtype):
    ev = make_ev(rnd((2, 4, 12, 8), 0, dtype), rnd((2, 4, 12, 8), 1, dtype), mx.abs(rnd((2, 4, 12), 2)),
                 distinct_evict(2, 4, 12, 3, 4, low=4), n_sink=4)
    cam = kvcompress.build_method("cam", merge="drop", merge_gate=gate)
    h2o = kvcompress.build_method("h2o")
    cam_out, h2o_out = dispose(cam.disposition, ev), dispose(h2o.disposition, ev)
    for a, b in zip(cam_out[:3], h2o_out[:3]):
        assert a.dtype == b.dtype and mx.array_equal(a, b).item()
    assert cam_out[3] is None and h2o_out[3] is None  # neither counts a merge
    sel = kvcompress.Selection(
        scores=ev.scores, positions=ev.positions, protected=cam.selector.protected(ev.positions, ev.offset, 12),
        n_evict=3, budget=12, offset=ev.offset, offsets=ev.offsets, layer=ev.layer,
    )
    assert mx.array_equal(cam.selector.select(sel), h2o.selector.select(sel)).item()
    assert cam.scorer == h2o.scorer



def test_sim_weighted_blend_weights_by_attention_prominence():
    """w = max(cos, 0) * a_l / (a_l + a_t), a = mass per query since arrival (offset - pos)."""
    k = np.zeros((1, 1, 4, 4), np.float32)
    k[0, 0, 0, 0] = k[0, 0, 2, 0] = k[0, 0, 3, 0] = 1.0  # sink, target and loser share a direction
    k[0, 0, 1, 1] = 1.0  # slot 1 is orthogonal to the loser: never the target
    keys = mx.array(k)
    values = mx.array(np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4))
    pos = mx.array([[[0, 10, 30, 38]]], dtype=mx.int32)
    evict = mx.array([[[3]]], dtype=mx.int32)
    gm = GatedMerge(merge="sim_weighted", merge_gate=False, n_sink=1, transfer_mass=False)
    assert int(np.array(gm.nearest_target(keys, pos, evict)[0])[0, 0, 0]) == 2
    offset, s_t = 40, 5.0  # target age 10, loser age 2
    for s_l in (0.0, 0.1, 1.0, 10.0):
        scores = mx.array([[[9.0, 0.0, s_t, s_l]]])
        ev = make_ev(keys, values, scores, evict, pos, n_sink=1, offset=offset)
        v = np.array(dispose(gm, ev)[1])[0, 0]
        vt, vl = np.array(values)[0, 0, 2], np.array(values)[0, 0, 3]
        w = float((v[2] - vt)[0] / (vl - vt)[0])
        a_l, a_t = s_l / 2, s_t / 10
        assert w == pytest.approx(a_l / (a_l + a_t), abs=1e-5)
    # the more attention the loser drew per query, the more of it the target absorbs


@pytest.mark.parametrize("merge", ["sim_weighted", "mean"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_many_losers_into_one_target_stay_a_convex_combination(merge, seed):
    """A prefill step frees many slots at once and several losers may pick the same target: the
    blend is the weighted average over the target and all its losers together (NumPy
    reference), so the target never moves past its losers (pairwise steps added independently
    would move it by ``sum w``, which exceeds 1 with enough losers)."""
    b, h, t, d, e, n_sink = 2, 2, 24, 8, 16, 2
    rng = np.random.default_rng(seed)
    # few survivors, many losers: clustered keys so several losers share a target
    centres = rng.standard_normal((3, d))
    k = centres[rng.integers(0, 3, (b, h, t))] + 0.3 * rng.standard_normal((b, h, t, d))
    keys = mx.array(k.astype(np.float32))
    values = rnd((b, h, t, d), seed + 10)
    scores = mx.array(rng.uniform(0.5, 3.0, (b, h, t)).astype(np.float32))
    evict = distinct_evict(b, h, t, e, seed, low=n_sink)
    offset = t + 5
    ev = make_ev(keys, values, scores, evict, n_sink=n_sink, offset=offset)
    gm = GatedMerge(merge=merge, merge_gate=False, n_sink=n_sink, transfer_mass=False)
    got = np_(dispose(gm, ev)[1])
    tg, cos, has = (np.array(x) for x in gm.nearest_target(keys, arange_pos(b, h, t), evict))
    v, s, ev_np = np.array(values), np.array(scores), np.array(evict)
    want = v.copy()
    shared = 0
    for bi in range(b):
        for hi in range(h):
            for target in set(tg[bi, hi][has[bi, hi]].tolist()):
                ls = [i for i in range(e) if has[bi, hi, i] and tg[bi, hi, i] == target
                      and (merge == "mean" or cos[bi, hi, i] > 0)]
                if not ls:
                    continue
                shared += len(ls) > 1
                a = lambda slot: s[bi, hi, slot] / (offset - slot)  # noqa: E731 (positions = slots)
                total = a(target) + sum(a(ev_np[bi, hi, i]) for i in ls)
                ws = [1.0 / (1 + len(ls)) if merge == "mean" else cos[bi, hi, i] * a(ev_np[bi, hi, i]) / total
                      for i in ls]
                assert 0 <= sum(ws) < 1
                want[bi, hi, target] = v[bi, hi, target] + sum(
                    w * (v[bi, hi, ev_np[bi, hi, i]] - v[bi, hi, target]) for w, i in zip(ws, ls))
    assert shared > 0  # the case exercises targets with several losers
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
