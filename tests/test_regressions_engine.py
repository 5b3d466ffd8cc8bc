"""Regression tests for what a compressed cache reports and the work it does: byte and token
compression figures, the fused attention + mass only for scorers that need the step mass, and
``cache.state`` without a device sync. Each test's docstring names the bug it catches."""

from __future__ import annotations

import json
from unittest import mock

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_cache

import kvcompress
from conftest import tiny_llama
from _regression_helpers import METHODS, caches_for, greedy, held, prompt_tokens


# ------------------------------------------------------------------------------------------
# Compression figures
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["kivi", "h2o", "adakv"])
def test_diagnostics_report_token_and_byte_compression(method):
    """Bug: diagnostics reported one ``compression_ratio`` (tokens seen / tokens held), which
    for KIVI -- whose evicted tokens stay in a quantized store -- overstated the memory saved.
    Now ``compression_tokens`` (offset / held tokens) and ``compression_bytes`` (the bytes
    mlx-lm's KVCache holds for the same tokens / ``cache.nbytes``) are both reported.
    Bug (adakv): with head groups (several KV heads per storage row) the full cache's bytes
    counted storage rows as heads, so ``compression_bytes`` was ``kv_heads`` times too small."""
    model = tiny_llama(n_layers=2, hidden=64, heads=4, kv_heads=2, vocab=97, seed=2, dtype=mx.float16)
    caches = kvcompress.make_prompt_cache(model, method, budget=16, **({"recent": 4, "step": 4} if method == "adakv" else {}))
    plain = [mlx_cache.KVCache() for _ in model.layers]
    tokens = mx.array([prompt_tokens(512)])
    for c in (caches, plain):
        model(tokens[:, :448], cache=c)  # two prompt chunks, then a decode step
        model(tokens[:, 448:511], cache=c)
        model(tokens[:, 511:], cache=c)
    for c, p in zip(caches, plain):
        d = c.diagnostics
        kept = (held(c) >= 0).sum(axis=1).mean()  # per KV head (the mean over heads)
        assert d["offset"] == p.offset == 512
        assert d["tokens_kept"] == kept == c.tokens_kept
        assert d["compression_tokens"] == pytest.approx(512 / kept)
        state_bytes = sum(x.nbytes for x in c.state if not isinstance(x, str))
        assert d["nbytes"] == c.nbytes >= state_bytes  # nothing the cache holds is left out
        assert d["compression_bytes"] == pytest.approx(p.nbytes / c.nbytes)
        if method == "kivi":
            assert d["quantized_tokens"] > 0
            assert d["compression_bytes"] < d["compression_tokens"] / 4, d
        else:
            assert d["compression_bytes"] > 1


# ------------------------------------------------------------------------------------------
# Prefill work: the fused attention + mass only where a scorer needs the step mass
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method, fused, fused_decode", [("snapkv", False, False), ("tova", False, True),
                                                        ("chunkkv", False, False), ("h2o", True, True)])
def test_fused_attention_mass_only_for_step_mass_scorers(model, monkeypatch, method, fused, fused_decode):
    """Bug: every query-based scorer made a compressing prefill chunk run the float32
    attention-with-mass instead of mlx-lm's attention, although SnapKV / TOVA / ChunkKV only
    read the last queries' attention: wasted prefill work. Only scorers that require
    ``step_mass`` (H2O) get it in a chunk; in decode, those that require ``last_mass`` too
    (TOVA: the one query's mass, which it would otherwise compute in a second product)."""
    calls = []
    from kvcompress import ops

    real = ops.attention

    def spy(queries, keys, values, *args, **kwargs):
        calls.append(values is not None and kwargs.get("mass") is not None)
        return real(queries, keys, values, *args, **kwargs)

    monkeypatch.setattr(ops, "attention", spy)
    caches = caches_for(model, method, 12)
    tokens = mx.array([prompt_tokens(48)])
    for i in range(0, 48, 16):  # chunked prefill: the 2nd and 3rd chunks compress
        mx.eval(model(tokens[:, i : i + 16], cache=caches))
    assert caches[0].evictions > 0
    assert any(calls) == fused, f"{method}: fused attention+mass calls {sum(calls)}"
    calls.clear()
    for i in range(48, 52):
        mx.eval(model(tokens[:, :1] + i, cache=caches))
    assert calls and all(calls) if fused_decode else not any(calls), (method, calls)


# ------------------------------------------------------------------------------------------
# cache.state does not sync the device
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_cache_state_makes_no_host_sync(model, method):
    """Bug: ``cache.state`` (which mlx-lm evaluates after every prefill chunk, for every layer)
    called ``.item()`` on CaM's merge counter, a device->host sync per layer per chunk. The
    metadata must be built from host values only: reading ``state`` with ``mx.array.item`` /
    ``tolist`` / conversions to Python numbers patched to fail must work."""
    caches = caches_for(model, method, 12)
    model(mx.array([prompt_tokens(30)]), cache=caches)
    greedy(model, caches, 3, 3)
    boom = AssertionError("cache.state synchronised the device")
    patches = [mock.patch.object(mx.array, name, side_effect=boom)
               for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")]
    for p in patches:
        p.start()
    try:
        states = [c.state for c in caches]
    finally:
        for p in patches:
            p.stop()
    mx.eval(states)
    for c, s in zip(caches, states):
        assert isinstance(s[-1], str) and json.loads(s[-1])["rows_off"] == [c.offset]
