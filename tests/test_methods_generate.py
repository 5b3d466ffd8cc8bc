"""The sibling methods inside real generation (tiny random Llama with GQA, and the trained
stories260K model when present).

* With a budget >= the sequence length each method *is* ``KVCache``: same greedy tokens and
  the same log-probabilities through ``generate_step`` with chunked prefill and decode.
* With eviction each method runs through ``generate_step`` / ``stream_generate``: every layer
  holds its own budget (pyramid budgets differ per layer), scores come from the real queries,
  and a batch of 2 gives each row exactly what that row gives alone.
* Per-layer budgets never break the one mask mlx-lm builds per forward: in a multi-token chunk
  after eviction every layer's attention equals attention under the explicit positional mask
  (key position <= query position) over that layer's own kept tokens.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step, stream_generate
from mlx_lm.models.cache import KVCache

import kvcompress
from conftest import tiny_llama
from kvcompress import CompressedKVCache

# Parameters under which each method evicts on the tiny prompts below.
SMALL = {
    "streaming_llm": dict(budget=16),
    "streaming_llm_shift": dict(budget=16, n_sink=2),
    "snapkv": dict(budget=24, recent=6, kernel=3),
    "tova": dict(budget=16),
    "pyramidkv": dict(budget=24, recent=4, kernel=3, beta=4.0),
    "chunkkv": dict(budget=40, recent=6, chunk=4),
    "snapkv_merge": dict(budget=24, recent=6, kernel=3, beta=4.0),
    "tova_chunk": dict(budget=24, chunk=4),
    "h2o_pyramid": dict(budget=24, beta=2.0),
    "selfinfo": dict(budget=24, span=4, step=4, recent=4, n_sink=1),
}
METHODS = list(SMALL)
PER_LAYER = ["pyramidkv", "snapkv_merge", "h2o_pyramid"]


def tokens(n, batch=1, seed=0):
    return mx.array(np.random.default_rng(seed).integers(0, 97, (batch, n)), dtype=mx.int32)


def run_generate(model, cache, prompt, n_tokens, step):
    out = list(zip(range(n_tokens), generate_step(prompt, model, prompt_cache=cache, prefill_step_size=step)))
    toks = [int(t) for _, (t, _) in out]
    logprobs = mx.stack([lp for _, (_, lp) in out])
    return toks, logprobs


@pytest.mark.parametrize("step", [7, 64])
@pytest.mark.parametrize("method", METHODS)
def test_full_budget_is_kvcache(method, step):
    model = tiny_llama(n_layers=3, seed=1)
    prompt = tokens(50, seed=1)[0]
    cache = kvcompress.make_prompt_cache(model, method, budget=4096)
    got_t, got_lp = run_generate(model, cache, prompt, 12, step)
    ref_t, ref_lp = run_generate(model, [KVCache() for _ in model.layers], prompt, 12, step)
    assert got_t == ref_t
    assert mx.array_equal(got_lp, ref_lp)
    assert all(c.evictions == 0 and c.offset == 50 + 12 for c in cache)  # generate_step runs one ahead


@pytest.mark.parametrize("method", METHODS)
def test_generate_step_with_eviction(method):
    model = tiny_llama(n_layers=3, seed=2)
    cache = kvcompress.make_prompt_cache(model, method, **SMALL[method])
    toks, lp = run_generate(model, cache, tokens(60, seed=2)[0], 20, 8)
    assert len(toks) == 20 and np.isfinite(np.array(lp)).all()
    budgets = [c.budget for c in cache]
    assert (len(set(budgets)) == 3) == (method in PER_LAYER)
    for c in cache:
        assert c.evictions > 0 and c.score_source == "queries" and c.offset == 60 + 20
        if "chunk" in method:  # whole chunks may free up to c - 1 extra slots until refilled
            assert c.budget - 4 < c.size() <= c.budget
        else:
            assert c.size() == c.budget


@pytest.mark.parametrize("method", METHODS)
def test_batch_rows_match_single_row_runs(method):
    """Batch of 2 with GQA (4 query / 2 KV heads): every row evicts on its own scores."""
    model = tiny_llama(n_layers=2, seed=3)
    batch = tokens(56, batch=2, seed=3)

    params = dict(SMALL[method])  # snapkv_merge keeps CaM's gate: its draws are per row

    def feed(x):
        cache = kvcompress.make_prompt_cache(model, method, **params)
        outs = [model(x[:, i : i + 8], cache=cache)[:, -1] for i in range(0, 48, 8)]
        outs += [model(x[:, i : i + 1], cache=cache)[:, -1] for i in range(48, 56)]
        return mx.stack(outs, axis=1), cache

    both, cache = feed(batch)
    assert all(c.evictions > 0 for c in cache)
    if cache[0].method.config.disposition.name == "gated_merge":  # the gated merges happened
        assert sum(int(mx.sum(c.component_state("disposition").merges)) for c in cache) > 0
    for row in range(2):
        alone, _ = feed(batch[row : row + 1])
        assert np.abs(np.array(both[row]) - np.array(alone[0])).max() < 1e-4


@pytest.mark.parametrize("method", PER_LAYER)
def test_per_layer_budgets_keep_masks_exact(method, monkeypatch):
    model = tiny_llama(n_layers=3, seed=4)
    cache = kvcompress.make_prompt_cache(model, method, **SMALL[method])
    x = tokens(90, seed=4)
    for i in range(0, 72, 12):
        model(x[:, i : i + 12], cache=cache)
    assert all(c.evictions > 0 for c in cache)

    seen = []
    attend = CompressedKVCache.attend

    def spy(self, sdpa, queries, keys, values, scale, mask, sinks=None):
        out = attend(self, sdpa, queries, keys, values, scale, mask, sinks)
        seen.append((self.offset, np.array(self.slot_positions), queries, keys, values, scale, mask, out))
        return out

    monkeypatch.setattr(CompressedKVCache, "attend", spy)
    model(x[:, 72:85], cache=cache)  # a 13-token chunk after eviction
    assert len(seen) == 3 and len({k.shape[2] for _, _, _, k, *_ in seen}) == 3
    for offset, pos, q, k, v, scale, mask, out in seen:
        n = q.shape[2]
        g = q.shape[1] // k.shape[1]
        kk, vv = np.repeat(np.array(k), g, axis=1), np.repeat(np.array(v), g, axis=1)
        logits = np.einsum("bhqd,bhkd->bhqk", np.array(q), kk) * scale
        q_pos = np.arange(offset - n, offset)
        allowed = np.repeat(pos, g, axis=1)[:, :, None, :] <= q_pos[None, None, :, None]
        logits = np.where(allowed, logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        ref = np.einsum("bhqk,bhkd->bhqd", w / w.sum(-1, keepdims=True), vv)
        assert np.abs(np.array(out) - ref).max() < 1e-5


@pytest.mark.model
@pytest.mark.parametrize("method", METHODS)
def test_stream_generate_on_trained_model(method, stories_model, stories_text):
    import mlx_lm

    from conftest import models_dir

    model, tokenizer = mlx_lm.load(str(models_dir() / "stories260K"))  # components bind per model
    prompt = stories_text[:600]
    n_prompt = len(tokenizer.encode(prompt))
    params = dict(SMALL[method])
    params["budget"] = max(params["budget"], 48)
    cache = kvcompress.make_prompt_cache(model, method, **params)
    pieces = list(stream_generate(model, tokenizer, prompt, max_tokens=16, prompt_cache=cache, prefill_step_size=64))
    assert len(pieces) == 16 and all(np.isfinite(p.logprobs).all() for p in pieces[:1])
    assert n_prompt > 2 * params["budget"]
    for c in cache:
        assert c.evictions > 0 and c.score_source == "queries" and c.size() <= c.budget


def _batch_generate(model, prompts, caches, n_tokens, step):
    """mlx-lm's continuous batching (``BatchGenerator``): the per-sequence caches are merged
    into one batch cache, prompts of different lengths are right-padded chunk by chunk."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=n_tokens, prefill_step_size=step)
    uids = gen.insert(prompts, caches=caches)
    toks, lps = {u: [] for u in uids}, {u: [] for u in uids}
    for _ in range(10 * n_tokens + 100):
        _, responses = gen.next()
        for r in responses:
            toks[r.uid].append(r.token)
            lps[r.uid].append(r.logprobs)
        if all(len(toks[u]) >= n_tokens for u in uids):
            break
    gen.close()
    return [(toks[u], mx.stack(lps[u])) for u in uids]


@pytest.mark.parametrize("method", METHODS)
def test_batch_generator_rows_of_different_lengths_match_single_runs(method):
    """Rows of different lengths batched by mlx-lm (merge, right-padded prompt chunks, finalize)
    generate what each prompt generates alone: same tokens, same log-probabilities. In a chunk
    that right-pads a row, the components see the tokens the row has really seen (a shifted
    key, a gate draw, a recent window do not count the padding)."""
    model = tiny_llama(n_layers=2, seed=5)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 97, n).tolist() for n in (61, 45, 23)]
    step, n_tokens = 9, 6
    alone = [run_generate(model, kvcompress.make_prompt_cache(model, method, **SMALL[method]),
                          mx.array(p), n_tokens, step) for p in prompts]
    caches = [kvcompress.make_prompt_cache(model, method, **SMALL[method]) for _ in prompts]
    batched = _batch_generate(model, prompts, caches, n_tokens, step)
    for (t, lp), (ref_t, ref_lp) in zip(batched, alone):
        assert t == ref_t
        assert float(mx.abs(lp - ref_lp).max()) < 1e-4
