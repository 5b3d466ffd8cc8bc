"""Dtypes, batch and GQA shapes through prefill + decode with eviction.

* float32 / float16 / bfloat16 models (``model.set_dtype``): logits and scores stay finite, the
  cache keeps the model's dtype for keys/values and float32 for scores, for every method.
* GQA ratios 1, 2, 4 (``n_kv_heads = heads, heads/2, heads/4``) with batch 2.
* Batch rows are independent: each (batch, head) chooses its own evictions, so a row of a batch
  gives the logits of that prompt run alone -- CaM's gate included (its draws are keyed by the
  row's own facts: tokens seen and loser positions, never the row index).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvcompress
from conftest import make_caches, slot_tags, tiny_llama

METHODS = sorted(kvcompress.get_registry().methods)
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
HEADS = 4


def token_ids(n: int, seed: int, batch: int = 2) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, 97, size=(batch, n)), dtype=mx.int32)




def sharpen(model, factor: float = 8.0):
    """Scale the query projections so attention is content-dependent, not near-uniform (a random
    model's flat attention makes every row and head keep the same oldest positions)."""
    for layer in model.model.layers:
        layer.self_attn.q_proj.weight = layer.self_attn.q_proj.weight * factor
    return model


def run(model, cache, tokens, n_prompt, step):
    """Chunked prefill then one-token decode; yields the logits of every call."""
    for i in range(0, n_prompt, step):
        yield model(tokens[:, i : min(i + step, n_prompt)], cache=cache)
    for i in range(n_prompt, tokens.shape[1]):
        yield model(tokens[:, i : i + 1], cache=cache)


def _assert_finite_through_eviction(method, dtype, gqa):
    kv_heads = HEADS // gqa
    model = tiny_llama(heads=HEADS, kv_heads=kv_heads, dtype=DTYPES[dtype], seed=gqa)
    cache = make_caches(model, method, 12)
    n_prompt, n_decode = 3 * max(c.budget for c in cache) + 4, 12
    tokens = token_ids(n_prompt + n_decode, seed=gqa)
    for logits in run(model, cache, tokens, n_prompt, step=7):
        assert logits.dtype == DTYPES[dtype]
        assert logits.shape[0] == 2
        assert np.isfinite(np.array(logits.astype(mx.float32))).all()
    for c in cache:
        k, v = c.head_view()[:2]  # per KV head (head-wise budgets: each head's slots gathered)
        assert k.dtype == v.dtype == DTYPES[dtype]
        assert k.shape[:2] == (2, kv_heads) and c.size() <= c.budget
        assert k.shape[2] == c.size() if c.heads_per_row <= 1 else k.shape[2] <= c.heads_per_row * c.budget
        assert k.shape[3] == 64 // HEADS
        assert c.slot_scores.dtype == mx.float32 and np.isfinite(np.array(c.slot_scores)).all()
        assert np.isfinite(np.array(v.astype(mx.float32))).all()
        assert c.offset == n_prompt + n_decode and c.evictions > 0


@pytest.mark.parametrize("gqa", [1, 2, 4])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("method", ["h2o", "cam"])
def test_finite_through_eviction(method, dtype, gqa):
    _assert_finite_through_eviction(method, dtype, gqa)


@pytest.mark.parametrize("method", METHODS)
def test_every_method_finite_in_half_precision_with_gqa(method):
    _assert_finite_through_eviction(method, "bfloat16", 2)
    _assert_finite_through_eviction(method, "float16", 4)


@pytest.mark.parametrize("gqa", [1, 2, 4])
@pytest.mark.parametrize(
    "method,params",
    [("h2o", {"n_sink": 1, "recent_ratio": 0.0}),
     ("cam", {"n_sink": 1, "recent_ratio": 0.0}),
     ("cam", {"n_sink": 1, "recent_ratio": 0.0, "merge_gate": False})],
    ids=["h2o", "cam", "cam-nogate"],
)
def test_batch_rows_are_independent(method, params, gqa):
    """A row of a batch-2 run equals the same prompt run alone (evictions are per row and head;
    CaM's gate draws are keyed by the row's tokens seen and loser positions, not its index)."""
    model = sharpen(tiny_llama(heads=HEADS, kv_heads=HEADS // gqa, seed=10 + gqa))
    both = make_caches(model, method, 10, **params)
    budget = both[0].budget
    n_prompt = 3 * budget
    tokens = token_ids(n_prompt + 12, seed=20 + gqa)
    batched = [np.array(x) for x in run(model, both, tokens, n_prompt, step=6)]
    for row in range(2):
        alone = kvcompress.make_prompt_cache(model, method, budget=budget, **params)
        single = [np.array(x) for x in run(model, alone, tokens[row : row + 1], n_prompt, step=6)]
        for a, b in zip(batched, single):
            np.testing.assert_allclose(a[row], b[0], atol=1e-4, rtol=0)
        for cb, ca in zip(both, alone):
            assert np.array_equal(np.sort(np.array(slot_tags(cb)[row]), -1), np.sort(np.array(slot_tags(ca)[0]), -1))
    if method == "cam":  # the merges (and, with the gate, its draws) were exercised
        counted = np.array(both[0].component_state("disposition").merges)
        assert counted.shape == (2, both[0].keys.shape[1]) and counted.sum() > 0
    # the two rows saw different tokens, so somewhere they kept different positions
    assert any(
        not np.array_equal(np.sort(np.array(slot_tags(c)[0]), -1), np.sort(np.array(slot_tags(c)[1]), -1)) for c in both
    )
