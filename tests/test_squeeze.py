"""SqueezeAttention budget: k-means layer budgets from the prompt, total kept, generation."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

import kvcompress
from kvcompress import ConfigError, build_method
from kvcompress_squeeze import SqueezeState, kmeans_1d, squeeze_budgets

from conftest import tiny_llama

L, BUDGET = 6, 32


@pytest.fixture
def model6():
    return tiny_llama(n_layers=L, hidden=64, heads=4, kv_heads=2, seed=4)


def similarity(cache) -> list[float]:
    """Each layer's prompt similarity (row 0), as its budget's state recorded it."""
    out = []
    for c in cache:
        st = c.component_state("budget")
        assert isinstance(st, SqueezeState) and st.cos is not None and st.cos.shape == (1,)
        assert c.diagnostics["squeeze_similarity"] == pytest.approx(float(st.cos[0]))
        out.append(float(st.cos[0]))
    return out


def _generate(model, prompt, cache, n, prefill_step_size=64):
    steps = generate_step(prompt, model, prompt_cache=cache, prefill_step_size=prefill_step_size, max_tokens=n)
    return [int(t) for (t, _), _ in zip(steps, range(n))]


def _reference_similarity(prompt) -> list[float]:
    """cos(x, x + attn(norm(x))) per layer, from an untouched copy of the model (same seed)."""
    m = tiny_llama(n_layers=L, hidden=64, heads=4, kv_heads=2, seed=4)
    h = m.model.embed_tokens(prompt[None])
    out = []
    for layer in m.layers:
        x = h
        r = layer.self_attn(layer.input_layernorm(x), "causal", KVCache())
        y = x + r
        cos = (x * y).sum(-1) / (mx.linalg.norm(x, axis=-1) * mx.linalg.norm(y, axis=-1))
        out.append(float(cos.mean()))
        h = layer(x, "causal", KVCache())
    return out


# --------------------------------------------------------------------------------------------
# allocation (pure)
# --------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    sims=st.lists(st.floats(-1.0, 1.0, allow_nan=False), min_size=1, max_size=40),
    budget=st.integers(8, 600),
    ratio=st.floats(0.05, 1.0),
    seed=st.integers(0, 3),
)
def test_budgets_keep_uniform_total_and_squeeze_most_similar_cluster(sims, budget, ratio, seed):
    out = squeeze_budgets(sims, budget, ratio, seed=seed, min_budget=5)
    assert len(out) == len(sims) and sum(out) == len(sims) * budget
    assert min(out) >= 5
    sims = np.asarray(sims)
    low = np.asarray(out) == min(out)
    if len(set(out)) > 1:  # squeezed layers are exactly the most similar ones
        assert sims[low].min() >= sims[~low].max()
        assert max(out) > budget > min(out)
    assert squeeze_budgets(sims, budget, ratio, seed=seed, min_budget=5) == out  # deterministic


def test_kmeans_finds_separated_groups():
    x = [0.10, 0.12, 0.50, 0.52, 0.51, 0.90, 0.93, 0.11]
    labels, centres = kmeans_1d(x, 3, seed=0)
    assert sorted(np.round(centres, 2).tolist()) == [0.11, 0.51, 0.92]
    groups = {tuple(np.flatnonzero(labels == j)) for j in range(3)}
    assert groups == {(0, 1, 7), (2, 3, 4), (5, 6)}
    assert kmeans_1d([0.3, 0.3, 0.3], 3)[1].size == 1  # fewer distinct values than clusters
    assert squeeze_budgets([0.3, 0.3, 0.3], 10, 0.5) == [10, 10, 10]


def test_squeezed_budget_is_ratio_of_mean_budget():
    out = squeeze_budgets([0.2, 0.25, 0.5, 0.55, 0.9, 0.95], 100, 0.4)
    assert out[4:] == [40, 40]
    assert sum(out[:4]) == 520 and max(out[:4]) - min(out[:4]) <= 1


# --------------------------------------------------------------------------------------------
# observation through the model
# --------------------------------------------------------------------------------------------


def test_prompt_similarity_matches_direct_computation_and_sets_budgets(model6):
    prompt = mx.random.randint(0, 97, (90,), key=mx.random.key(1))
    cache = kvcompress.make_prompt_cache(model6, "squeeze", budget=BUDGET)
    assert [c.budget for c in cache] == [BUDGET] * L  # uniform until the prompt is seen
    plain = kvcompress.make_prompt_cache(model6, "h2o", budget=BUDGET)
    first = model6(prompt[None, :64], cache=cache)
    assert mx.array_equal(first, model6(prompt[None, :64], cache=plain))  # observing changes nothing
    sims = np.asarray(similarity(cache))
    np.testing.assert_allclose(sims, _reference_similarity(prompt[:64]), atol=1e-5)
    budgets = [c.budget for c in cache]
    sel = kvcompress.build_method("squeeze").selector
    min_b = next(b for b in range(1, BUDGET) if sel.reserved(b) < b)  # the smallest evictable budget
    assert budgets == squeeze_budgets(sims.tolist(), BUDGET, 0.7, min_budget=min_b)  # the default ratio
    assert sum(budgets) == L * BUDGET
    assert len(set(budgets)) > 1
    assert sims[np.argmax(sims)] == sims[np.asarray(budgets) == min(budgets)].max()
    assert all(c.evictions == 0 for c in cache)  # budgets were set before any eviction
    model6(prompt[None, 64:], cache=cache)
    assert [c.size() for c in cache] == [min(b - 1 + 26, 90) for b in budgets]
    assert [c.budget for c in cache] == budgets  # later forwards do not re-squeeze


def test_generate_with_chunked_prefill_is_deterministic(model6):
    prompt = mx.random.randint(0, 97, (300,), key=mx.random.key(2))
    runs = []
    for _ in range(2):
        cache = kvcompress.make_prompt_cache(model6, "squeeze", budget=BUDGET)
        tokens = _generate(model6, prompt, cache, 6)
        budgets = [c.budget for c in cache]
        assert sum(budgets) == L * BUDGET and [c.size() for c in cache] == budgets
        runs.append((tokens, budgets))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("scorer,disposition", [("recency", "drop"), ("h2o", "kivi_quant"), ("h2o", "gated_merge")])
def test_any_token_policy_inside_layers(model6, scorer, disposition):
    method = build_method({
        "scorer": scorer, "selector": "lowest", "disposition": disposition,
        "budget": {"name": "squeeze", "budget": 40}, "params": {"n_sink": 2},
    })
    cache = kvcompress.make_prompt_cache(model6, method)
    prompt = mx.random.randint(0, 97, (150,), key=mx.random.key(3))
    _generate(model6, prompt, cache, 3)
    budgets = [c.budget for c in cache]
    assert sum(budgets) == L * 40 and len(set(budgets)) > 1
    assert [c.size() for c in cache] == budgets


def test_each_prompt_cache_observes_its_own_prompt_and_the_hook_is_stateless(model6):
    """The layer-I/O hook holds no state: every prompt cache observes its own first forward, and
    other caches on the same model (plain mlx-lm ones included) run exactly as before."""
    fresh = tiny_llama(n_layers=L, hidden=64, heads=4, kv_heads=2, seed=4)
    a = kvcompress.make_prompt_cache(model6, "squeeze", budget=BUDGET)
    model6(mx.random.randint(0, 97, (1, 50), key=mx.random.key(4)), cache=a)
    b = kvcompress.make_prompt_cache(model6, "squeeze", budget=2 * BUDGET)
    model6(mx.random.randint(0, 97, (1, 50), key=mx.random.key(5)), cache=b)
    assert sum(c.budget for c in a) == L * BUDGET and sum(c.budget for c in b) == 2 * L * BUDGET
    assert similarity(a) != similarity(b)
    blk = model6.layers[0]
    assert isinstance(blk, llama.TransformerBlock) and type(blk) is not llama.TransformerBlock
    assert isinstance(blk.self_attn, llama.Attention)
    x = mx.random.randint(0, 97, (1, 30), key=mx.random.key(6))
    plain = [KVCache() for _ in range(L)]
    assert mx.array_equal(model6(x, cache=plain), fresh(x, cache=[KVCache() for _ in range(L)]))
    h2o = kvcompress.make_prompt_cache(model6, "h2o", budget=BUDGET)
    h2o_fresh = kvcompress.make_prompt_cache(fresh, "h2o", budget=BUDGET)
    assert mx.array_equal(model6(x, cache=h2o), fresh(x, cache=h2o_fresh))
    # a prompt cache observes only its first forward: later forwards leave the budgets alone
    before = ([c.budget for c in a], similarity(a))
    model6(x, cache=a)
    assert ([c.budget for c in a], similarity(a)) == before


def test_save_load_keeps_squeezed_budgets(model6, tmp_path):
    cache = kvcompress.make_prompt_cache(model6, "squeeze", budget=BUDGET)
    _generate(model6, mx.random.randint(0, 97, (120,), key=mx.random.key(6)), cache, 2)
    path = str(tmp_path / "squeeze.safetensors")
    kvcompress.save_prompt_cache(path, cache)
    loaded = kvcompress.load_prompt_cache(path)
    assert [c.budget for c in loaded] == [c.budget for c in cache]
    tok = mx.array([[7]])
    assert mx.array_equal(model6(tok, cache=cache), model6(tok, cache=loaded))


def test_non_llama_blocks_fail_clearly():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = nn.Linear(4, 4)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [Block(), Block()]

    with pytest.raises(ConfigError, match="input_layernorm and self_attn"):
        kvcompress.make_prompt_cache(Model(), "squeeze", budget=BUDGET)


def test_real_model_budgets(stories_model, stories_text):
    model, tok = stories_model
    ids = mx.array(tok.encode(stories_text[:3000]))[:300]
    cache = kvcompress.make_prompt_cache(model, "squeeze", budget=64)
    _generate(model, ids, cache, 3, prefill_step_size=128)
    sims = similarity(cache)
    budgets = [c.budget for c in cache]
    assert all(0.0 < s < 1.0 for s in sims)
    assert sum(budgets) == len(model.layers) * 64 and len(set(budgets)) > 1


def test_batch_rows_get_their_own_budgets_and_run_as_alone(model6):
    """Budgets are per row: a batch of two prompts squeezes each row by its own similarities,
    and every row then decodes exactly as that prompt does alone (rows free different counts)."""
    x = mx.array(np.random.default_rng(0).integers(0, 97, (2, 90)), dtype=mx.int32)

    def run(tokens):
        cache = kvcompress.make_prompt_cache(model6, "squeeze", budget=BUDGET)
        outs = [model6(tokens[:, :64], cache=cache)[:, -1]]
        outs += [model6(tokens[:, i : i + 1], cache=cache)[:, -1] for i in range(64, 90)]
        return mx.stack(outs, axis=1), cache

    both, cache = run(x)
    rows = [list(c.rows_budget) for c in cache]  # [layer][row]
    assert all(sum(layer[r] for layer in rows) == L * BUDGET for r in range(2))
    assert any(a != b for a, b in rows), "the two prompts should squeeze different layers"
    for r in range(2):
        alone, solo = run(x[r : r + 1])
        assert [c.budget for c in solo] == [layer[r] for layer in rows]
        assert [c.tokens_kept for c in solo] == [c.rows_held[r] for c in cache]
        assert float(mx.abs(both[r] - alone[0]).max()) < 1e-5
