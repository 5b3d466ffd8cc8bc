"""Which attention a step runs: once tokens leave, a CPU decode step or prompt chunk of a method
that needs no attention mass attends with kvcompress's grouped products (MLX's CPU attention
repeats the keys for every query head of a GQA group, and its softmax's exp is scalar); below
the budget, MLX's own (bit-for-bit ``KVCache``). Both give the same logits."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvcompress
from conftest import tiny_llama
from kvcompress import ops
from kvcompress.engine import attend


def _decode(model, cache, ids, n):
    out = []
    for t in range(n):
        out.append(np.array(model(mx.array([[int(ids[t])]]), cache=cache)))
    return out


@pytest.mark.parametrize("method", ["streaming_llm", "keydiff", "expected_attention"])
def test_steps_past_the_budget_use_grouped_products_on_the_cpu_with_the_same_logits(method, monkeypatch):
    model = tiny_llama(n_layers=2, hidden=64, heads=4, kv_heads=2, seed=7)
    ids = np.random.default_rng(1).integers(0, 97, 64)
    calls = []
    real = ops.attention

    def spy(queries, *a, **k):
        calls.append(queries.shape[2])
        return real(queries, *a, **k)

    monkeypatch.setattr(ops, "attention", spy)
    below = kvcompress.make_prompt_cache(model, method, budget=64)
    model(mx.array(ids[None, :20]), cache=below)
    _decode(model, below, ids[20:], 4)
    assert 1 not in calls  # below the budget: MLX's attention, as KVCache attends

    def run():  # a prompt in two chunks (the second past the budget), then decode steps
        cache = kvcompress.make_prompt_cache(model, method, budget=24)
        out = [np.array(model(mx.array(ids[None, a:b]), cache=cache)) for a, b in ((0, 28), (28, 40))]
        return out + _decode(model, cache, ids[40:], 6)

    del calls[:]
    got = run()
    assert calls.count(12) >= 2  # the chunk past the budget, in every layer
    assert calls.count(1) >= 2 * 5  # every layer of the steps after the prompt's eviction
    monkeypatch.setattr(attend, "_grouped_attention_faster", lambda: False)
    want = run()
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-4)
