"""``kvcompress.ops.attention``, the one masked float32 attention (with mass) that the cache,
SnapKV's window and KIVI share: mlx-lm's attention under its masks, query blocks (evaluated one
at a time above ``EVAL_BLOCKS_ABOVE`` logits, or lazy), inside ``mx.compile``; and the softmax
it uses on the CPU (``ops._softmax``: the CPU kernels', or a compiled exp for small logits)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvcompress import _exp, _lowbit, ops

from test_kivi import _kv


@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool_heads", "bool_rows"])
def test_ops_attention_under_mlx_masks_equals_sdpa(mask_kind):
    """``ops.attention(mask=...)`` (no positions) is mlx-lm's attention under the same mask."""
    b, h_q, h_kv, n, t, d = 2, 4, 2, 5, 11, 16
    q = mx.random.normal((b, h_q, n, d), key=mx.random.key(60))
    k, v = _kv(b, h_kv, t, d, seed=61)
    r = mx.random.uniform(shape=(b, h_q, n, t), key=mx.random.key(62)) > 0.3
    mask = {"none": None, "causal": "causal", "bool_heads": r, "bool_rows": r[:, :1]}[mask_kind]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
    for block in (2, 256):
        got, _ = ops.attention(q, k, v, 0.3, mask=mask, block=block)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("settle", [True, False])
def test_ops_attention_blocks_run_one_after_another_with_the_same_result(settle, monkeypatch):
    """Query blocks are evaluated one at a time to bound memory (``settle``: above
    ``EVAL_BLOCKS_ABOVE`` logits), or stay one lazy graph; output and mass do not change."""
    monkeypatch.setattr(ops, "EVAL_BLOCKS_ABOVE", 0 if settle else 1 << 40)
    b, h_q, h, n, t, d = 2, 4, 2, 9, 20, 8
    q = mx.random.normal((b, h_q, n, d), key=mx.random.key(63))
    k, v = _kv(b, h, t, d, seed=64)
    pos = mx.broadcast_to(mx.arange(t, dtype=mx.int32), (b, h, t))
    pos = mx.where(mx.random.uniform(shape=(b, h, t), key=mx.random.key(65)) < 0.2, -1, pos)
    qpos = mx.array([15, 18], mx.int32).reshape(2, 1, 1) + mx.arange(n, dtype=mx.int32).reshape(1, 1, n) - n
    w = (mx.random.uniform(shape=(b, 1, n), key=mx.random.key(66)) > 0.3).astype(mx.float32)
    for mass in (None, "group", "heads"):
        one = ops.attention(q, k, v, 0.3, pos, qpos, mass=mass, query_weight=w)
        many = ops.attention(q, k, v, 0.3, pos, qpos, mass=mass, query_weight=w, block=2)
        # the same values up to float32 rounding (a BLAS may pick another kernel for fewer rows)
        np.testing.assert_allclose(np.array(one[0]), np.array(many[0]), atol=1e-6, rtol=1e-6)
        if mass:
            np.testing.assert_allclose(np.array(one[1]), np.array(many[1]), atol=1e-6)


def test_ops_attention_blocks_inside_mx_compile(monkeypatch):
    """Inside ``mx.compile`` no block can be evaluated early: the blocks stay one lazy graph
    with the same values (the per-block evaluation is a memory bound, never a requirement)."""
    monkeypatch.setattr(ops, "EVAL_BLOCKS_ABOVE", 0)
    b, h_q, h, n, t, d = 1, 4, 2, 9, 20, 8
    q = mx.random.normal((b, h_q, n, d), key=mx.random.key(67))
    k, v = _kv(b, h, t, d, seed=68)
    eager = ops.attention(q, k, v, 0.3, mask="causal", block=2)[0]
    compiled = mx.compile(lambda q, k, v: ops.attention(q, k, v, 0.3, mask="causal", block=2)[0])(q, k, v)
    np.testing.assert_allclose(np.array(compiled), np.array(eager), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("b,h_q,h_kv", [(1, 4, 4), (2, 8, 2), (3, 4, 1)])
def test_ops_attention_one_query_path_equals_the_general_path(dtype, b, h_q, h_kv):
    """A decode step's attention (one query, every slot visible, ``"group"`` mass) takes a
    straight-line path: the same output and mass, bit for bit, as the general masked path (here
    forced by slot positions that make every slot visible)."""
    t, d = 13, 16
    q = mx.random.normal((b, h_q, 1, d), key=mx.random.key(70)).astype(dtype)
    k, v = (x.astype(dtype) for x in _kv(b, h_kv, t, d, seed=71))
    pos = mx.broadcast_to(mx.arange(t, dtype=mx.int32), (b, h_kv, t))
    qpos = mx.full((b, 1, 1), t, mx.int32)
    fast, fast_mass = ops.attention(q, k, v, 0.25, mass="group")
    slow, slow_mass = ops.attention(q, k, v, 0.25, pos, qpos, mass="group")
    assert fast.dtype == dtype and fast.shape == (b, h_q, 1, d) and fast_mass.shape == (b, h_kv, t)
    assert mx.array_equal(fast, slow).item() and mx.array_equal(fast_mass, slow_mass).item()
    np.testing.assert_allclose(np.array(fast.astype(mx.float32)),
                               np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25).astype(mx.float32)),
                               atol=2e-2 if dtype != mx.float32 else 2e-5)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("b,h_q,rows,per_row", [(1, 16, 1, 4), (2, 9, 1, 3), (3, 8, 2, 2)])
@pytest.mark.parametrize("mass", [None, "group"])
def test_head_group_decode_path_equals_the_general_path_at_every_width(dtype, b, h_q, rows, per_row, mass):
    """A decode step over head-group rows (each query head sees its own KV head's slots, empty
    slots and later positions hidden) runs one compiled graph traced once for every store width:
    the same output and mass, bit for bit, as the general masked path (forced here by a query
    weight of one), at a width and at narrower ones (a row below its budget grows every step)."""
    t, d = 40, 16
    q = mx.random.normal((b, h_q, 1, d), key=mx.random.key(80)).astype(dtype)
    k, v = (x.astype(dtype) for x in _kv(b, rows, t, d, seed=81))
    owner = mx.random.randint(-1, per_row, (b, rows, t), key=mx.random.key(82)).astype(mx.int32)
    pos = mx.where(owner >= 0, mx.random.randint(0, t + 4, (b, rows, t), key=mx.random.key(83)), -1).astype(mx.int32)
    qpos = mx.array([t, t - 5, t + 2][:b], dtype=mx.int32).reshape(b, 1, 1)
    for w in (t, t - 1, t - 7):
        kw = dict(mass=mass, owner=owner[..., :w], heads_per_row=per_row)
        got = ops.attention(q, k[..., :w, :], v[..., :w, :], 0.25, pos[..., :w], qpos, **kw)
        want = ops.attention(q, k[..., :w, :], v[..., :w, :], 0.25, pos[..., :w], qpos, **kw,
                             query_weight=mx.ones((b, 1, 1)))
        assert got[0].dtype == dtype and mx.array_equal(got[0], want[0]).item()
        assert (got[1] is None) == (mass is None)
        assert mass is None or mx.array_equal(got[1], want[1]).item()


def test_cpu_exp_is_within_two_ulp_of_the_exact_exponential_and_zero_below_its_floor():
    """``_exp._exp_nonpositive`` (the CPU softmax's exp where the CPU kernels are not built) against float64 ``exp`` over the whole
    float32 range it serves, compiled (as used) and eager: at most 2 ulp, exactly 1 at 0,
    exactly 0 at and below the floor (masked logits give no weight)."""
    z = np.concatenate([np.linspace(-86.99, 0, 200_001, dtype=np.float32), -np.logspace(-30, 1.9, 2001, dtype=np.float32)])
    want = np.exp(z.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    for fn in (ops._exp_cpu, _exp._exp_nonpositive):
        got = np.array(fn(mx.array(z))).astype(np.float64)
        assert np.max(np.abs(got - want) / ulp) <= 2.0
        edge = np.array(fn(mx.array([0.0, _exp._EXP_FLOOR, -100.0, ops.NEG, np.nan], mx.float32)))
        assert edge[:4].tolist() == [1.0, 0.0, 0.0, 0.0] and np.isnan(edge[4])  # NaN is not hidden


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("shape", [(1, 2, 2, 1, 1), (2, 4, 2, 1, 300), (1, 2, 4, 7, 33), (1, 1, 1, 3, 0)])
def test_cpu_softmax_matches_the_float64_softmax_under_masks(shape, fast, kernels, monkeypatch):
    """``ops._softmax`` -- the CPU kernels' row softmax where they are built, else the compiled
    exp for logits up to ``FAST_SOFTMAX_MAX`` elements, else ``mx.softmax`` -- is the float64
    softmax to float32 rounding at any shape (the compiled exp is shapeless: the first shape it
    sees fixes nothing): masked logits (``NEG``) get exactly 0, and a row that sees nothing is
    uniform, as with ``mx.softmax``."""
    monkeypatch.setattr(ops, "FAST_SOFTMAX_MAX", ops.FAST_SOFTMAX_MAX if fast else 0)
    if not kernels:
        monkeypatch.setattr(_lowbit, "_resolved", {"module": None, "reason": "test"})
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_normal(shape) * 6).astype(np.float32)
    masked = rng.random(shape) < 0.3
    masked[..., 0, :] = True  # rows that see nothing
    x[masked] = ops.NEG
    got = np.array(ops._softmax(mx.array(x)))
    assert got.shape == shape
    if shape[-1]:
        x64 = x.astype(np.float64)
        e = np.exp(x64 - x64.max(axis=-1, keepdims=True))
        np.testing.assert_allclose(got, e / e.sum(axis=-1, keepdims=True), atol=1e-6, rtol=1e-5)
        sees = np.broadcast_to((~masked).any(axis=-1, keepdims=True), shape)
        assert np.all(got[masked & sees] == 0)
