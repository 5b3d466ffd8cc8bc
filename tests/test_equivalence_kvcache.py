"""Exactness of the compressed cache against mlx-lm's ``KVCache`` while nothing is evicted.

* With a budget >= the sequence length every registered method is *the same computation* as
  ``KVCache``: same greedy tokens, same log-probabilities, same logits, for any
  ``prefill_step_size`` of ``mlx_lm.generate.generate_step``.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache

import kvcompress
from _equivalence_helpers import ATOL, METHODS, fresh_tiny, maxdiff, prefill_chunks, token_ids
from conftest import models_dir
from kvcompress import ConfigError

PREFILL_STEPS = [1, 3, 16, 4096]
ROOMY = 4096  # a budget no layer goes below the test lengths with (budgets may differ per layer)

STORIES_PROMPT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park with her friends. One day, she saw a big red ball under a tree."
)


# ------------------------------------------------------------------------------------------------
# Budget >= sequence length: identical to KVCache
# ------------------------------------------------------------------------------------------------


def fresh_stories(stories_model):
    """A fresh copy of the trained model (the session fixture decides whether it exists)."""
    import mlx_lm

    return mlx_lm.load(str(models_dir() / "stories260K"))


_REFERENCE: dict = {}


def _reference_generate(key, model, prompt, step, max_tokens):
    """KVCache greedy run, computed once per (model kind, prompt, step) for the whole module."""
    k = (key, tuple(prompt.tolist()), step, max_tokens)
    if k not in _REFERENCE:
        _REFERENCE[k] = _generate(model, prompt, [KVCache() for _ in model.layers], step, max_tokens)
    return _REFERENCE[k]


def _generate(model, prompt, cache, step, max_tokens):
    toks, lps = [], []
    for t, lp in generate_step(prompt, model, prompt_cache=cache, prefill_step_size=step, max_tokens=max_tokens):
        toks.append(t)
        lps.append(lp)
    return toks, lps


def _assert_generate_equivalent(key, model, prompt, method, step, max_tokens, budget, must_check=True):
    """Greedy ``generate_step`` with ``method`` vs with ``KVCache``: same tokens, same logprobs.

    Returns False (nothing compared) only when ``must_check`` is off and the method cannot hold
    ``budget`` tokens in every layer (it protects more, or re-splits the budget across layers).
    """
    seen = len(prompt) + max_tokens  # generate_step feeds the last yielded token too
    try:
        cache = kvcompress.make_prompt_cache(model, method, budget=budget)
    except ConfigError:
        assert not must_check
        return False
    ref_toks, ref_lps = _reference_generate(key, model, prompt, step, max_tokens)
    toks, lps = _generate(model, prompt, cache, step, max_tokens)
    compressed = [c for c in cache if isinstance(c, kvcompress.CompressedKVCache)]
    assert compressed
    if min(c.budget for c in compressed) < seen:
        assert not must_check, f"a layer budget fell below the {seen} tokens fed"
        return False
    assert toks == ref_toks
    for i, (a, b) in enumerate(zip(lps, ref_lps)):
        assert maxdiff(a, b) <= ATOL, f"logprobs differ at generated token {i}"
    for c in compressed:
        assert c.offset == seen and c.size() == seen and c.evictions == 0
    return True


@pytest.mark.parametrize("step", PREFILL_STEPS)
@pytest.mark.parametrize("method", METHODS)
def test_generate_step_matches_kvcache_tiny(method, step):
    prompt = token_ids(29, 97, seed=1)
    # budget == tokens fed exactly (the tightest budget that must not evict), when the method
    # can hold it in every layer; and a budget every layer of every method holds
    args = (prompt, method, step, 8)
    _assert_generate_equivalent("tiny", fresh_tiny(), *args, budget=29 + 8, must_check=False)
    _assert_generate_equivalent("tiny", fresh_tiny(), *args, budget=ROOMY)


@pytest.mark.model
@pytest.mark.parametrize("step", [1, 16, 4096])
@pytest.mark.parametrize("method", METHODS)
def test_generate_step_matches_kvcache_stories(stories_model, method, step):
    _, tokenizer = stories_model
    prompt = mx.array(tokenizer.encode(STORIES_PROMPT))
    args = (prompt, method, step, 16)
    model, _ = fresh_stories(stories_model)
    if not _assert_generate_equivalent("stories", model, *args, len(prompt) + 16, must_check=False):
        model, _ = fresh_stories(stories_model)
        _assert_generate_equivalent("stories", model, *args, budget=ROOMY)


def _assert_direct_loop_equivalent(model, tokens, method, step, n_decode):
    """Teacher-forced model calls: every logit row of every prefill chunk and decode step."""
    ref = [KVCache() for _ in model.layers]
    cache = kvcompress.make_prompt_cache(model, method, budget=ROOMY)
    n_prompt = tokens.shape[1] - n_decode
    spans = prefill_chunks(n_prompt, step) + [(i, i + 1) for i in range(n_prompt, tokens.shape[1])]
    for i, j in spans:
        a = model(tokens[:, i:j], cache=cache)
        b = model(tokens[:, i:j], cache=ref)
        assert a.shape == b.shape == (tokens.shape[0], j - i, a.shape[-1])
        assert maxdiff(a, b) <= ATOL, f"logits differ on tokens [{i}, {j})"
        for c, r in zip(cache, ref):
            assert c.offset == r.offset == j and c.evictions == 0
            ck, cv = c.head_view()[:2]
            rk, rv = r.keys_and_values()
            assert mx.array_equal(ck, rk) and mx.array_equal(cv, rv)


@pytest.mark.parametrize("step", PREFILL_STEPS)
@pytest.mark.parametrize("method", METHODS)
def test_direct_loop_matches_kvcache_tiny(method, step):
    tokens = mx.stack([token_ids(30, 97, seed=2), token_ids(30, 97, seed=3)])  # batch 2
    _assert_direct_loop_equivalent(fresh_tiny(), tokens, method, step, n_decode=6)


@pytest.mark.model
@pytest.mark.parametrize("method", METHODS)
def test_direct_loop_matches_kvcache_stories(stories_model, method):
    model, tokenizer = fresh_stories(stories_model)
    tokens = mx.array(tokenizer.encode(STORIES_PROMPT))[None]
    _assert_direct_loop_equivalent(model, tokens, method, 7, n_decode=6)
