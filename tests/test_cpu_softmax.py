"""The CPU kernels' float32 row softmax (``kvcompress._lowbit.row_softmax``), which every
attention of a compressed cache takes on the CPU: the softmax itself against a float64
reference (edge rows included), the unnormalised form, the per-head softmax over a head-group
row (``owner_softmax``), and the paths that take them. Skips with the reason where the kernels cannot be built (as ``test_lowbit``)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress import _lowbit, ops
from test_lowbit import kernel  # noqa: F401  (the fixture: the built module, or a skip with the reason)


def _reference(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def _close(got: np.ndarray, x: np.ndarray, want: np.ndarray) -> bool:
    """Within float32 rounding: a few ulp, plus what rounding ``z = x - max x`` to float32 costs
    ``e^z`` (relative ``|z|`` ulp)."""
    z = np.abs(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
    return bool(np.all(np.abs(got - want) <= want * 2.4e-7 * (2 + z) + 1e-12))


@pytest.mark.parametrize("shape", [(1,), (7,), (8,), (9,), (3, 37), (2, 3, 3, 2048), (1, 3, 300, 1100)])
def test_softmax_matches_float64_within_float32_rounding(kernel, shape):
    """Rows of every length around the 8 lanes, and inputs large enough to be split over
    threads: each weight within a few float32 ulp of the exact softmax, each row sums to 1."""
    rng = np.random.default_rng(len(shape) * 100 + shape[-1])
    x = (rng.normal(size=shape) * 12).astype(np.float32)
    got = np.array(_lowbit.row_softmax()(mx.array(x)))
    want = _reference(x)
    assert got.shape == x.shape
    assert _close(got, x, want)
    assert np.allclose(got.sum(axis=-1), 1.0, atol=2e-6)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, width=32), min_size=1, max_size=40), st.integers(0, 3))
def test_softmax_of_any_row_is_the_reference(kernel, row, masked):
    """Any finite row, some of it masked with :data:`kvcompress.ops.NEG` (as attention masks):
    masked entries get exactly 0 unless the whole row is masked (then uniform, as MLX)."""
    x = np.array(row, np.float32)
    x[: min(masked, len(x))] = ops.NEG
    got = np.array(_lowbit.row_softmax()(mx.array(x[None])))[0]
    assert _close(got, x, _reference(x))
    if 0 < masked < len(x):
        assert np.all(got[:masked] == 0.0)


def test_non_finite_rows_give_what_mlx_gives(kernel):
    """A NaN anywhere, or +inf, makes its row NaN; all -inf is 0 / 0; other rows are untouched."""
    nan, inf = float("nan"), float("inf")
    x = mx.array([[0.0, nan, 1.0], [inf, 0.0, 1.0], [-inf, -inf, -inf], [-inf, 0.0, 0.0]])
    got = np.array(_lowbit.row_softmax()(x))
    assert np.isnan(got[:3]).all()
    assert np.array_equal(got[3], [0.0, 0.5, 0.5])
    assert np.array_equal(np.isnan(got), np.isnan(np.array(mx.softmax(x, axis=-1))))


def test_strided_input_and_unnormalised_form(kernel):
    """A transposed (non-contiguous) input is read in its logical order; ``normalize=False``
    gives ``e^(x - max x)`` per row (the largest entry exactly 1)."""
    rng = np.random.default_rng(5)
    x = mx.array((rng.normal(size=(40, 6)) * 5).astype(np.float32)).T
    got = np.array(_lowbit.row_softmax()(x))
    assert _close(got, np.array(x), _reference(np.array(x)))
    e = np.array(_lowbit.row_softmax()(x, normalize=False))
    xs = np.array(x, np.float64)
    want = np.exp(xs - xs.max(axis=-1, keepdims=True))
    assert _close(e, np.array(x), want) and np.all(e.max(axis=-1) == 1.0)


def test_attention_takes_the_kernel_for_decode_steps_and_prompt_chunks(kernel, monkeypatch):
    """:func:`kvcompress.ops.attention` runs its softmax here on the CPU, for a one-query step
    and for a chunk too large for the compiled path (MLX's softmax before), with the same output
    as a float64 reference."""
    calls = []
    real = _lowbit.row_softmax

    def counting():
        fn = real()
        return lambda x, **kw: (calls.append(x.size), fn(x, **kw))[1]

    monkeypatch.setattr(ops, "row_softmax", counting)
    rng = np.random.default_rng(1)
    k = rng.normal(size=(1, 2, 700, 16)).astype(np.float32)
    v = rng.normal(size=(1, 2, 700, 16)).astype(np.float32)
    for n in (1, 300):  # 300 queries x 6 heads x 700 keys > ops.FAST_SOFTMAX_MAX
        q = rng.normal(size=(1, 6, n, 16)).astype(np.float32)
        out, _ = ops.attention(mx.array(q), mx.array(k), mx.array(v), 0.25, mass="group")
        logits = np.einsum("bhgnd,bhtd->bhgnt", q.reshape(1, 2, 3, n, 16).astype(np.float64), k) * 0.25
        want = np.einsum("bhgnt,bhtd->bhgnd", _reference(logits), v).reshape(1, 6, n, 16)
        assert np.allclose(np.array(out), want, atol=2e-5)
    assert len(calls) >= 2 and max(calls) > ops.FAST_SOFTMAX_MAX


def test_without_the_kernels_mlx_softmax_serves(monkeypatch):
    """``KVCOMPRESS_LOWBIT=0`` (or no build): the same attention through MLX's softmax."""
    monkeypatch.setattr(_lowbit, "_resolved", {"module": None, "reason": "test"})
    assert _lowbit.row_softmax() is None
    x = mx.array(np.random.default_rng(2).normal(size=(4, 900, 300)).astype(np.float32))
    assert mx.allclose(ops._softmax(x), mx.softmax(x, axis=-1), atol=1e-6).item()
    assert mx.allclose(ops._exp_shifted(x), mx.exp(x - x.max(axis=-1, keepdims=True)), atol=1e-6).item()


def _owner_reference(x: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """Float64 softmax of ``x [P, g, rep, T]`` per head over the columns ``heads [P, T]`` gives it."""
    own = heads[:, None, None, :] == np.arange(x.shape[1])[None, :, None, None]
    z = np.where(own, x.astype(np.float64), -np.inf)
    with np.errstate(invalid="ignore"):
        e = np.exp(z - z.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 3), st.integers(1, 70), st.integers(0, 2**31 - 1),
       st.booleans())
def test_owner_softmax_is_each_heads_softmax_over_its_own_columns(kernel, planes, g, rep, t, seed, packed):
    """Any head-group row: each query head's weights are the float64 softmax over the columns
    its KV head owns (read plainly, or from packed positions ``head << 24 | position``; empty
    slots, -1, nobody's), exactly 0 on every other column; a head owning no column gets NaN
    (0 / 0, as a softmax of nothing)."""
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(planes, g, rep, t)) * 10).astype(np.float32)
    heads = rng.integers(-1, g, size=(planes, t)).astype(np.int32)
    v = np.where(heads >= 0, (heads << 24) | rng.integers(0, 1 << 24, size=heads.shape), -1) if packed else heads
    got = np.array(_lowbit.owner_softmax()(mx.array(x), mx.array(v.astype(np.int32)), shift=24 if packed else 0))
    want = _owner_reference(x, heads)
    assert got.shape == x.shape
    own = heads[:, None, None, :] == np.arange(g)[None, :, None, None]
    has = np.broadcast_to(own.any(axis=-1, keepdims=True), x.shape)
    assert np.all(np.isnan(got[~has])) and not np.isnan(got[has]).any()
    assert np.all(got[has & ~np.broadcast_to(own, x.shape)] == 0.0)
    assert np.all(np.abs(got[has] - want[has]) <= want[has] * 2.4e-7 * 60 + 1e-12)


def test_owner_softmax_at_decode_size_strided_and_threaded(kernel):
    """AdaKV's decode shape (3 heads of 3 query heads over a 6k-slot row) and one large enough
    to split over threads; a transposed input is read in its logical order; a NaN logit of a
    head makes that head's rows NaN and no other's."""
    rng = np.random.default_rng(9)
    for shape in [(1, 3, 3, 6144), (4, 4, 8, 4100)]:
        x = (rng.normal(size=shape) * 6).astype(np.float32)
        heads = rng.integers(-1, shape[1], size=(shape[0], shape[-1])).astype(np.int32)
        got = np.array(_lowbit.owner_softmax()(mx.array(x), mx.array(heads)))
        assert np.allclose(got, _owner_reference(x, heads), rtol=2e-5, atol=1e-9)
        assert np.allclose(got.sum(axis=-1), 1.0, atol=2e-5)
    x = (rng.normal(size=(1, 2, 5, 12)) * 3).astype(np.float32)
    xt = mx.array(np.ascontiguousarray(x.transpose(0, 1, 3, 2))).swapaxes(-1, -2)  # strided view of x
    heads = np.array([[0, 1] * 6], np.int32)
    assert np.allclose(np.array(_lowbit.owner_softmax()(xt, mx.array(heads))), _owner_reference(x, heads), rtol=2e-6)
    x[0, 1, 0, 3] = np.nan  # column 3 is head 1's
    got = np.array(_lowbit.owner_softmax()(mx.array(x), mx.array(heads)))
    assert np.isnan(got[0, 1, 0]).all() and not np.isnan(np.delete(got.reshape(10, 12), 5, axis=0)).any()
