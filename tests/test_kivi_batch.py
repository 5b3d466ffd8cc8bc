"""KIVI with batch rows (each row's store exactly as that row alone: decode and chunks, extract,
filter, extend, per-row dispose) and its state (flatten/restore, deep copies, save/load)."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcompress
from kvcompress import BatchCompressedKVCache
from kvcompress._state import flatten_state, restore_state
from kvcompress.contexts import Eviction
from kvcompress_kivi import KiviQuant, KiviState

from test_kivi import _generate, _kv, _state, model32  # noqa: F401 (model32: fixture)

# --------------------------------------------------------------------------------------------
# batch rows: each row exactly as alone
# --------------------------------------------------------------------------------------------


def _solo_prefill(model, method, prompt, budget=64, chunk=64):
    cache = kvcompress.make_prompt_cache(model, method, budget=budget)
    for i0 in range(0, prompt.size, chunk):
        model(prompt[None, i0 : i0 + chunk], cache=cache)
    return cache


def _greedy(model, cache, y, steps):
    """``steps`` greedy tokens from ``y`` ``[B, 1]``: (tokens [B, steps], last logits [B, V])."""
    out = []
    for _ in range(steps):
        logits = model(y, cache=cache)[:, -1]
        y = mx.argmax(logits, axis=-1, keepdims=True)
        out.append(y)
    return np.array(mx.concatenate(out, axis=1)), logits


@pytest.mark.parametrize("method", ["kivi", "h2o_kivi"])
def test_batched_rows_of_different_lengths_equal_solo_runs(model32, method):
    """Rows at different lengths (one under budget at first, so rows free different numbers of
    tokens in one step) decode the solo tokens; each extracted row's store and buffer are
    bit-identical to the solo run's, and it continues exactly."""
    lens = [150, 40, 97]
    prompts = [mx.random.randint(0, 97, (n,), key=mx.random.key(20 + i)) for i, n in enumerate(lens)]
    solo = [_solo_prefill(model32, method, p[:-1]) for p in prompts]
    batch = [BatchCompressedKVCache.merge([copy.deepcopy(s[layer]) for s in solo]) for layer in range(2)]
    steps = 45
    y = mx.array([[int(p[-1])] for p in prompts])
    tb, lb = _greedy(model32, batch, y, steps)
    for i, (p, s) in enumerate(zip(prompts, solo)):
        ts, ls = _greedy(model32, s, p[None, -1:], steps)
        assert tb[i].tolist() == ts[0].tolist()
        np.testing.assert_allclose(np.array(lb[i]), np.array(ls[0]), atol=1e-4)
    diag = batch[0].diagnostics
    assert diag["quantized_tokens"] == [_state(s[0]).n_quant[0] for s in solo]
    assert diag["buffered_tokens"] == [_state(s[0]).n_buf[0] for s in solo]
    assert len(set(diag["quantized_tokens"])) > 1  # the rows really differ
    for i, s in enumerate(solo):
        rows = [batch[layer].extract(i) for layer in range(2)]
        for layer in range(2):  # layer 0 sees the same K/V as alone: bit-identical
            _rows_equal(_state(rows[layer]), _state(s[layer]), s[layer].method.disposition, exact=layer == 0)
        y = mx.array([[3]])
        np.testing.assert_allclose(np.array(model32(y, cache=rows)), np.array(model32(y, cache=s)), atol=1e-5)


@pytest.mark.parametrize("method", ["kivi", "h2o_kivi"])
def test_batched_chunks_equal_solo_runs(model32, method):
    """Chunks fed to a batch whose rows hold different stores (one row still under budget):
    rows free different numbers of tokens in the same step and the chunk attends each row's
    own store and buffer (masked tails); every row matches its solo run."""
    lens = [150, 30, 97]
    prompts = [mx.random.randint(0, 97, (n,), key=mx.random.key(30 + i)) for i, n in enumerate(lens)]
    solo = [_solo_prefill(model32, method, p) for p in prompts]
    batch = [BatchCompressedKVCache.merge([copy.deepcopy(s[layer]) for s in solo]) for layer in range(2)]
    chunks = mx.random.randint(0, 97, (3, 90), key=mx.random.key(35))
    for i0 in (0, 50):
        out_b = model32(chunks[:, i0 : i0 + 50], cache=batch)
        for i, s in enumerate(solo):
            out_s = model32(chunks[i : i + 1, i0 : i0 + 50], cache=s)
            np.testing.assert_allclose(np.array(out_b[i]), np.array(out_s[0]), atol=1e-4)
    tb, lb = _greedy(model32, batch, mx.array([[5]] * 3), 20)
    for i, s in enumerate(solo):
        ts, ls = _greedy(model32, s, mx.array([[5]]), 20)
        assert tb[i].tolist() == ts[0].tolist()
        np.testing.assert_allclose(np.array(lb[i]), np.array(ls[0]), atol=1e-4)
        for layer in range(2):
            # within rounding: the batch's projections are one matmul over every row, which a
            # BLAS need not round as it rounds one row's
            _rows_equal(_state(batch[layer].extract(i)), _state(s[layer]), s[layer].method.disposition,
                        exact=False)


def test_filter_and_extend_keep_rows_exact(model32):
    lens = [120, 70, 160, 33]
    prompts = [mx.random.randint(0, 97, (n,), key=mx.random.key(40 + i)) for i, n in enumerate(lens)]
    solo = [_solo_prefill(model32, "kivi", p, budget=40) for p in prompts]
    ref = [copy.deepcopy(s) for s in solo]
    a = [BatchCompressedKVCache.merge([copy.deepcopy(solo[i][layer]) for i in (0, 1, 2)]) for layer in range(2)]
    b = [BatchCompressedKVCache.merge([copy.deepcopy(solo[3][layer])]) for layer in range(2)]
    _greedy(model32, a, mx.array([[1], [2], [3]]), 20)
    for i, yi in zip((0, 1, 2), (1, 2, 3)):
        _greedy(model32, ref[i], mx.array([[yi]]), 20)
    for layer in range(2):
        a[layer].filter([2, 0])  # drop row 1, reorder
        a[layer].extend(b[layer])  # rows: 2, 0, 3
    tb, _ = _greedy(model32, a, mx.array([[7], [8], [9]]), 35)
    for row, (i, yi) in enumerate(zip((2, 0, 3), (7, 8, 9))):
        ts, _ = _greedy(model32, ref[i], mx.array([[yi]]), 35)
        assert tb[row].tolist() == ts[0].tolist()
        for layer in range(2):
            _rows_equal(_state(a[layer].extract(row)), _state(ref[i][layer]), KiviQuant(), exact=layer == 0)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.lists(st.integers(0, 45), min_size=3, max_size=3), min_size=1, max_size=6),
       bits=st.sampled_from([2, 4]))
def test_dispose_with_per_row_counts_equals_each_row_alone(steps, bits):
    """dispose() with rows freeing different counts (``ev.real``: each row's first ``count``
    entries, in priority order, not position order): each row's buffer and store are
    bit-identical to disposing the row's tokens alone, and take_rows/stack_rows round-trip."""
    disp = KiviQuant(bits=bits)
    b, h, d, t = 3, 2, 16, 48
    both = disp.init_state()
    solo = [disp.init_state() for _ in range(b)]

    def eviction(k, v, pos, evict, counts, real, state):
        n = k.shape[0]
        return Eviction(keys=k, values=v, scores=mx.zeros((n, h, t)), positions=pos, evict=evict,
                        protected=mx.zeros((n, h, t), mx.bool_), offset=mx.zeros((n, 1, 1), mx.int32),
                        offsets=(0,) * n, layer=kvcompress.LayerInfo(), counts=tuple(counts), real=real,
                        state=state)

    for step, counts in enumerate(steps):
        e = max(counts)
        if e == 0:
            continue
        k, v = _kv(b, h, t, d, seed=100 + step)
        pos = mx.broadcast_to(mx.arange(t, dtype=mx.int32) + 1000 * step, (b, h, t))
        rng = np.random.RandomState(step)
        evict = mx.array(np.stack([np.stack([rng.permutation(t)[:e] for _ in range(h)]) for _ in range(b)]),
                         mx.int32)
        uniform = len(set(counts)) == 1
        real = None if uniform else mx.arange(e).reshape(1, 1, e) < mx.array(counts).reshape(b, 1, 1)
        ev = eviction(k, v, pos, evict, counts, real, both)
        disp.dispose(ev)
        both = ev.state
        for i, c in enumerate(counts):
            if c:
                sl = slice(i, i + 1)
                lone = eviction(k[sl], v[sl], pos[sl], evict[sl, :, :c], [c], None, solo[i])
                disp.dispose(lone)
                solo[i] = lone.state
    for i in range(b):
        alone = solo[i] if solo[i].n_quant else KiviState(n_quant=[0], n_buf=[0])
        _rows_equal(disp.take_rows(both, [i]), alone, disp)
    again = disp.stack_rows([disp.take_rows(both, [i]) for i in range(b)], [1] * b)
    assert again.n_quant == (both.n_quant or [0] * b) and again.n_buf == (both.n_buf or [0] * b)
    for x, y in zip(again.arrays(), both.arrays()):
        assert (x is None and y is None) or mx.array_equal(x, y)


def _rows_equal(a: KiviState, b: KiviState, disp: KiviQuant, exact: bool = True) -> None:
    """Two single-row states hold the same stores and buffers: bit-identical, or (``exact``
    False: a deeper layer, whose K/V come from batched attention that rounds differently)
    the same counts and codes within rounding."""
    assert (a.n_quant, a.n_buf) == (b.n_quant, b.n_buf)
    for x, y in zip(a.arrays(), b.arrays()):
        if a.n_quant[0] == 0 and (x is None or y is None):
            continue
        assert x.shape == y.shape and x.dtype == y.dtype
        if exact:
            assert mx.array_equal(x, y)
    if not exact and a.n_quant[0]:
        for x, y in zip(disp.dequantize(a), disp.dequantize(b)):
            steps = mx.abs(x - y) / (mx.abs(x) + 1)  # a code may flip at a rounding boundary
            assert float(mx.mean((steps > 1e-4).astype(mx.float32))) < 0.01
    if not exact:
        np.testing.assert_allclose(np.array(a.buf_k), np.array(b.buf_k), atol=1e-5)



# --------------------------------------------------------------------------------------------
# state: round trips, copies, persistence
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n_prompt", [30, 80, 200])  # nothing evicted / buffer only / packed groups
def test_save_load_round_trip(model32, tmp_path, n_prompt):
    prompt = mx.random.randint(0, 97, (n_prompt,), key=mx.random.key(12))
    cache = kvcompress.make_prompt_cache(model32, "kivi", budget=64)
    _generate(model32, prompt, cache, 3, prefill_step_size=64)
    s = _state(cache[0])
    expect = {30: (0, 0), 80: (0, 19), 200: (128, 11)}[n_prompt]  # offset = prompt + 3
    assert (s.n_quant[0], s.n_buf[0]) == expect
    path = str(tmp_path / "kivi.safetensors")
    kvcompress.save_prompt_cache(path, cache)
    loaded = kvcompress.load_prompt_cache(path)
    copied = copy.deepcopy(cache)
    for c, d, e in zip(cache, loaded, copied):
        for other in (d, e):
            a, b = _state(c), _state(other)
            assert (a.n_quant, a.n_buf) == (b.n_quant, b.n_buf)
            for x, y in zip(a.arrays(), b.arrays()):
                assert (x is None and y is None) or (x.dtype == y.dtype and mx.array_equal(x, y))
            assert (other.offset, other.size()) == (c.offset, c.size())
            assert mx.array_equal(other.keys_and_values()[0], c.keys_and_values()[0])
    tok = mx.array([[5]])
    want = model32(tok, cache=cache)
    assert mx.array_equal(want, model32(tok, cache=loaded))
    assert mx.array_equal(want, model32(tok, cache=copied))


def test_state_flattens_and_restores_bit_identically():
    disp = KiviQuant(bits=4)
    state = disp._push(KiviState(n_quant=[0, 0], n_buf=[0, 0]), *_kv(2, 2, 75, 16, seed=80), [75, 40])
    meta, arrays = flatten_state(state)
    assert meta["body"]["n_quant"] == [64, 32] and meta["body"]["n_buf"] == [11, 8]
    back = restore_state(disp, meta, arrays)
    assert back.n_quant == state.n_quant and back.n_buf == state.n_buf
    assert all(mx.array_equal(x, y) for x, y in zip(back.arrays(), state.arrays()))
    assert flatten_state(disp.init_state())[1] == []  # nothing evicted: no arrays
