"""KIVI quantize disposition: error bound, real memory, attention on the packed store, batch rows
(exact per-row stores), extract/filter/extend, state round trips, peak memory."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.models.base import scaled_dot_product_attention as mlx_sdpa
from mlx_lm.models.cache import KVCache

import kvcompress
from kvcompress import CompressedKVCache, build_method, ops
from kvcompress._state import flatten_state
from kvcompress_kivi import KiviQuant, KiviState

from conftest import tiny_llama

GROUP = 32


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _kv(b, h, t, d, seed, dtype=mx.float32):
    k = mx.random.normal((b, h, t, d), key=mx.random.key(seed)).astype(dtype)
    v = mx.random.normal((b, h, t, d), key=mx.random.key(seed + 1)).astype(dtype)
    return k, v


def _feed(cache, keys, values, chunk, h_q=None):
    """Feed K/V through ``cache`` as the attention wrapper would (update, attend, observe)."""
    b, h, t, d = keys.shape
    h_q = h_q or h
    outs = []
    for i0 in range(0, t, chunk):
        k, v = keys[:, :, i0 : i0 + chunk], values[:, :, i0 : i0 + chunk]
        n = k.shape[2]
        q = mx.random.normal((b, h_q, n, d), key=mx.random.key(1000 + i0)).astype(k.dtype)
        ks, vs = cache.update_and_fetch(k, v)
        outs.append(cache.attend(mlx_sdpa, q, ks, vs, d**-0.5, "causal" if n > 1 else None))
        cache.observe(q, d**-0.5)
    mx.eval(outs)
    return outs


def _state(cache) -> KiviState:
    return cache.component_state("disposition")


def _kivi_cache(budget=64, bits=2, **kw):
    return CompressedKVCache(build_method("kivi", budget=budget, bits=bits, **kw), budget)


def _group_bound(x: np.ndarray, axis: int, bits: int) -> np.ndarray:
    """Half a quantization step of every group of 32 along ``axis``, broadcast back to ``x``."""
    x = np.moveaxis(x, axis, -1)
    g = x.reshape(*x.shape[:-1], -1, GROUP)
    step = (g.max(-1, keepdims=True) - g.min(-1, keepdims=True)) / (2**bits - 1)
    half = np.broadcast_to(step / 2, g.shape).reshape(x.shape)
    return np.moveaxis(half, -1, axis)


def _generate(model, prompt, cache, n, prefill_step_size=64):
    out = []
    for (tok, logp), _ in zip(
        generate_step(prompt, model, prompt_cache=cache, prefill_step_size=prefill_step_size, max_tokens=n),
        range(n),
    ):
        out.append((int(tok), logp))
    return [t for t, _ in out], mx.stack([lp for _, lp in out])


@pytest.fixture(scope="module")
def model32():
    """head_dim 32: values quantize in whole groups of 32 channels without padding."""
    return tiny_llama(n_layers=2, hidden=128, heads=4, kv_heads=2, seed=3)


# --------------------------------------------------------------------------------------------
# quantization
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dtype,d", [(mx.float32, 32), (mx.float16, 64), (mx.float32, 16)])
def test_dequantized_store_within_half_step_of_true_kv(bits, dtype, d):
    b, h, t, budget = 2, 2, 300, 64
    keys, values = _kv(b, h, t, d, seed=bits, dtype=dtype)
    cache = _kivi_cache(budget, bits)
    _feed(cache, keys, values, chunk=100)
    _feed(cache, *_kv(b, h, 3, d, seed=99, dtype=dtype), chunk=1)  # decode steps evict the rest
    state = _state(cache)
    nq = state.n_quant[0]
    assert state.n_quant == [nq] * b and nq > 0 and nq % GROUP == 0 and state.n_buf[0] < GROUP
    assert nq + state.n_buf[0] + cache.size() == cache.offset  # every token is somewhere
    kd, vd = cache.method.disposition.dequantize(state)
    # oldest-first eviction: the store holds positions 0 .. nq-1 in order
    true_k = np.array(keys[:, :, :nq].astype(mx.float32))
    true_v = np.array(values[:, :, :nq].astype(mx.float32))
    eps = 1e-5 if dtype == mx.float32 else 4e-3 * max(np.abs(true_k).max(), np.abs(true_v).max())
    err_k = np.abs(np.array(kd.astype(mx.float32)) - true_k)
    assert np.all(err_k <= _group_bound(true_k, axis=2, bits=bits) + eps)  # per channel, 32 tokens
    dp = math.ceil(d / GROUP) * GROUP  # values: per token, 32 channels (edge-padded when d < 32)
    padded = np.concatenate([true_v, np.repeat(true_v[..., -1:], dp - d, axis=-1)], axis=-1)
    err_v = np.abs(np.array(vd.astype(mx.float32)) - true_v)
    assert np.all(err_v <= _group_bound(padded, axis=3, bits=bits)[..., :d] + eps)
    # quantization really happened: the error is not zero
    assert err_k.max() > 1e-3 and err_v.max() > 1e-3
    # the buffer holds the next positions, in full precision
    nb = state.n_buf[0]
    assert mx.array_equal(state.buf_k[:, :, :nb], keys[:, :, nq : nq + nb])
    assert not mx.any(state.buf_k[:, :, nb:])  # unused slots are zeros


def test_memory_accounting_and_two_bit_store_under_point_three_of_fp16_full_cache():
    b, h, d, t, residual = 1, 2, 128, 2048, 128
    keys, values = _kv(b, h, t, d, seed=5, dtype=mx.float16)
    cache = _kivi_cache(residual, bits=2)
    _feed(cache, keys, values, chunk=512)
    _feed(cache, *_kv(b, h, 4, d, seed=6, dtype=mx.float16), chunk=1)
    state = _state(cache)
    state_bytes = sum(a.nbytes for a in flatten_state(state)[1])
    assert state_bytes == sum(a.nbytes for a in state.arrays())
    stored = sum(a.nbytes for a in (cache.keys, cache.values, cache.slot_positions, cache.slot_scores))
    assert state_bytes > 0 and cache.nbytes == stored + state_bytes  # the store is counted
    # the packed part itself: codes + fp16 scales/zeros = 0.1875 x fp16 K/V per token
    nq = state.n_quant[0]
    packed = sum(getattr(state, f).nbytes for f in ("kq", "ks", "kb", "vq", "vs", "vb"))
    assert packed == pytest.approx(0.1875 * 2 * b * h * nq * d * 2)
    full = 2 * b * h * cache.offset * d * 2  # K and V, float16
    assert cache.nbytes < 0.3 * full
    kv = KVCache()
    kv.update_and_fetch(keys, values)
    assert cache.nbytes < 0.3 * kv.nbytes
    diag = cache.diagnostics
    assert (diag["quantized_tokens"], diag["buffered_tokens"]) == (nq, state.n_buf[0])
    assert diag["nbytes"] == cache.nbytes and diag["compression_bytes"] > 3


# --------------------------------------------------------------------------------------------
# attention over the packed store
# --------------------------------------------------------------------------------------------


def _reference(state, disp, q, ks, vs, scale, mask, sinks, row=0):
    """Plain float32 attention of one row over [dequantized store | buffer | stored] K/V."""
    kd, vd = disp.dequantize(state)
    nq, nb = state.n_quant[row], state.n_buf[row]
    sl = slice(row, row + 1)
    keys = mx.concatenate([kd[sl, :, :nq], state.buf_k[sl, :, :nb], ks[sl]], axis=2).astype(mx.float32)
    vals = mx.concatenate([vd[sl, :, :nq], state.buf_v[sl, :, :nb], vs[sl]], axis=2).astype(mx.float32)
    n, t, old = q.shape[2], ks.shape[2], nq + nb
    if isinstance(mask, str):
        mask = mx.arange(t - n, t)[:, None] >= mx.arange(t)[None]
    if mask is not None:
        if mask.ndim == 4:
            mask = mask[sl]
        mask = mx.concatenate([mx.ones(mask.shape[:-1] + (old,), mx.bool_), mask], axis=-1)
    return mx.fast.scaled_dot_product_attention(q[sl].astype(mx.float32), keys, vals, scale=scale, mask=mask,
                                                sinks=sinks)


@pytest.mark.parametrize("b,h_q,h_kv", [(1, 2, 2), (2, 4, 2), (1, 6, 2)])
@pytest.mark.parametrize("n,mask_kind", [(1, "none"), (3, "causal"), (7, "causal"), (7, "array")])
def test_attend_equals_attention_on_dequantized_kv(b, h_q, h_kv, n, mask_kind):
    """Decode steps (quantized_matmul) and chunks (dequantized block) alike."""
    d, budget = 32, 48
    cache = _kivi_cache(budget, bits=2)
    _feed(cache, *_kv(b, h_kv, 150, d, seed=11), chunk=50, h_q=h_q)
    k_new, v_new = _kv(b, h_kv, n, d, seed=12)
    ks, vs = cache.update_and_fetch(k_new, v_new)
    state = _state(cache)
    assert state.n_quant[0] > 0 and state.n_buf[0] > 0  # all three parts take part
    q = mx.random.normal((b, h_q, n, d), key=mx.random.key(13))
    t = ks.shape[2]
    mask = {"none": None, "causal": "causal", "array": mx.arange(t - n, t)[:, None] >= mx.arange(t)[None]}[mask_kind]
    if mask_kind == "array":  # drop one more stored slot for the first query: a non-causal pattern
        mask = mask & ~((mx.arange(n)[:, None] == 0) & (mx.arange(t)[None] == 3))
    scale = d**-0.5
    sinks = mx.linspace(-1.0, 1.0, h_q) if h_q == 6 else None
    disp = cache.method.disposition
    got = disp.attend(state, q, ks, vs, scale, mask, sinks, mlx_sdpa)  # under the given mask
    assert got.shape == (b, h_q, n, d)
    if mask_kind != "array":  # the cache applies its own slot mask: the same here
        assert mx.array_equal(cache.attend(mlx_sdpa, q, ks, vs, scale, None, sinks), got)
    for row in range(b):
        want = _reference(state, cache.method.disposition, q, ks, vs, scale, mask, sinks, row)
        np.testing.assert_allclose(np.array(got[row : row + 1]), np.array(want), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n", [1, 9])
def test_attend_rows_with_different_stores_equals_each_row_alone(n):
    """A state whose rows hold different numbers of quantized/buffered tokens: each row attends
    only its own (the unused tails are masked), under an array mask with empty slots."""
    disp = KiviQuant(bits=4)
    d, h = 32, 2
    rows = [3 * GROUP + 5, GROUP + 2, 0]  # tokens each row pushed
    solo = []
    for i, pushed in enumerate(rows):
        k, v = _kv(1, h, max(pushed, 1), d, seed=40 + i)
        solo.append(disp._push(KiviState(n_quant=[0], n_buf=[0]), k, v, [pushed]))
    both = disp.stack_rows(solo, [1] * len(solo))
    assert both.n_quant == [96, 32, 0] and both.n_buf == [5, 2, 0] and both.width == 96
    t = 12
    ks, vs = _kv(3, h, t, d, seed=50)
    pos = mx.array([[list(range(t))], [[-1] * 5 + list(range(7))], [[-1] * 9 + list(range(3))]], mx.int32)
    pos = mx.broadcast_to(pos, (3, h, t))
    qpos = mx.array([t, 7, 3], mx.int32).reshape(3, 1, 1) + mx.arange(n).reshape(1, 1, n) - n
    mask = ops.visibility(pos[:, :1], qpos)  # [B, 1, n, T]
    q = mx.random.normal((3, 2 * h, n, d), key=mx.random.key(51))
    got = disp.attend(both, q, ks, vs, 0.2, mask, None, mlx_sdpa)
    for i, s in enumerate(solo):
        sl = slice(i, i + 1)
        m = mask[sl]
        if s.empty:
            want = mlx_sdpa(q[sl], ks[sl], vs[sl], cache=None, scale=0.2, mask=m)
        else:
            want = disp.attend(s, q[sl], ks[sl], vs[sl], 0.2, m, None, mlx_sdpa)
        real = np.array(qpos[i, 0]) >= 0  # padding queries see nothing: their output is moot
        np.testing.assert_allclose(np.array(got[sl])[:, :, real], np.array(want)[:, :, real], atol=2e-5, rtol=1e-4)


def test_attend_is_mlx_attention_before_any_eviction():
    disp = KiviQuant()
    k, v = _kv(1, 2, 9, 32, seed=1)
    q = mx.random.normal((1, 4, 9, 32), key=mx.random.key(2))
    got = disp.attend(disp.init_state(), q, k, v, 0.2, "causal", None, mlx_sdpa)
    want = mlx_sdpa(q, k, v, cache=None, scale=0.2, mask="causal")
    assert mx.array_equal(got, want)


def test_chunk_attention_transient_memory_below_full_attention():
    """Peak-memory regression: a 512-query chunk over a 4k-token quantized store allocates far
    less than mlx's attention over the same tokens in full precision (block-wise logits, one
    block at a time)."""
    disp = KiviQuant(bits=2)
    b, h_q, h, d, old, t, n = 1, 16, 4, 64, 4096, 1023 + 512, 512
    state = disp._push(KiviState(n_quant=[0], n_buf=[0]), *_kv(b, h, old + 7, d, seed=70), [old + 7])
    ks, vs = _kv(b, h, t, d, seed=71)
    q = mx.random.normal((b, h_q, n, d), key=mx.random.key(72))
    kf, vf = _kv(b, h, old + 7 + t, d, seed=73)
    mx.eval(state.arrays(), ks, vs, q, kf, vf)

    def transient(fn):
        mx.synchronize()
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(fn())
        return mx.get_peak_memory() - before

    ours = transient(lambda: disp.attend(state, q, ks, vs, 0.125, "causal", None, mlx_sdpa))
    full = transient(lambda: mlx_sdpa(q, kf, vf, cache=None, scale=0.125, mask="causal"))
    scores = b * h_q * n * (old + t) * 4  # the float32 scores full attention materialises
    assert full >= scores
    assert ours < 0.5 * full, (ours / 2**20, full / 2**20)


# --------------------------------------------------------------------------------------------
# through mlx-lm
# --------------------------------------------------------------------------------------------


def test_identical_to_kvcache_when_budget_covers_everything(model32):
    prompt = mx.random.randint(0, 97, (40,), key=mx.random.key(7))
    ref_tokens, ref_logp = _generate(model32, prompt, [KVCache() for _ in model32.layers], 10, 16)
    cache = kvcompress.make_prompt_cache(model32, "kivi", budget=128)
    tokens, logp = _generate(model32, prompt, cache, 10, 16)
    assert tokens == ref_tokens
    assert mx.array_equal(logp, ref_logp)
    assert all(_state(c).empty for c in cache)


@pytest.mark.parametrize("method", ["kivi", "h2o_kivi"])
def test_generate_with_prefill_chunks_and_decode(model32, method):
    prompt = mx.random.randint(0, 97, (300,), key=mx.random.key(8))
    cache = kvcompress.make_prompt_cache(model32, method, budget=64)
    tokens, logp = _generate(model32, prompt, cache, 12, prefill_step_size=64)
    assert len(tokens) == 12 and bool(mx.all(mx.isfinite(logp)))
    for c in cache:
        s = _state(c)
        assert c.size() <= 64 and s.n_quant[0] % GROUP == 0 and s.n_buf[0] < GROUP
        assert s.n_quant[0] + s.n_buf[0] + c.size() == c.offset >= 300 + 11
        assert c.score_source == "queries"
    if method == "h2o_kivi":  # sinks stay in full precision
        pos = np.array(cache[0].slot_positions)
        assert all(set(range(4)) <= set(pos[0, h].tolist()) for h in range(pos.shape[1]))


def test_quantizing_losers_beats_dropping_them(model32):
    """Same H2O choice of losers: 4-bit keeps the logits much closer to the full cache than drop."""
    prompt = mx.random.randint(0, 97, (256,), key=mx.random.key(9))

    def last_logits(cache):
        _generate(model32, prompt[:-1], cache, 1, prefill_step_size=64)
        return model32(prompt[None, -1:], cache=cache)[0, -1].astype(mx.float32)

    full = last_logits([KVCache() for _ in model32.layers])
    drop = last_logits(kvcompress.make_prompt_cache(model32, "h2o", budget=48))
    quant = last_logits(kvcompress.make_prompt_cache(model32, "h2o_kivi", budget=48, bits=4))
    err_drop = float(mx.abs(drop - full).max())
    err_quant = float(mx.abs(quant - full).max())
    assert err_quant < 0.5 * err_drop


def test_composed_evict_or_quantize_equals_named_h2o_kivi(model32):
    composed = build_method(scorer="h2o", selector="lowest", disposition="kivi_quant", budget="uniform",
                            n_sink=4, recent_ratio=0.5, bits=2, group=32)
    named = build_method("h2o_kivi", budget=512)
    assert composed.disposition == named.disposition and composed.scorer == named.scorer
    assert composed.selector == named.selector
    prompt = mx.random.randint(0, 97, (120,), key=mx.random.key(10))
    a = kvcompress.make_prompt_cache(model32, composed)
    for c in a:
        c.budget = 40  # same per-layer budget for both
    b = kvcompress.make_prompt_cache(model32, "h2o_kivi", budget=40)
    ta, la = _generate(model32, prompt, a, 5, 32)
    tb, lb = _generate(model32, prompt, b, 5, 32)
    assert ta == tb and mx.array_equal(la, lb)


# --------------------------------------------------------------------------------------------
# invariants
# --------------------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    budget=st.integers(8, 70),
    chunks=st.lists(st.integers(1, 90), min_size=1, max_size=6),
    bits=st.sampled_from([2, 4]),
)
def test_every_token_is_stored_buffered_or_packed(budget, chunks, bits):
    cache = _kivi_cache(budget, bits)
    seen = 0
    for i, n in enumerate(chunks):
        _feed(cache, *_kv(1, 2, n, 32, seed=i), chunk=n)
        seen += n
        s = _state(cache)
        nq, nb = (s.n_quant or [0])[0], (s.n_buf or [0])[0]
        assert nq + nb + cache.size() == cache.offset == seen
        assert nq % GROUP == 0 and nb < GROUP
        assert cache.size() <= max(budget - 1 + n, n)
        pos = np.sort(np.array(cache.slot_positions[0, 0]))
        assert pos.tolist() == list(range(seen - cache.size(), seen))  # the residual is the newest


def test_rejects_unsupported_parameters():
    with pytest.raises(ValueError):
        KiviQuant(bits=3)
    with pytest.raises(ValueError):
        KiviQuant(group=16)
    with pytest.raises(kvcompress.ConfigError):
        KiviQuant().dispose(type("E", (), {"state": None})())
    assert isinstance(KiviQuant().init_state(), KiviState)


def _teacher_forced_nll(model, ids, cache, n_prefill, chunk=128):
    for i0 in range(0, n_prefill, chunk):
        model(ids[None, i0 : min(i0 + chunk, n_prefill)], cache=cache)
    logits = mx.concatenate([model(ids[None, i : i + 1], cache=cache)[0] for i in range(n_prefill, ids.size - 1)])
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -float(mx.take_along_axis(logp, ids[n_prefill + 1 :, None], axis=-1).mean())


def test_real_model_head_dim_8_kivi_close_to_full_cache(stories_model, stories_text):
    """stories260K has head_dim 8 (values edge-padded to one 32-channel group per token)."""
    model, tok = stories_model
    ids = mx.array(tok.encode(stories_text[:3000]))[:340]
    nll = {
        name: _teacher_forced_nll(model, ids, make(), 300)
        for name, make in {
            "full": lambda: [KVCache() for _ in model.layers],
            "h2o": lambda: kvcompress.make_prompt_cache(model, "h2o", budget=64),
            "kivi2": lambda: kvcompress.make_prompt_cache(model, "kivi", budget=64, bits=2),
            "kivi4": lambda: kvcompress.make_prompt_cache(model, "kivi", budget=64, bits=4),
        }.items()
    }
    assert abs(nll["kivi4"] - nll["full"]) < 0.05
    assert nll["kivi2"] - nll["full"] < 0.5 * (nll["h2o"] - nll["full"])
