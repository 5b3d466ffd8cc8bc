"""KVzip and the engine's scoring passes: mass="max", the pass score, what a pass may touch, its
reported cost, the model hook's token ids, and retrieval at 8x (the pass ids' layout and the
reconstruction prompt: test_kvzip_prompt.py)."""

from __future__ import annotations

import copy
from typing import ClassVar

import attrs
import mlx.core as mx
import numpy as np
import pytest

import kvcompress
from kvcompress import ComponentSpec, hookimpl, ops
from kvcompress.engine import passes as _scoring_pass
from kvcompress.batch_cache import BatchCompressedKVCache
from kvcompress.registry import Registry
from kvcompress_kvzip import KVzipScorer, pass_score

from conftest import tiny_llama

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
TOL = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 2e-2}


def _np(x):
    return np.array(x.astype(mx.float32)) if x.dtype != mx.int32 else np.array(x)


def _ref_max(q, k, scale, kpos, qpos, weight):
    """NumPy: max over the group's query heads and the queries of w_i softmax_j(q.k*scale)."""
    b, hq, n, d = q.shape
    h = k.shape[1]
    g = hq // h
    out = np.zeros((b, h, k.shape[2]), np.float64)
    for bi in range(b):
        for hi in range(hq):
            kv = hi // g
            logits = (q[bi, hi].astype(np.float64) * scale) @ k[bi, kv].astype(np.float64).T  # [n, T]
            vis = (kpos[bi, kv][None, :] >= 0) & (kpos[bi, kv][None, :] <= qpos[bi, 0][:, None])
            logits = np.where(vis, logits, -np.inf)
            w = np.exp(logits - logits.max(-1, keepdims=True))
            w = w / w.sum(-1, keepdims=True)
            w = w * weight[bi, 0][:, None]
            out[bi, kv] = np.maximum(out[bi, kv], w.max(0))
    return out


def _case(b, g, dtype, n=6, t=20, h=2, d=8, seed=0):
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((b, h * g, n, d)).astype(np.float32)).astype(dtype)
    k = mx.array(rng.standard_normal((b, h, t, d)).astype(np.float32)).astype(dtype)
    kpos = np.tile(np.arange(t, dtype=np.int32), (b, h, 1))
    kpos[:, :, 3] = -1  # an empty slot
    kpos = np.stack([rng.permutation(kpos[i, 0]) for i in range(b)])[:, None].repeat(h, 1)  # any slot order
    qpos = np.tile(np.arange(t - n, t, dtype=np.int32), (b, 1, 1))
    weight = np.ones((b, 1, n), np.float32)
    weight[-1, 0, -1] = 0.0  # a padding query
    return q, k, kpos, qpos, weight


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("g", [1, 2, 4])
@pytest.mark.parametrize("block", [ops.QUERY_BLOCK, 4])
def test_mass_max_matches_numpy(dtype, b, g, block):
    q, k, kpos, qpos, weight = _case(b, g, dtype)
    _, got = ops.attention(q, k, None, 0.35, mx.array(kpos), mx.array(qpos), query_weight=mx.array(weight),
                           mass="max", block=block)
    assert got.shape == (b, 2, 20) and got.dtype == mx.float32
    ref = _ref_max(_np(q), _np(k), 0.35, kpos, qpos, weight)
    np.testing.assert_allclose(np.array(got), ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert np.all(np.array(got)[kpos < 0] == 0)  # empty slots receive nothing


def test_mass_rejects_unknown_mode():
    q, k, kpos, qpos, _ = _case(1, 1, mx.float32)
    with pytest.raises(ValueError, match="'max'"):
        ops.attention(q, k, None, 1.0, mx.array(kpos), mx.array(qpos), mass="maximum")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("g", [1, 2, 4])
def test_pass_score_matches_numpy(dtype, b, g):
    """Algorithm 1: the softmax sees only sinks, the piece and the pass's own tokens."""
    t_stored, m, n_sink = 16, 5, 2
    t = t_stored + m
    q, k, _, _, weight = _case(b, g, dtype, n=m, t=t)
    kpos = np.tile(np.arange(t, dtype=np.int32), (b, 2, 1))
    qpos = np.tile(np.arange(t_stored, t, dtype=np.int32), (b, 1, 1))
    lo, hi = np.array([6, 8][:b]).reshape(-1, 1, 1), np.array([10, 12][:b]).reshape(-1, 1, 1)
    first = np.full((b, 1, 1), t_stored)
    got = pass_score(q, k, mx.array(kpos), mx.array(qpos), 0.5, mx.array(lo, dtype=mx.int32),
                     mx.array(hi, dtype=mx.int32), n_sink, mx.array(first, dtype=mx.int32), mx.array(weight))
    keep = (kpos < n_sink) | ((kpos >= lo) & (kpos <= hi)) | (kpos >= first)
    ref = _ref_max(_np(q), _np(k), 0.5, np.where(keep, kpos, -1), qpos, weight)
    np.testing.assert_allclose(np.array(got), ref, atol=TOL[dtype], rtol=TOL[dtype])
    outside = ~keep
    assert np.all(np.array(got)[outside] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.parametrize("block", [ops.QUERY_BLOCK, 2])
def test_mass_weights_are_the_attention_probabilities(dtype, g, block):
    q, k, kpos, qpos, _ = _case(2, g, dtype)
    v = mx.ones(k.shape, dtype)
    out, w = ops.attention(q, k, v, 0.35, mx.array(kpos), mx.array(qpos), mass="weights", block=block)
    plain, _ = ops.attention(q, k, v, 0.35, mx.array(kpos), mx.array(qpos))
    assert w.shape == (2, 2, g, 6, 20) and w.dtype == mx.float32
    # the same output up to float32 rounding (the blocked path sums in another order)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)), np.array(plain.astype(mx.float32)), rtol=1e-6, atol=1e-6)
    qn, kn = _np(q), _np(k)
    for bi in range(2):
        for hi in range(2 * g):
            logits = (qn[bi, hi] * 0.35) @ kn[bi, hi // g].T
            vis = (kpos[bi, hi // g][None] >= 0) & (kpos[bi, hi // g][None] <= qpos[bi, 0][:, None])
            e = np.where(vis, np.exp(logits - np.where(vis, logits, -np.inf).max(-1, keepdims=True)), 0)
            np.testing.assert_allclose(np.array(w)[bi, hi // g, hi % g], e / e.sum(-1, keepdims=True),
                                       atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("g", [1, 3])
def test_score_from_pass_weights_equals_the_direct_pass_score(dtype, b, g):
    """Renormalising the pass's own probabilities over K_c is Algorithm 1's restricted softmax."""
    from kvcompress_kvzip.scorer import _renormalised_max

    t_stored, m, n_sink = 16, 5, 2
    t = t_stored + m
    q, k, _, _, weight = _case(b, g, dtype, n=m, t=t, seed=3)
    kpos = mx.array(np.tile(np.arange(t, dtype=np.int32), (b, 2, 1)))
    qpos = mx.array(np.tile(np.arange(t_stored, t, dtype=np.int32), (b, 1, 1)))
    lo = mx.array(np.array([6, 8][:b]).reshape(-1, 1, 1), dtype=mx.int32)
    hi = mx.array(np.array([10, 12][:b]).reshape(-1, 1, 1), dtype=mx.int32)
    first = mx.full((b, 1, 1), t_stored, mx.int32)
    direct = pass_score(q, k, kpos, qpos, 0.5, lo, hi, n_sink, first, mx.array(weight))
    _, w = ops.attention(q, k, None, 0.5, kpos, qpos, mass="weights")
    in_piece = (kpos >= lo) & (kpos <= hi) & (kpos < first)
    got = _renormalised_max(w, kpos, in_piece, n_sink, first, mx.array(weight))
    np.testing.assert_allclose(np.array(got), np.where(np.array(in_piece), np.array(direct), 0), atol=1e-5, rtol=1e-4)


def test_kvzip_keeps_the_same_slots_with_or_without_the_pass_weights(monkeypatch):
    """End to end: the cache's scores from the pass's probabilities equal the direct score."""
    model = tiny_llama(seed=7)
    ids = mx.array(np.random.default_rng(1).integers(0, 64, (1, 60)).astype(np.int32))

    def run():
        cache = kvcompress.make_prompt_cache(model, method="kvzip", budget=24, chunk=8)
        for i in range(0, 60, 20):
            model(ids[:, i:i + 20], cache=cache)
        model(ids[:, :1], cache=cache)
        assert cache[0].diagnostics["scoring_passes"] > 2
        return [np.array(x) for c in cache for x in c.state if isinstance(x, mx.array)]

    fast = run()
    monkeypatch.setattr(KVzipScorer, "requires", frozenset({"queries", "positions", "tokens"}))
    slow = run()
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):  # ids, kept keys/values/positions equal; float scores within rounding
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def _prefilled(model, method="kvzip", n=40, budget=16, **kw):
    cache = kvcompress.make_prompt_cache(model, method, budget=budget, **kw)
    ids = mx.array(np.random.default_rng(0).integers(1, 90, (1, n)), dtype=mx.int32)
    model(ids, cache=cache)
    mx.eval([c.keys for c in cache])
    return cache, ids


def test_a_pass_leaves_real_arrays_bit_identical():
    model = tiny_llama()
    cache, _ = _prefilled(model)
    before = [(np.array(c.keys), np.array(c.values), np.array(c.slot_positions), c.keys_and_values()[0].shape[2], list(c.rows_offset), np.array(c.slot_scores))
              for c in cache]
    base = kvcompress.mlxlm.attention.base_class(model)
    n = _scoring_pass.run_passes(lambda ids, views: base.__call__(model, ids, cache=views), cache)
    assert n == 1  # 40 waiting ids, chunk 128
    for c, (k, v, pos, t, off, score) in zip(cache, before):
        assert np.array_equal(np.array(c.keys), k) and np.array_equal(np.array(c.values), v)
        assert np.array_equal(np.array(c.slot_positions), pos) and c.keys_and_values()[0].shape[2] == t and c.rows_offset == off
        assert not np.array_equal(np.array(c.slot_scores), score)  # the piece was scored
        assert np.all(np.array(c.slot_scores) < 1.0)
        assert c.diagnostics["kvzip_waiting"] == 0


def test_cost_is_reported_and_survives_save_load_and_batching(tmp_path):
    model = tiny_llama()
    cache, _ = _prefilled(model)
    model(mx.array([[5]]), cache=cache)  # runs the prompt's pass first
    d = cache[0].diagnostics
    assert d["scoring_passes"] == 1 and d["scoring_pass_tokens"] == 40 + 0 and d["scoring_pass_seconds"] > 0
    assert all(c.diagnostics["scoring_passes"] == 1 for c in cache)  # whole-model figures
    path = str(tmp_path / "c.safetensors")
    kvcompress.save_prompt_cache(path, cache)
    loaded = kvcompress.load_prompt_cache(path)
    for key in ("scoring_passes", "scoring_pass_tokens", "scoring_pass_seconds"):
        assert loaded[0].diagnostics[key] == d[key]
    other, _ = _prefilled(model, n=20)
    batch = BatchCompressedKVCache.merge([copy.deepcopy(cache[0]), other[0]])
    assert batch.diagnostics["scoring_pass_tokens"] == [40, 0]
    row = batch.extract(0)
    assert row.diagnostics["scoring_pass_tokens"] == 40 and row.diagnostics["scoring_passes"] == 1


def test_files_of_methods_without_passes_keep_their_format():
    import json

    model = tiny_llama()
    cache, _ = _prefilled(model, "snapkv", budget=16, recent=4)
    model(mx.array([[5]]), cache=cache)
    assert "passes" not in json.loads(cache[0].state[-1])
    assert cache[0].diagnostics["scoring_passes"] == 0


RECORD: list = []


@attrs.frozen
class ToyPassScorer:
    """Unrelated to KVzip: asks for two fixed passes per step and records what it sees."""

    requires: ClassVar[frozenset] = frozenset({"queries"})
    provides: ClassVar[frozenset] = frozenset()

    def init_state(self, layer):
        return ToyState()

    def pass_tokens(self, state):
        if state.asked >= 2:
            return None
        return mx.array([[7, 8, 9], [-1, 3, 4]][: 1] if state.rows == 1 else [[7, 8, 9], [-1, 3, 4]], dtype=mx.int32)

    def observe(self, scores, obs):
        if obs.scoring_pass:
            RECORD.append((obs.layer.layer, np.array(obs.tokens).tolist(), obs.n_new, scores.shape[-1]))
            obs.state = ToyState(asked=obs.state.asked + 1, rows=obs.state.rows)
            return scores + 1.0
        obs.state = ToyState(asked=0, rows=obs.queries.shape[0])
        return scores


@attrs.define
class ToyState:
    asked: int = 0
    rows: int = 1


class _ToyPlugin:
    @staticmethod
    @hookimpl
    def kvcompress_scorers():
        return [ComponentSpec("scorer", "toypass", ToyPassScorer, "test scorer with scoring passes")]


def test_toy_scorer_gets_exactly_the_pass_tokens_it_asked_for_in_every_layer():
    reg = Registry(plugins=[("toy", _ToyPlugin)])
    model = tiny_llama(n_layers=3)
    cache = kvcompress.make_prompt_cache(model, None, registry=reg, scorer="toypass", selector="lowest",
                                         disposition="drop", budget={"name": "uniform", "budget": 64})
    RECORD.clear()
    model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    assert RECORD == []  # passes run before the *next* call
    model(mx.array([[6]]), cache=cache)
    assert sorted(r[0] for r in RECORD) == [0, 0, 1, 1, 2, 2]
    assert all(r[1] == [[7, 8, 9]] and r[2] == 3 and r[3] == 5 + 3 for r in RECORD)
    assert cache[0].diagnostics["scoring_pass_tokens"] == 6
    assert np.all(np.array(cache[0].slot_scores)[..., :5] >= 2.0)  # the stored slots' scores came back


def test_cache_stepped_without_tokens_is_refused_unchanged(tmp_path):
    """Bug: a kvzip cache stepped without the model hook (e.g. loaded in a fresh process) left
    the step's tokens unscored with one warning, so its continuation silently diverged from the
    uninterrupted run. Now the step is refused before the cache changes; after
    ``kvcompress.install(model)`` the same step runs."""
    model = tiny_llama()
    cache = kvcompress.make_prompt_cache(model, "kvzip", budget=16)
    model(mx.array([[1, 2, 3, 4, 5]]), cache=cache)
    before = [np.array(a) for a in cache[0].state if isinstance(a, mx.array)]
    base = kvcompress.mlxlm.attention.base_class(model)
    with pytest.raises(kvcompress.KVCompressError, match="token ids.*kvcompress.install"):
        base.__call__(model, mx.array([[6]]), cache=cache)
    after = [np.array(a) for a in cache[0].state if isinstance(a, mx.array)]
    assert cache[0].offset == 5 and all(np.array_equal(x, y) for x, y in zip(before, after))
    model(mx.array([[6]]), cache=cache)  # the hooked model: fine
    assert cache[0].offset == 6


def test_trimmed_step_never_reaches_a_pass():
    """Speculative decoding: ids of a trimmed step are not reconstructed."""
    model = tiny_llama()
    cache, ids = _prefilled(model, n=20, budget=64)
    model(mx.array([[11, 12, 13]]), cache=cache)
    for c in cache:
        c.trim(2)
    st = cache[0].component_state("scorer")
    assert st.waiting == (1,)  # the prompt's ids were reconstructed before the call; 12, 13 are gone
    assert np.array(st.ids)[0, 0] == 11 and np.array(st.pos)[0, 0] == 20 and (np.array(st.pos)[0, 1:] == -1).all()


@pytest.mark.slow
def test_retrieval_at_8x():
    from kvcompress.bench.retrieval import run_retrieval

    out = run_retrieval({"tasks": ("passkey",), "samples": 8, "ratios": (8,), "methods": ["kvzip"]}, progress=False)
    acc = [r["accuracy"] for r in out["results"] if r["method"] == "kvzip"]
    assert acc and acc[0] >= 0.875


def test_a_scoring_pass_frees_each_layers_probabilities_before_the_next_layer():
    """The pass's attention probabilities ``[B, H, G, N, T]`` are consumed in their own layer: a
    24-layer prefill peaks no higher than snapkv's (keeping every layer's alive until the pass
    is evaluated added ~100 MB here: 24 x 3.9 MB)."""
    model = tiny_llama(n_layers=24, hidden=64, heads=8, kv_heads=2, seed=3)
    kvcompress.install(model)
    ids = mx.array(np.random.default_rng(0).integers(0, 97, (1, 1024)).astype(np.int32))
    peaks = {}
    for method in ("snapkv", "kvzip"):
        cache = kvcompress.make_prompt_cache(model, method=method, budget=256)
        mx.synchronize()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        for s in range(0, 1024, 512):
            model(ids[:, s : s + 512], cache=cache)
            mx.eval([c.state for c in cache])
        peaks[method] = mx.get_peak_memory() - base
    assert cache[0].diagnostics["scoring_passes"] >= 4
    assert peaks["kvzip"] < 1.5 * peaks["snapkv"], peaks
