"""Low-bit storage of the kept slots (``kv_bits``): attention over codes against a
dequantize-then-attend reference, every method's generation contracts with low-bit slots (batch
rows vs solo, save/load, determinism, float16), trim, layout operations, bytes and refusals."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcompress
from kvcompress import ops
from kvcompress.errors import CompositionError, ConfigError
from kvcompress.storage import KVStorage, QuantizedSlots, as_float, concat_slots, fill_from_end, put_slots, take_slots
from kvcompress.testing import check_method
from conftest import tiny_llama
from test_trim import _assert_same_cache

BITS = [8, 4, (8, 4)]
#: methods whose disposition attends or rewrites keys by its own rule: kv_bits is refused
REFUSED = {"kivi", "h2o_kivi", "streaming_llm_shift"}


def _methods() -> list:
    return sorted(set(kvcompress.get_registry().methods) - REFUSED)


def _store(shape, bits, seed=0, dtype=mx.float32):
    x = mx.array(np.random.default_rng(seed).normal(size=shape).astype(np.float32)).astype(dtype)
    return QuantizedSlots.quantize(x, bits, 32)


@pytest.mark.parametrize("bits", [(8, 8), (4, 4), (8, 4), (2, 4)])
@pytest.mark.parametrize("n", [1, 5, 40])
@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("holes", [False, True])
def test_attention_over_codes_equals_dequantize_then_attend(bits, n, gqa, holes):
    b, h, t, d = 2, 2, 48, 64
    k, v = _store((b, h, t, d), bits[0], 1), _store((b, h, t, d), bits[1], 2)
    q = mx.array(np.random.default_rng(3).normal(size=(b, h * gqa, n, d)).astype(np.float32))
    pos = mx.broadcast_to(mx.arange(t, dtype=mx.int32), (b, h, t))
    if holes:  # empty slots at different places per row
        pos = mx.where((mx.arange(t) % 5 == 0) & (mx.arange(b).reshape(-1, 1, 1) == 1), -1, pos)
    qpos = mx.broadcast_to(mx.arange(t - n, t, dtype=mx.int32).reshape(1, 1, n), (b, 1, n))
    out, mass = ops.attention(q, k, v, 0.125, pos, qpos, mass="group")
    ref_out, ref_mass = ops.attention(q, k.dequantize(), v.dequantize(), 0.125, pos, qpos, mass="group")
    assert out.shape == ref_out.shape and mass.dtype == mx.float32
    assert float(mx.abs(out - ref_out).max()) < 1e-5
    assert float(mx.abs(mass - ref_mass).max()) < 1e-5


def test_attention_over_codes_with_mlx_lm_masks_and_sinks():
    k, v = _store((1, 2, 30, 64), 4, 4), _store((1, 2, 30, 64), 4, 5)
    q = mx.array(np.random.default_rng(6).normal(size=(1, 4, 3, 64)).astype(np.float32))
    sinks = mx.array([0.5, -0.2, 0.1, 0.0])
    for mask in (None, "causal"):
        got = ops.attention(q, k, v, 0.125, mask=mask, sinks=sinks)[0]
        want = ops.attention(q, k.dequantize(), v.dequantize(), 0.125, mask=mask, sinks=sinks)[0]
        assert float(mx.abs(got - want).max()) < 1e-5


@given(idx=st.lists(st.integers(0, 19), min_size=1, max_size=8), bits=st.sampled_from([2, 4, 8]),
       seed=st.integers(0, 1000))
@settings(max_examples=25, deadline=None)
def test_layout_operations_commute_with_dequantize(idx, bits, seed):
    """take, put, concatenate and slicing on codes give the codes of the same operation on the
    vectors, so a low-bit store goes through the engine's layout code unchanged."""
    q = _store((2, 2, 20, 64), bits, seed)
    x = q.dequantize()
    j = mx.broadcast_to(mx.array(idx, dtype=mx.int32), (2, 2, len(idx)))
    assert mx.array_equal(take_slots(q, j).dequantize(), mx.take_along_axis(x, j[..., None], axis=2))
    new = _store((2, 2, len(set(idx)), 64), bits, seed + 1)
    jj = mx.broadcast_to(mx.array(sorted(set(idx)), dtype=mx.int32), (2, 2, len(set(idx))))
    put = put_slots(q, jj, new)
    ref = mx.put_along_axis(x, mx.broadcast_to(jj[..., None], jj.shape + (64,)), new.dequantize(), axis=2)
    assert mx.array_equal(put.dequantize(), ref)
    assert mx.array_equal(concat_slots([q, new]).dequantize(), mx.concatenate([x, new.dequantize()], axis=2))
    assert mx.array_equal(q[..., 3:9, :].dequantize(), x[..., 3:9, :])
    assert mx.array_equal(q[mx.array([1])].dequantize(), x[mx.array([1])])


@settings(max_examples=60, deadline=None)
@given(t=st.integers(1, 48), frac=st.floats(0, 1), seed=st.integers(0, 2**16))
def test_fill_from_end_moves_only_the_live_slots_above_the_count_into_the_holes_below(t, frac, seed):
    k = int(frac * t)
    rng = np.random.default_rng(seed)
    pos = np.stack([np.stack([rng.permutation(t) for _ in range(3)]) for _ in range(2)]).astype(np.int32)
    for b in range(2):
        for h in range(3):
            pos[b, h, rng.choice(t, k, replace=False)] = -1  # each (row, head) keeps t - k tokens
    dst, src = fill_from_end(mx.array(pos), k)
    p = mx.array(pos)
    moved = np.array(mx.put_along_axis(p, dst, mx.take_along_axis(p, src, axis=-1), axis=-1))
    for b in range(2):
        for h in range(3):
            kept = pos[b, h][pos[b, h] >= 0]
            assert sorted(moved[b, h, : t - k].tolist()) == sorted(kept.tolist())  # dense, nothing lost
            stay = np.flatnonzero(pos[b, h, : t - k] >= 0)
            assert (moved[b, h, stay] == pos[b, h, stay]).all()  # live slots below the count stay put


@pytest.mark.parametrize("method", _methods())
def test_every_method_keeps_its_contracts_with_4_bit_slots(method):
    report = check_method(method, kv_bits=4)
    for check in ("budget held", "positions", "deterministic", "save/load", "float16", "batched"):
        assert check in report.passed, report


@pytest.mark.parametrize("method", ["h2o", "snapkv", "kvzip", "adakv", "cam"])
@pytest.mark.parametrize("bits", [8, (8, 4)])
def test_8_bit_and_mixed_slots_keep_the_contracts(method, bits):
    report = check_method(method, kv_bits=bits)
    assert {"save/load", "batched", "deterministic"} <= set(report.passed), report


def _model():
    return tiny_llama(n_layers=2, hidden=256, heads=4, kv_heads=2)  # head_dim 64


def _prefill(model, caches, n=70, seed=0):
    ids = mx.array(np.random.default_rng(seed).integers(1, 97, n)[None], dtype=mx.int32)
    for i in range(0, n, 32):
        logits = model(ids[:, i : i + 32], cache=caches)
    return logits


@pytest.mark.parametrize("bits", BITS)
def test_storage_holds_codes_and_the_bytes_shrink_as_promised(bits):
    model = _model()
    flt = kvcompress.make_prompt_cache(model, "h2o", budget=40)
    low = kvcompress.make_prompt_cache(model, "h2o", budget=40, kv_bits=bits)
    _prefill(model, flt), _prefill(model, low)
    kb, vb = bits if isinstance(bits, tuple) else (bits, bits)
    for f, c in zip(flt, low):
        assert isinstance(c.keys, QuantizedSlots) and (c.keys.bits, c.values.bits) == (kb, vb)
        assert c.keys.shape == f.keys.shape and c.keys.dtype == mx.float32
        t = c.keys.shape[2] * c.keys.shape[1]  # slots x heads
        per_vec = lambda b: 64 * b // 8 + 2 * 2  # codes + float16 scale and bias (one group of 64)
        assert c.keys.nbytes + c.values.nbytes == t * (per_vec(kb) + per_vec(vb))
        assert c.nbytes < f.nbytes and c.diagnostics["compression_bytes"] > f.diagnostics["compression_bytes"]


@pytest.mark.parametrize("method", ["h2o", "snapkv"])
def test_trim_of_a_low_bit_cache_is_exact(method):
    model = _model()
    c = kvcompress.make_prompt_cache(model, method, budget=40, kv_bits=4)
    _prefill(model, c)
    model(mx.array([[5]]), cache=c)
    before = copy.deepcopy(c)
    model(mx.array([[7, 8, 9]]), cache=c)
    for layer in c:
        assert layer.trim(3) == 3
    x = mx.array([[11]])  # (the trimmed step's eviction is the one the next step makes anyway)
    assert float(mx.abs(model(x, cache=c) - model(x, cache=before)).max()) < 1e-5
    for a, b in zip(c, before):  # the same tokens, codes bit for bit, scores up to summation order
        _assert_same_cache(a, b)


def test_low_bit_state_is_refused_by_a_float_method_and_back():
    from kvcompress.storage import from_state

    q = _store((1, 1, 4, 64), 4)
    with pytest.raises(ConfigError, match="kv_bits=None"):
        from_state(q.leaves(), None, 64)
    with pytest.raises(ConfigError, match="float slots"):
        from_state(q.dequantize(), 4, 64)


@pytest.mark.parametrize("method", sorted(REFUSED))
def test_methods_that_attend_or_rewrite_keys_their_own_way_refuse_kv_bits(method):
    with pytest.raises(CompositionError, match="kv_bits"):
        kvcompress.build_method(method, kv_bits=4)


@pytest.mark.parametrize("value,match", [
    (7, "kv_bits .*must be one of 2, 3, 4, 5, 6, 8"), ((4, 4, 4), "pair"), ("K9V4", "must be one of"),
    ("four", "not a number of bits"),
])
def test_bad_kv_bits_name_the_valid_choices(value, match):
    with pytest.raises(ConfigError, match=match):
        kvcompress.build_method("h2o", kv_bits=value)


def test_kv_bits_forms_and_config_round_trip():
    assert KVStorage.of("K8V4") == KVStorage.of((8, 4)) == KVStorage.of("8,4") == KVStorage(8, 4, 64)
    m = kvcompress.build_method("snapkv", kv_bits=(8, 4), kv_group_size=32)
    assert m.storage == KVStorage(8, 4, 32) and "K8V4/g32" in m.describe()
    again = kvcompress.build_method(m.config.to_dict())
    assert again.storage == m.storage and again.config == m.config
    assert kvcompress.build_method({"method": "h2o", "storage": {"kv_bits": 4}}).storage == KVStorage(4, 4, 64)
    with pytest.raises(ConfigError, match="kv_group_size must be one of 32, 64, 128"):
        kvcompress.build_method("h2o", kv_bits=4, kv_group_size=48)
    with pytest.raises(ConfigError, match="unknown storage key"):
        kvcompress.build_method({"method": "h2o", "storage": {"bits": 4}})


def test_a_head_dim_the_group_size_does_not_divide_is_refused_with_the_sizes_that_do():
    model = tiny_llama(n_layers=1, hidden=96, heads=2, kv_heads=1)  # head_dim 48
    with pytest.raises(ConfigError, match="does not divide the model's key head dimension 48.*none does"):
        kvcompress.make_prompt_cache(model, "h2o", budget=40, kv_bits=4, kv_group_size=32)
    model = tiny_llama(n_layers=1, hidden=192, heads=2, kv_heads=1)  # head_dim 96: 32 divides it
    with pytest.raises(ConfigError, match=r"head dimension 96; use a kv_group_size that does \(32\)"):
        kvcompress.make_prompt_cache(model, "h2o", budget=40, kv_bits=4, kv_group_size=64)


def test_components_see_float_vectors_and_8_bit_answers_like_float():
    """8-bit slots: the same greedy tokens as float storage, log-probabilities close."""
    model = _model()
    outs = []
    for kw in ({}, {"kv_bits": 8}):
        c = kvcompress.make_prompt_cache(model, "cam", budget=40, **kw)
        logits = _prefill(model, c)
        toks, lps = [], []
        for _ in range(12):
            tok = mx.argmax(logits[:, -1:], axis=-1)
            toks.append(int(tok.item()))
            lps.append(logits[0, -1] - mx.logsumexp(logits[0, -1]))
            logits = model(tok, cache=c)
        outs.append((toks, mx.stack(lps)))
        assert as_float(c[0].keys).dtype == mx.float32
    assert outs[0][0] == outs[1][0]
    assert float(mx.abs(outs[0][1] - outs[1][1]).max()) < 0.1


def test_bench_storage_quick_pairs_decode_and_counts_the_codes(tmp_path):
    """``kvcompress bench storage --quick``: every (method, storage) row, ratios paired against the
    same method's float storage, low-bit rows several times smaller than a full float16 cache."""
    from kvcompress.cli import main

    assert main(["bench", "storage", "--quick", "--out", str(tmp_path), "--no-plot", "--plain"]) == 0
    import json

    rows = json.loads((tmp_path / "storage.json").read_text())["results"]
    assert {(r["method"], r["storage"]) for r in rows} == {
        (m, s) for m in ("snapkv", "h2o") for s in ("float", "K8V8/g64", "K4V4/g64")}
    for r in rows:
        assert r["decode_ratio"] > 0 and r["kv_bytes"] > 0
        if r["storage"] == "float":
            assert r["decode_ratio"] == 1.0
    by = {(r["method"], r["storage"]): r for r in rows}
    for m in ("snapkv", "h2o"):  # the quick context is 4x the budget: 4 bits beat 4x float32 by > 3x
        assert by[(m, "K4V4/g64")]["vs_fp16"] > 3 * by[(m, "float")]["vs_fp16"] > 3 * 1.9
        assert by[(m, "K8V8/g64")]["kv_bytes"] < by[(m, "float")]["kv_bytes"] / 3


@pytest.mark.parametrize("bits", [8, 4])
def test_speculative_decoding_with_a_low_bit_main_cache(bits):
    """Rejected draft tokens are trimmed from low-bit slots: the main cache's offset is what a
    KVCache's is for the accepted tokens, and with a budget above the sequence the tokens are
    plain greedy decoding's with the same storage."""
    from mlx_lm.generate import generate_step, speculative_generate_step
    from mlx_lm.models import cache as mlx_cache

    model, draft = _model(), tiny_llama(n_layers=1, hidden=256, heads=4, kv_heads=2, seed=3)
    prompt = mx.array(np.random.default_rng(5).integers(1, 97, 30), dtype=mx.int32)
    for budget in (24, 200):
        main = kvcompress.make_prompt_cache(model, "h2o", budget=budget, kv_bits=bits)
        out = list(speculative_generate_step(prompt, model, draft, num_draft_tokens=3, max_tokens=20,
                                             prompt_cache=main + [mlx_cache.KVCache() for _ in draft.layers]))
        assert any(not d for _, _, d in out) and any(d for _, _, d in out)  # drafts accepted and rejected
        want = len(prompt) - 1 + len(out) + (1 if out[-1][2] else 0)
        assert all(c.offset == want and c.tokens_kept <= c.offset for c in main)
        if budget == 200:
            plain = kvcompress.make_prompt_cache(model, "h2o", budget=budget, kv_bits=bits)
            greedy = [int(t) for t, _ in generate_step(prompt, model, prompt_cache=plain, max_tokens=20)]
            assert [int(t) for t, _, _ in out] == greedy


def _cam_decode(steps: int) -> tuple:
    """A 4-bit cam cache after a prompt and ``steps`` greedy decode steps, and the last logits."""
    model = _model()
    c = kvcompress.make_prompt_cache(model, "cam", budget=40, kv_bits=4)
    logits = _prefill(model, c)
    for _ in range(steps):
        logits = model(mx.argmax(logits[:, -1:], axis=-1), cache=c)
    return c, logits


def test_a_merge_that_says_which_rows_it_wrote_stores_what_a_full_requantization_stores(monkeypatch):
    """CaM's decode merge reports the rows it overwrote (``Eviction.rewritten``): re-storing only
    those gives the codes that quantizing the whole returned store again gives."""
    import kvcompress_cam.merge as merge
    import kvcompress_cam.stored as stored

    def run():
        return _cam_decode(6)[0]

    fast = run()

    real = stored._write_rows

    def unreported(ev, rows):
        out = real(ev, rows)
        ev.rewritten = None  # the engine must find the changed vectors itself
        return out

    monkeypatch.setattr(merge, "_write_rows", unreported)  # (merge.py calls it by its own name)
    slow = run()
    assert sum(int(mx.sum(c.component_state("disposition").merges)) for c in fast) > 0
    for a, b in zip(fast, slow):
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert all(mx.array_equal(p, q) for p, q in zip(x.leaves(), y.leaves()))


def test_mlx_lms_own_loader_reads_a_low_bit_cache_and_it_continues_exactly(tmp_path):
    from mlx_lm.models import cache as mlx_cache

    model = _model()
    c = kvcompress.make_prompt_cache(model, "snapkv", budget=40, kv_bits=(8, 4))
    _prefill(model, c)
    path = str(tmp_path / "c.safetensors")
    mlx_cache.save_prompt_cache(path, c)
    loaded = mlx_cache.load_prompt_cache(path)
    assert isinstance(loaded[0].keys, QuantizedSlots) and (loaded[0].keys.bits, loaded[0].values.bits) == (8, 4)
    for _ in range(3):
        x = mx.array([[7]])
        assert mx.array_equal(model(x, cache=c), model(x, cache=loaded))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_models_keep_scales_in_their_dtype(dtype):
    model = tiny_llama(n_layers=2, hidden=256, heads=4, kv_heads=2, dtype=dtype)
    c = kvcompress.make_prompt_cache(model, "h2o", budget=40, kv_bits=4)
    logits = _prefill(model, c)
    for _ in range(4):
        logits = model(mx.argmax(logits[:, -1:], axis=-1), cache=c)
    assert c[0].keys.dtype == dtype and c[0].keys.scales.dtype == dtype
    assert bool(mx.all(mx.isfinite(logits.astype(mx.float32))))


def test_cams_low_bit_decode_merge_reads_the_codes_as_the_dequantized_path_does(monkeypatch):
    """CaM's decode merge on low-bit slots gathers its rows from the codes and takes the cosine's
    dot products from the low-bit product: the same targets, merges and kept tokens as running the
    float merge on the dequantized store, values to float rounding."""
    import kvcompress_cam.merge as merge

    fast, lf = _cam_decode(8)
    monkeypatch.setattr(merge, "is_low_bit", lambda ev: False)
    slow, ls = _cam_decode(8)
    assert sum(int(mx.sum(c.component_state("disposition").merges)) for c in fast) > 0
    for a, b in zip(fast, slow):
        assert mx.array_equal(a.component_state("disposition").merges, b.component_state("disposition").merges)
        assert mx.array_equal(a.head_view()[2], b.head_view()[2])
        assert float(mx.abs(a.head_view()[1] - b.head_view()[1]).max()) < 1e-3
    assert float(mx.abs(lf - ls).max()) < 1e-3
