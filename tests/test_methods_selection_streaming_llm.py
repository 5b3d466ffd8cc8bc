"""StreamingLLM: what it keeps, and its position-shift variant.

* StreamingLLM: exactly the sinks plus the most recent tokens, for any chunking (hypothesis).
* A chunk read after eviction attends the sinks from every query (mlx-lm's rotating cache does not).
* Position shift: attended keys sit at contiguous positions, which gives StreamingLLM's logits.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcompress
from _methods_selection_helpers import D, Driver
from conftest import tiny_llama
from kvcompress import ConfigError


# ------------------------------------------------------------------------------------------------
# StreamingLLM
# ------------------------------------------------------------------------------------------------


def kept_sets(pos: np.ndarray) -> list[list[set]]:
    return [[set(pos[b, h].tolist()) for h in range(pos.shape[1])] for b in range(pos.shape[0])]


@settings(max_examples=25, deadline=None)
@given(
    steps=st.lists(st.integers(1, 7), min_size=1, max_size=20),
    n_sink=st.sampled_from([0, 1, 4]),
    extra=st.integers(1, 12),
    b=st.sampled_from([1, 2]),
)
def test_streaming_llm_keeps_exactly_sinks_and_recent(steps, n_sink, extra, b):
    budget = n_sink + extra
    d = Driver("streaming_llm", budget, b=b, n_sink=n_sink)
    for s in steps:
        d.step(s)
        n, off = d.cache.size(), d.cache.offset
        expect = set(range(min(n_sink, off))) | set(range(off - (n - min(n_sink, off)), off))
        assert len(expect) == n
        assert all(k == expect for row in kept_sets(d.pos) for k in row)


def test_chunk_after_eviction_attends_the_sinks_unlike_rotating():
    """A chunk read after eviction attends the sinks from every query (the layout is sinks,
    recent, chunk, so bottom-right "causal" covers them); mlx-lm's ``RotatingKVCache`` of the same
    size and keep masks its sink columns out of a chunk with a sliding window, which is why it
    predicts long text worse at equal bytes (docs/bench_longctx.md)."""
    from mlx_lm.models.cache import RotatingKVCache

    budget, n_sink, n = 8, 2, 6
    d = Driver("streaming_llm", budget, n_sink=n_sink)
    rot = RotatingKVCache(max_size=budget, keep=n_sink)
    for s in (5, 6, 3):  # 14 tokens read: both have evicted, both keep the 2 sinks
        d.step(s)
        kv = mx.zeros((1, 2, s, D))
        rot.update_and_fetch(kv, kv)
    assert d.cache.evictions > 0 and rot.offset == d.cache.offset == 14
    ours = np.array(d.cache.make_mask(n, return_array=True))  # asked before the step, as models do
    theirs = np.array(rot.make_mask(n, return_array=True))
    assert ours.shape == theirs.shape == (n, budget - 1 + n)
    d.step(n)
    assert (d.pos[..., :n_sink] == np.arange(n_sink)).all()  # the sink columns, after the step
    assert ours[:, :n_sink].all()  # every query of the chunk sees both sinks
    assert not theirs[n_sink:, :n_sink].any()  # the rotating cache: query j >= 2 sees neither


# ------------------------------------------------------------------------------------------------
# StreamingLLM position shift
# ------------------------------------------------------------------------------------------------


def _rope_each(rope, x, positions):
    """Reference: rotate every slot separately with the module itself."""
    out = np.zeros(x.shape, np.float32)
    for b in range(x.shape[0]):
        for h in range(x.shape[1]):
            for j in range(x.shape[2]):
                out[b, h, j] = np.array(rope(x[b : b + 1, h : h + 1, j : j + 1], offset=int(positions[b, h, j])))[0, 0, 0]
    return out


@pytest.mark.parametrize("traditional", [False, True])
def test_shift_rotates_keys_to_contiguous_positions(traditional):
    from kvcompress._state import flatten_state, restore_state
    from kvcompress_streaming_llm import PositionShift, rope_params
    from kvcompress_streaming_llm.shift import ShiftState

    rope = nn.RoPE(D, traditional=traditional, base=500.0)
    rng = np.random.default_rng(6)
    k0 = mx.array(rng.standard_normal((2, 2, 6, D)).astype(np.float32))
    pos = np.stack([np.stack([rng.permutation([0, 1, 5, 9, 12, 13]) for _ in range(2)]) for _ in range(2)])
    stored = mx.array(_rope_each(rope, k0, pos))
    disp = PositionShift()
    fresh = disp.init_state(kvcompress.LayerInfo())
    assert fresh == ShiftState() and not fresh.shifted  # nothing evicted: nothing to shift
    assert disp.view_keys(attrs.evolve(fresh, rope=rope_params(rope)), stored, mx.array(pos, dtype=mx.int32),
                          mx.full((2, 1, 1), 14, mx.int32)) is stored
    state = ShiftState(rope=rope_params(rope), shifted=True)  # bound to the model, after an eviction
    offset = mx.full((2, 1, 1), 14, mx.int32)
    view = disp.view_keys(state, stored, mx.array(pos, dtype=mx.int32), offset)
    rank = np.argsort(np.argsort(pos, -1), -1)
    np.testing.assert_allclose(np.array(view), _rope_each(rope, k0, 14 - 6 + rank), atol=2e-5)
    # StreamingLLM: query at the cache length n, keys at their ranks 0..n-1 -- same logits
    q0 = mx.array(rng.standard_normal((2, 2, 1, D)).astype(np.float32))
    ours = np.array(rope(q0, offset=14 - 1) @ view.swapaxes(-1, -2))
    ref = np.array(rope(q0, offset=5) @ mx.array(_rope_each(rope, k0, rank)).swapaxes(-1, -2))
    np.testing.assert_allclose(ours, ref, atol=2e-5)
    # the rotation survives save/load: the state flattens into cache.state and restores
    restored = restore_state(disp, *flatten_state(state))
    assert restored.shifted and restored.rope == state.rope
    assert mx.array_equal(disp.view_keys(restored, stored, mx.array(pos, dtype=mx.int32), offset), view)


class _Pinned:
    """Reference layer cache: given keys/values, a chosen RoPE offset, appends new tokens."""

    def __init__(self, keys, values, offset):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, k, v):
        self.keys = mx.concatenate([self.keys, k], axis=2)
        self.values = mx.concatenate([self.values, v], axis=2)
        self.offset += k.shape[2]
        return self.keys, self.values

    def make_mask(self, n, window_size=None, return_array=False):
        return None if n == 1 else "causal"


def test_streaming_llm_shift_decode_equals_reference_streaming_llm():
    """After eviction, a decode step with ``streaming_llm_shift`` gives the logits of a cache
    that holds the sinks + recent tokens re-rotated to positions 0..n-1, with the query at n."""
    from kvcompress_streaming_llm import rope_params

    model = tiny_llama(n_layers=2, seed=8)
    budget, n_sink = 10, 2
    cache = kvcompress.make_prompt_cache(model, "streaming_llm_shift", budget=budget, n_sink=n_sink)
    tokens = mx.array(np.random.default_rng(2).integers(0, 97, (1, 40)), dtype=mx.int32)
    for i in range(0, 30, 6):
        model(tokens[:, i : i + 6], cache=cache)
    for i in range(30, 35):
        model(tokens[:, i : i + 1], cache=cache)
    rp = rope_params(model.layers[0].self_attn.rope)
    ref = []
    for c in cache:
        k, v = c.keys_and_values()
        pos = np.array(c.slot_positions)[0, 0]
        order = np.argsort(pos)
        keep = order[[*range(n_sink), *range(n_sink + 1, len(order))]]  # the oldest non-sink leaves
        kk = k[:, :, mx.array(keep)]
        delta = mx.broadcast_to(mx.array(np.arange(len(keep)) - pos[keep]), kk.shape[:3])
        kk = rp.rotate(kk, delta)  # from true positions to ranks 0..n-1
        ref.append(_Pinned(kk, v[:, :, mx.array(keep)], len(keep)))
    ours = model(tokens[:, 35:36], cache=cache)
    theirs = model(tokens[:, 35:36], cache=ref)
    assert np.abs(np.array(ours) - np.array(theirs)).max() < 1e-4
    model2 = tiny_llama(n_layers=2, seed=8)
    plain = kvcompress.make_prompt_cache(model2, "streaming_llm", budget=budget, n_sink=n_sink)
    for i in range(0, 30, 6):
        model2(tokens[:, i : i + 6], cache=plain)
    for i in range(30, 36):
        out = model2(tokens[:, i : i + 1], cache=plain)
    assert np.abs(np.array(out) - np.array(ours)).max() > 1e-3, "the shift must change the attention"


def _rotated(x: np.ndarray, delta: np.ndarray, dims: int, traditional: bool, base: float, scale: float):
    """float64 reference of nn.RoPE's rotation by ``delta`` per vector (``dims`` rotated)."""
    half = dims // 2
    ang = scale * delta[..., None].astype(np.float64) * base ** (-np.arange(half) * 2.0 / dims)
    c, s = np.cos(ang), np.sin(ang)
    x = x.astype(np.float64)
    x1, x2 = (x[..., 0:dims:2], x[..., 1:dims:2]) if traditional else (x[..., :half], x[..., half:dims])
    y1, y2 = x1 * c - x2 * s, x1 * s + x2 * c
    y = np.stack([y1, y2], -1).reshape(*y1.shape[:-1], dims) if traditional else np.concatenate([y1, y2], -1)
    return np.concatenate([y, x[..., dims:]], -1)


@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("dims", [D, D // 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shift_rotation_by_tables_matches_rope_at_every_scale_of_delta(traditional, dims, dtype):
    """The rotation by per-slot offsets (three table levels: up to 2047, multiples of 2048 and
    of 2048^2) equals RoPE's, for negative offsets too, a partial rotary and low-precision keys.
    Scale 2^-22 keeps the angles of offsets past 2^22 exact in float32, so the third level is
    checked to float32 precision against a float64 reference."""
    from kvcompress_streaming_llm import rope_params

    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 3, 7, D)).astype(np.float32)
    delta = np.array([0, 1, -1, 2047, 2048, -5000, 123_457, 3 * 2**22 + 4097, -(2**22) - 1, 2**30, 77, 9000,
                      -70_000, 2**23, 5])
    delta = np.resize(delta, (2, 3, 7))
    xs = mx.array(x).astype(getattr(mx, dtype))
    for scale, deltas in ((2.0**-22, delta), (1.0, np.clip(delta, -9000, 9000))):
        rope = nn.RoPE(dims, traditional=traditional, base=500.0, scale=scale)
        got = rope_params(rope).rotate(xs, mx.array(deltas, dtype=mx.int32))
        assert got.dtype == xs.dtype and got.shape == xs.shape
        want = _rotated(np.array(xs.astype(mx.float32)), deltas, dims, traditional, 500.0, scale)
        # float32 angles of offsets up to 9000 carry ~5e-4 rad (RoPE's own rounding, there too)
        tol = (2e-5 if scale < 1 else 2e-3) if dtype == "float32" else 3e-2
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), want, atol=tol * 4)


def test_shift_rotation_uses_the_modules_own_frequencies():
    """A RoPE with its own frequency table (Llama 3's) is rotated as the module rotates: the
    table rotation agrees with mx.fast.rope's per-slot rotation at offsets where float32 angles
    are exact enough to compare."""
    from mlx_lm.models.rope_utils import Llama3RoPE

    from kvcompress_streaming_llm import rope_params

    rope = Llama3RoPE(D, max_position_embeddings=8192, traditional=False, base=10000.0,
                      scaling_config={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 512})
    rp = rope_params(rope)
    x = mx.array(np.random.default_rng(3).standard_normal((1, 2, 6, D)).astype(np.float32))
    delta = mx.array(np.resize([3, -2500, 700, 0, 4095, -1], (1, 2, 6)), dtype=mx.int32)
    direct = mx.fast.rope(x.reshape(-1, 1, D), D, traditional=False, base=None, scale=1.0,
                          offset=delta.reshape(-1), freqs=rp.freqs).reshape(x.shape)
    np.testing.assert_allclose(np.array(rp.rotate(x, delta)), np.array(direct), atol=5e-3)


def test_shift_refuses_rope_it_cannot_shift():
    from mlx_lm.models.rope_utils import DynamicNTKScalingRoPE

    from kvcompress_streaming_llm import rope_params

    with pytest.raises(ConfigError, match="DynamicNTKScalingRoPE"):
        rope_params(DynamicNTKScalingRoPE(8, 128, False, 10000.0, 2.0))
