"""Expected Attention scorer: a NumPy reference built from explicit RoPE and covariance matrices,
the query window and re-scoring policy across prefill and decode, the averaged rotation, binding."""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np
import pytest

import kvcompress
from kvcompress import Observation
from kvcompress._contracts.synthetic import LAYER, normal, offsets, shuffled_positions
from kvcompress_expected_attention import ExpectedAttentionScorer, QueryWindow, averaged_rotation
from kvcompress_streaming_llm import RopeParams

from conftest import tiny_llama

D, H_KV, BASE = 16, 2, 10000.0


# --------------------------------------------------------------------------------------------
# NumPy reference
# --------------------------------------------------------------------------------------------


def rope_matrix(p: int, d: int, traditional: bool, base: float = BASE, dims: int | None = None) -> np.ndarray:
    """The explicit ``[d, d]`` rotation ``R_p`` a RoPE applies to a column vector at position p."""
    dims = d if dims is None else dims
    half = dims // 2
    r = np.eye(d)
    for i in range(half):
        theta = p * base ** (-2.0 * i / dims)
        a, b = (2 * i, 2 * i + 1) if traditional else (i, i + half)
        c, s = np.cos(theta), np.sin(theta)
        r[a, a], r[a, b], r[b, a], r[b, b] = c, -s, s, c
    return r


def reference(q, qpos, keys, values, positions, offs, scale, *, n_sink, n_future, cov, vnorm, traditional, eps=0.0):
    """Expected attention per (row, KV head, slot), float64, with D x D matrices per key."""
    b_, hq, w, d = q.shape
    h, t = keys.shape[1], keys.shape[2]
    g = hq // h
    out = np.zeros((b_, h, t))
    for b in range(b_):
        rbar = np.mean([rope_matrix(p, d, traditional) for p in range(offs[b], offs[b] + n_future)], axis=0)
        idx = [i for i in range(w) if qpos[b, 0, i] >= n_sink]
        for kh in range(h):
            probs = []
            held = positions[b, kh] >= 0
            for qh in range(kh * g, (kh + 1) * g):
                pre = np.stack([rope_matrix(qpos[b, 0, i], d, traditional).T @ q[b, qh, i] for i in idx]) \
                    if idx else np.zeros((0, d))
                mu = pre.mean(axis=0) if idx else np.zeros(d)
                sigma = (pre - mu).T @ (pre - mu) / max(len(idx), 1)
                mu_f, sigma_f = rbar @ mu, rbar @ sigma @ rbar.T
                z = np.array([scale * mu_f @ k + (scale**2 / 2 * k @ sigma_f @ k if cov else 0.0) for k in keys[b, kh]])
                z = np.where(held, z, -np.inf)
                e = np.exp(z - z[held].max())
                probs.append(e / e.sum())
            p = np.mean(probs, axis=0)
            if vnorm:
                p = (p + eps) * np.linalg.norm(values[b, kh], axis=-1)
            out[b, kh] = np.where(held, p, 0.0)
    return out


def _np(x):
    return np.array(x.astype(mx.float32), dtype=np.float64)


def _obs(rng, batch, gqa, dtype, n_new, t_old, *, valid=None, state=None, held=None):
    """One step of ``n_new`` queries after ``t_old`` stored slots; row 1 holds 3 empty slots."""
    hq = H_KV * gqa
    held = held or [t_old - 3 * (b % 2) for b in range(batch)]
    valid = valid or [n_new] * batch
    pos_old = np.stack([shuffled_positions(rng, t_old, held + [t_old] * (2 - batch))[b] for b in range(batch)])
    ar = np.arange(n_new)
    pos_new = np.stack([np.broadcast_to(np.where(ar < valid[b], held[b] + ar, -1), (H_KV, n_new)) for b in range(batch)])
    positions = mx.array(np.concatenate([pos_old, pos_new], axis=-1).astype(np.int32))
    seen = [h + v for h, v in zip(held, valid)]
    qpos = offsets(held) + mx.arange(n_new, dtype=mx.int32).reshape(1, 1, n_new)
    weight = None if all(v == n_new for v in valid) else (
        mx.arange(n_new).reshape(1, 1, n_new) < offsets(valid)).astype(mx.float32)
    obs = Observation(
        queries=normal(rng, (batch, hq, n_new, D), dtype), keys=normal(rng, (batch, H_KV, t_old + n_new, D), dtype),
        values=normal(rng, (batch, H_KV, t_old + n_new, D), dtype), positions=positions, query_positions=qpos,
        n_new=n_new, scale=D**-0.5, offset=offsets(seen), offsets=tuple(seen), layer=LAYER, n_valid=tuple(valid),
        query_weight=weight, state=state,
    )
    return mx.zeros(positions.shape, mx.float32), obs


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("gqa", [1, 2, 4])
@pytest.mark.parametrize("cov,vnorm", [(True, True), (False, True), (True, False), (False, False)])
def test_scores_match_numpy_reference(dtype, batch, gqa, cov, vnorm):
    """A prefill chunk of 6 queries (window 8: two empty window entries; n_sink 3 drops the
    query at position 2 of row 1, whose history is shorter) against explicit matrices."""
    rng = np.random.default_rng(7 + gqa + 3 * batch)
    scorer = ExpectedAttentionScorer(n_future_positions=5, query_window=8, use_covariance=cov,
                                     use_vnorm=vnorm, epsilon=0.01 if vnorm else 0.0, n_sink=3)
    scores, obs = _obs(rng, batch, gqa, dtype, n_new=6, t_old=5, state=scorer.init_state(LAYER))
    out = scorer.observe(scores, obs)
    assert out.dtype == mx.float32 and out.shape == scores.shape
    st = obs.state
    want = reference(
        _np(st.queries), np.array(st.positions), _np(obs.keys), _np(obs.values), np.array(obs.positions),
        obs.offsets, obs.scale, n_sink=3, n_future=5, cov=cov, vnorm=vnorm, traditional=False,
        eps=scorer.epsilon,
    )
    got = np.array(out)
    assert np.allclose(got, want, rtol=2e-3, atol=1e-6), np.abs(got - want).max()
    assert (got[np.array(obs.positions) < 0] == 0).all()
    if not vnorm:  # a softmax per query head, averaged: each (row, head) sums to 1 over held slots
        assert np.allclose(got.sum(-1), 1.0, atol=1e-5)


@pytest.mark.parametrize("traditional", [False, True])
def test_bound_rope_is_used(traditional):
    """A traditional (interleaved) RoPE read by ``bind`` changes the statistics' rotation."""
    rng = np.random.default_rng(3)
    scorer = ExpectedAttentionScorer(n_future_positions=4, query_window=8, n_sink=0)
    rope = RopeParams(D, traditional, BASE, 1.0)
    scores, obs = _obs(rng, 2, 2, mx.float32, n_new=5, t_old=6, state=QueryWindow(rope=rope))
    got = np.array(scorer.observe(scores, obs))
    st = obs.state
    want = reference(_np(st.queries), np.array(st.positions), _np(obs.keys), _np(obs.values),
                     np.array(obs.positions), obs.offsets, obs.scale, n_sink=0, n_future=4, cov=True,
                     vnorm=True, traditional=traditional)
    assert np.allclose(got, want, rtol=2e-3, atol=1e-6)


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [D, D // 2])
def test_averaged_rotation_is_mean_rope_matrix(traditional, dims):
    """``A^T`` built by rotating the identity equals ``mean_t R_t^T`` (partial RoPE included)."""
    n = 7
    got = np.array(averaged_rotation(RopeParams(dims, traditional, BASE, 1.0), D, n))
    want = np.mean([rope_matrix(t, D, traditional, dims=dims) for t in range(n)], axis=0).T
    assert np.allclose(got, want, atol=1e-5)
    # and the shift property the scorer relies on: R_o A = mean over o .. o + n - 1
    o = 11
    shifted = rope_matrix(o, D, traditional, dims=dims) @ want.T
    direct = np.mean([rope_matrix(t, D, traditional, dims=dims) for t in range(o, o + n)], axis=0)
    assert np.allclose(shifted, direct, atol=1e-6)
    assert np.allclose(np.array(averaged_rotation(None, D, n)), np.eye(D))


# --------------------------------------------------------------------------------------------
# Window and re-scoring policy
# --------------------------------------------------------------------------------------------


def _step(scorer, state, rng, t_old, n_new, valid=None, batch=2):
    scores, obs = _obs(rng, batch, 2, mx.float32, n_new=n_new, t_old=t_old, state=state, valid=valid,
                       held=[t_old] * batch)
    scores = mx.array(rng.random(scores.shape).astype(np.float32))
    out = scorer.observe(scores, obs)
    return scores, out, obs


def test_window_and_rescoring_across_prefill_and_decode():
    rng = np.random.default_rng(0)
    w, interval = 4, 3
    scorer = ExpectedAttentionScorer(query_window=w, interval=interval, n_sink=0, n_future_positions=2)
    state = scorer.init_state(LAYER)
    # prefill chunk of 6: re-scored; the window holds the chunk's last 4 queries in order
    scores, out, obs = _step(scorer, state, rng, 0, 6)
    assert not np.allclose(np.array(out), np.array(scores))
    assert np.array(obs.state.positions).tolist() == [[[2, 3, 4, 5]]] * 2
    assert np.array_equal(np.array(obs.state.queries), np.array(obs.queries[:, :, 2:]))
    state = obs.state
    seen = 6
    for _ in range(7):  # decode: re-scored only at offsets that are multiples of interval
        scores, out, obs = _step(scorer, state, rng, seen, 1)
        seen += 1
        rescored = not np.array_equal(np.array(out), np.array(scores))
        assert rescored == (seen % interval == 0), seen
        assert np.array(obs.state.positions)[0, 0].tolist() == list(range(seen - w, seen))
        assert np.array_equal(np.array(obs.state.queries[:, :, -1:]), np.array(obs.queries))
        assert np.array_equal(np.array(obs.state.queries[:, :, :-1]), np.array(state.queries[:, :, 1:]))
        state = obs.state
    # interval 0: decode never re-scores, prefill chunks always do
    still = ExpectedAttentionScorer(query_window=w, interval=0)
    scores, out, obs = _step(still, still.init_state(LAYER), rng, 0, 5)
    assert not np.array_equal(np.array(out), np.array(scores))
    for k in range(interval * 2):
        scores, out, obs = _step(still, obs.state, rng, 5 + k, 1)
        assert np.array_equal(np.array(out), np.array(scores))


def test_window_with_right_padded_rows_keeps_each_rows_real_queries():
    """Row 1 has 2 real tokens in a 5-token chunk: its window keeps only those (and the earlier
    ones), padding never enters, and it re-scores like a decode step only when it has 1."""
    rng = np.random.default_rng(1)
    scorer = ExpectedAttentionScorer(query_window=4, interval=0, n_sink=0)
    _, _, obs = _step(scorer, scorer.init_state(LAYER), rng, 0, 3)
    scores, out, obs2 = _step(scorer, obs.state, rng, 3, 5, valid=[5, 2])
    pos = np.array(obs2.state.positions)[:, 0]
    assert pos[0].tolist() == [4, 5, 6, 7]
    assert pos[1].tolist() == [1, 2, 3, 4]
    q = np.array(obs2.state.queries)
    assert np.array_equal(q[1, :, 2:], np.array(obs2.queries)[1, :, :2])
    assert np.array_equal(q[1, :, :2], np.array(obs.state.queries)[1, :, -2:])
    scores, out, obs3 = _step(scorer, obs2.state, rng, 8, 5, valid=[5, 1])
    assert np.array_equal(np.array(out)[1], np.array(scores)[1])  # a decode step for row 1: kept
    assert not np.array_equal(np.array(out)[0], np.array(scores)[0]) and np.array(obs3.state.positions)[1, 0].tolist() == [2, 3, 4, 8]


# --------------------------------------------------------------------------------------------
# In a cache built for a model
# --------------------------------------------------------------------------------------------


def test_bind_reads_each_layers_rope_and_cache_scores_match_reference():
    model = tiny_llama(n_layers=2, hidden=64, heads=4, kv_heads=2, seed=2)
    cache = kvcompress.make_prompt_cache(model, "expected_attention", budget=24, recent=4, n_sink=2,
                                         query_window=8, n_future_positions=6)
    rope = model.layers[0].self_attn.rope
    for c in cache:
        st = c.component_state("scorer")
        assert isinstance(st, QueryWindow) and st.rope is not None and st.rotary
        assert st.rope.base == pytest.approx(float(rope.base)) and st.rope.traditional == bool(rope.traditional)
    prompt = mx.array(np.random.default_rng(0).integers(0, 97, 40))
    model(prompt[None], cache=cache)
    for c in cache:
        st = c.component_state("scorer")
        k, v = c.keys_and_values()
        d = k.shape[-1]
        want = reference(_np(st.queries), np.array(st.positions), _np(k), _np(v), np.array(c.slot_positions), [40],
                         d**-0.5, n_sink=2, n_future=6, cov=True, vnorm=True, traditional=bool(rope.traditional))
        assert np.allclose(np.array(c.slot_scores), want, rtol=2e-3, atol=1e-6)
    assert np.array(cache[0].component_state("scorer").positions)[0, 0].tolist() == list(range(32, 40))


def test_mla_layers_are_scored_unrotated_without_value_norm():
    """DeepSeek-V3's cache sees q_nope and latent keys and stores the RoPE keys as "values"."""
    from mlx_lm.models import deepseek_v3

    mx.random.seed(0)
    a = deepseek_v3.ModelArgs(vocab_size=72, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                              q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                              n_routed_experts=None, first_k_dense_replace=2)
    model = deepseek_v3.Model(a)
    cache = kvcompress.make_prompt_cache(model, "expected_attention", budget=24, recent=4, n_sink=2)
    for c in cache:
        st = c.component_state("scorer")
        assert st.latent and not st.rotary and st.rope is None
    model(mx.array([list(range(30))]), cache=cache)
    model(mx.array([[3]]), cache=cache)
    for c in cache:
        s = np.array(c.slot_scores)
        assert np.isfinite(s).all() and (s >= 0).all()


def test_bad_parameters_name_the_problem():
    with pytest.raises((ValueError, TypeError), match="query_window"):
        ExpectedAttentionScorer(query_window=0)
    with pytest.raises((ValueError, TypeError), match="n_future_positions"):
        ExpectedAttentionScorer(n_future_positions=0)
    assert attrs.fields_dict(ExpectedAttentionScorer)["interval"].default == 16


@pytest.mark.parametrize("gqa", [1, 2])
def test_head_groups_score_each_slot_with_its_own_heads_queries(gqa):
    """Two KV heads stored in one row (AdaKV's head groups, slots tagged by ``owner``) score
    exactly as the two heads scored apart: each slot by its own KV head's query heads."""
    rng = np.random.default_rng(gqa)
    b, t, w, d = 1, 6, 4, 8
    scorer = ExpectedAttentionScorer(n_future_positions=3, query_window=w, n_sink=0)
    rot = averaged_rotation(None, d, 3)
    q = mx.array(rng.standard_normal((b, 2 * gqa, w, d)).astype(np.float32))
    qpos = mx.arange(t, t + w, dtype=mx.int32).reshape(1, 1, w)
    k = rng.standard_normal((b, 2, t, d)).astype(np.float32)
    v = rng.standard_normal((b, 2, t, d)).astype(np.float32)
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, 2, t)).copy()
    pos[0, 1, 2] = -1  # head 1 holds one token fewer
    off = mx.full((b, 1, 1), t + w, mx.int32)
    apart = np.array(scorer.expected_scores(q, qpos, mx.array(k), mx.array(v), mx.array(pos), off, d**-0.5,
                                            None, rot))
    order = rng.permutation(2 * t)  # the row's slots: both heads' tokens, shuffled
    owner = np.repeat([0, 1], t)[order].reshape(1, 1, -1).astype(np.int32)
    rk, rv = k.reshape(b, 1, 2 * t, d)[:, :, order], v.reshape(b, 1, 2 * t, d)[:, :, order]
    rpos = pos.reshape(b, 1, 2 * t)[:, :, order]
    owner = np.where(rpos >= 0, owner, -1)
    grouped = np.array(scorer.expected_scores(q, qpos, mx.array(rk), mx.array(rv), mx.array(rpos), off, d**-0.5,
                                              None, rot, mx.array(owner), 2))
    np.testing.assert_allclose(grouped, apart.reshape(b, 1, 2 * t)[:, :, order], rtol=1e-5, atol=1e-7)
