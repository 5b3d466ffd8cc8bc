"""Bad input never corrupts a :class:`kvcompress.CompressedKVCache`; impossible budgets fail at
creation with the numbers that make them impossible."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvcompress
from kvcompress import CompressedKVCache, ConfigError
from test_cache_protocol import _kv, assert_same_snapshot, snapshot


BAD_INPUTS = {
    "int keys": (lambda: _kv()[0].astype(mx.int32), lambda: _kv()[1], TypeError, "floating"),
    "dtype mismatch k/v": (lambda: _kv()[0], lambda: _kv()[1].astype(mx.float16), TypeError, "dtype"),
    "3-d": (lambda: _kv()[0][0], lambda: _kv()[1][0], ValueError, r"\[B, H_kv, S, D\]"),
    "5-d": (lambda: _kv()[0][None], lambda: _kv()[1][None], ValueError, r"\[B, H_kv, S, D\]"),
    "S mismatch": (lambda: _kv(s=3)[0], lambda: _kv(s=4)[1], ValueError, "disagree"),
    "numpy": (lambda: np.zeros((1, 2, 3, 16), np.float32), lambda: _kv()[1], TypeError, "mx.array"),
}
# only detectable once the cache holds something
BAD_FOR_FILLED = {
    "head_dim": (lambda: _kv(d=8)[0], lambda: _kv(d=8)[1], ValueError, "do not match"),
    "value head_dim": (lambda: _kv()[0], lambda: _kv(dv=8)[1], ValueError, "do not match"),
    "kv heads": (lambda: _kv(h=4)[0], lambda: _kv(h=4)[1], ValueError, "do not match"),
    "batch": (lambda: _kv(b=2)[0], lambda: _kv(b=2)[1], ValueError, "rows but the cache holds"),
    "cache dtype": (lambda: _kv(dtype=mx.float16)[0], lambda: _kv(dtype=mx.float16)[1], TypeError,
                    "does not match"),
}


def _filled_cache(stage: str):
    c = CompressedKVCache(kvcompress.build_method("cam", budget=6, n_sink=2, recent_ratio=0.0), 6)
    if stage == "empty":
        return c
    for i in range(4):  # 12 tokens through a budget of 6: evicted and merged
        k, v = _kv(s=3, seed=i + 1)
        c.update_and_fetch(k, v)
        if stage == "evicted" or i < 3:
            c.observe(mx.random.normal((1, 4, 3, 16)), 0.25)
    # stage "pending": the last step's keys wait for observe (a bad call must not score them)
    return c


@pytest.mark.filterwarnings("ignore:kvcompress. the model did not call:RuntimeWarning")
@pytest.mark.parametrize(
    "stage,case",
    [("empty", c) for c in sorted(BAD_INPUTS)]
    + [(s, c) for s in ("evicted", "pending") for c in sorted(BAD_INPUTS) + sorted(BAD_FOR_FILLED)],
)
def test_bad_input_raises_and_leaves_cache_unchanged(stage, case):
    make_k, make_v, exc, msg = {**BAD_INPUTS, **BAD_FOR_FILLED}[case]
    c = _filled_cache(stage)
    if stage != "empty":
        assert c.evictions > 0
    before = snapshot(c)
    pending = c.pending_step
    with pytest.raises(exc, match=msg):
        c.update_and_fetch(make_k(), make_v())
    assert_same_snapshot(snapshot(c), before)
    assert c.pending_step is pending
    # and the cache still works afterwards (once the pending step's queries arrive: a cache that
    # scored with real queries never continues with the key-as-query proxy)
    if pending is not None:
        c.observe(mx.random.normal((1, 4, 3, 16)), 0.25)
    k, v = _kv(s=1, seed=99)
    out_k, _ = c.update_and_fetch(k, v)
    assert c.offset == before[0] + 1 and out_k.shape[2] == min(before[1] + 1, 6)


@pytest.mark.parametrize(
    "method,params,reserved",
    [
        ("h2o", dict(budget=4, n_sink=4, recent_ratio=0.0), 4),
        ("h2o", dict(budget=3, n_sink=4, recent_ratio=0.0), 4),
        ("h2o", dict(budget=6, n_sink=2, recent=4, recent_ratio=0.0), 6),
        ("cam", dict(budget=10, n_sink=4, recent=7, recent_ratio=0.0), 11),
        ("cam", dict(budget=10, n_sink=4, recent=0, recent_ratio=0.7), 11),
    ],
)
def test_impossible_budget_raises_config_error_naming_numbers(tiny_model, method, params, reserved):
    with pytest.raises(ConfigError) as err:
        kvcompress.make_prompt_cache(tiny_model, method, **params)
    msg = str(err.value)
    assert f"budget {params['budget']}" in msg and str(reserved) in msg


@pytest.mark.parametrize("budget", [0, -3, 2.5, True])
def test_non_positive_or_non_int_budget_raises(budget):
    method = kvcompress.build_method("h2o", n_sink=0, recent_ratio=0.0)
    with pytest.raises(ConfigError, match="budget"):
        CompressedKVCache(method, budget)
