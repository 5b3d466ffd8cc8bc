"""KIVI quantize disposition: error bound, real memory, attention on the packed store, protocol."""

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
from kvcompress import CompressedKVCache, build_method
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
        mask = "causal" if n > 1 else None
        outs.append(cache.attend(mlx_sdpa, q, ks, vs, d**-0.5, mask))
        cache.observe(q, d**-0.5, mask)
    mx.eval(outs)
    return outs


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
    state = cache.disposition_state
    nq = state.n_quantized
    assert nq > 0 and nq % GROUP == 0 and state.n_buffered < GROUP
    assert nq + state.n_buffered + cache.size() == cache.offset  # every token is somewhere
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


def test_two_bit_store_is_under_point_three_of_fp16_full_cache():
    b, h, d, t, residual = 1, 2, 128, 2048, 128
    keys, values = _kv(b, h, t, d, seed=5, dtype=mx.float16)
    cache = _kivi_cache(residual, bits=2)
    _feed(cache, keys, values, chunk=512)
    _feed(cache, *_kv(b, h, 4, d, seed=6, dtype=mx.float16), chunk=1)
    full = 2 * b * h * cache.offset * d * 2  # K and V, float16
    state_bytes = sum(a.nbytes for a in cache.method.disposition.state_arrays(cache.disposition_state))
    assert state_bytes > 0 and cache.nbytes > state_bytes  # the store is counted in nbytes
    assert cache.nbytes < 0.3 * full
    kv = KVCache()
    kv.update_and_fetch(keys, values)
    assert cache.nbytes < 0.3 * kv.nbytes


# --------------------------------------------------------------------------------------------
# attention over the packed store
# --------------------------------------------------------------------------------------------


def _reference(state, disp, q, ks, vs, scale, mask, sinks):
    """Plain float32 attention over [dequantized store | buffer | stored] K/V."""
    kd, vd = disp.dequantize(state)
    keys = mx.concatenate([kd, state.buf_k, ks], axis=2).astype(mx.float32)
    vals = mx.concatenate([vd, state.buf_v, vs], axis=2).astype(mx.float32)
    n, t, old = q.shape[2], ks.shape[2], kd.shape[2] + state.n_buffered
    if isinstance(mask, str):
        mask = mx.arange(t - n, t)[:, None] >= mx.arange(t)[None]
    if mask is not None:
        mask = mx.concatenate([mx.ones(mask.shape[:-1] + (old,), mx.bool_), mask], axis=-1)
    return mx.fast.scaled_dot_product_attention(q.astype(mx.float32), keys, vals, scale=scale, mask=mask, sinks=sinks)


@pytest.mark.parametrize("b,h_q,h_kv", [(1, 2, 2), (2, 4, 2), (1, 6, 2)])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "array"])
def test_attend_equals_attention_on_dequantized_kv(b, h_q, h_kv, mask_kind):
    d, budget = 32, 48
    cache = _kivi_cache(budget, bits=2)
    _feed(cache, *_kv(b, h_kv, 150, d, seed=11), chunk=50, h_q=h_q)
    n = 1 if mask_kind == "none" else 7
    k_new, v_new = _kv(b, h_kv, n, d, seed=12)
    ks, vs = cache.update_and_fetch(k_new, v_new)
    state = cache.disposition_state
    assert state.n_quantized > 0 and state.n_buffered > 0  # all three parts take part
    q = mx.random.normal((b, h_q, n, d), key=mx.random.key(13))
    t = ks.shape[2]
    mask = {"none": None, "causal": "causal", "array": mx.arange(t - n, t)[:, None] >= mx.arange(t)[None]}[mask_kind]
    if mask_kind == "array":  # drop one more stored slot for the first query: a non-causal pattern
        mask = mask & ~((mx.arange(n)[:, None] == 0) & (mx.arange(t)[None] == 3))
    scale = d**-0.5
    sinks = mx.linspace(-1.0, 1.0, h_q) if h_q == 6 else None
    got = cache.attend(mlx_sdpa, q, ks, vs, scale, mask, sinks)
    want = _reference(state, cache.method.disposition, q, ks, vs, scale, mask, sinks)
    assert got.shape == (b, h_q, n, d)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)


def test_attend_is_mlx_attention_before_any_eviction():
    disp = KiviQuant()
    k, v = _kv(1, 2, 9, 32, seed=1)
    q = mx.random.normal((1, 4, 9, 32), key=mx.random.key(2))
    got = disp.attend(disp.init_state(), q, k, v, 0.2, "causal", None, mlx_sdpa)
    want = mlx_sdpa(q, k, v, cache=None, scale=0.2, mask="causal")
    assert mx.array_equal(got, want)


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
    assert all(c.disposition_state.empty for c in cache)


@pytest.mark.parametrize("method", ["kivi", "h2o_kivi"])
def test_generate_with_prefill_chunks_and_decode(model32, method):
    prompt = mx.random.randint(0, 97, (300,), key=mx.random.key(8))
    cache = kvcompress.make_prompt_cache(model32, method, budget=64)
    tokens, logp = _generate(model32, prompt, cache, 12, prefill_step_size=64)
    assert len(tokens) == 12 and bool(mx.all(mx.isfinite(logp)))
    for c in cache:
        s = c.disposition_state
        assert c.size() <= 64 and s.n_quantized % GROUP == 0 and s.n_buffered < GROUP
        assert s.n_quantized + s.n_buffered + c.size() == c.offset >= 300 + 11
        assert c.score_source == "queries"
    if method == "h2o_kivi":  # sinks stay in full precision
        pos = np.array(cache[0]._pos)
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


def test_batch_rows_match_single_sequence_runs(model32):
    prompts = mx.random.randint(0, 97, (2, 150), key=mx.random.key(11))

    def run(p):
        cache = kvcompress.make_prompt_cache(model32, "kivi", budget=64)
        outs = []
        for i0 in range(0, p.shape[1], 50):
            outs.append(model32(p[:, i0 : i0 + 50], cache=cache)[:, -1])
        step = model32(mx.zeros((p.shape[0], 1), mx.int32), cache=cache)[:, -1]
        return mx.concatenate([*outs, step], axis=0).reshape(len(outs) + 1, p.shape[0], -1)

    both = run(prompts)
    for i in range(2):
        np.testing.assert_allclose(np.array(both[:, i]), np.array(run(prompts[i : i + 1])[:, 0]), atol=1e-4)


# --------------------------------------------------------------------------------------------
# persistence
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_prompt", [30, 80, 200])  # nothing evicted / buffer only / packed groups
def test_save_load_round_trip(model32, tmp_path, n_prompt):
    prompt = mx.random.randint(0, 97, (n_prompt,), key=mx.random.key(12))
    cache = kvcompress.make_prompt_cache(model32, "kivi", budget=64)
    _generate(model32, prompt, cache, 3, prefill_step_size=64)
    s = cache[0].disposition_state
    expect = {30: (0, 0), 80: (0, 19), 200: (128, 11)}[n_prompt]  # offset = prompt + 3
    assert (s.n_quantized, s.n_buffered) == expect
    path = str(tmp_path / "kivi.safetensors")
    kvcompress.save_prompt_cache(path, cache)
    loaded = kvcompress.load_prompt_cache(path)
    for c, d in zip(cache, loaded):
        a = c.method.disposition.state_arrays(c.disposition_state)
        b = d.method.disposition.state_arrays(d.disposition_state)
        assert len(a) == len(b) and all(x.dtype == y.dtype and mx.array_equal(x, y) for x, y in zip(a, b))
        assert (d.offset, d.size()) == (c.offset, c.size())
        assert mx.array_equal(d.keys_and_values()[0], c.keys_and_values()[0])
    tok = mx.array([[5]])
    assert mx.array_equal(model32(tok, cache=cache), model32(tok, cache=loaded))


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
        s = cache.disposition_state
        assert s.n_quantized + s.n_buffered + cache.size() == cache.offset == seen
        assert s.n_quantized % GROUP == 0 and s.n_buffered < GROUP
        assert cache.size() <= max(budget - 1 + n, n)
        pos = np.sort(np.array(cache._pos[0, 0]))
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
