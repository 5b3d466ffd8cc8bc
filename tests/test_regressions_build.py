"""Regression tests for building caches with ``make_prompt_cache``: SqueezeAttention budgets kept in
the caches (not the model), sliding-window models refused or accepted at build time, config files
and a patched ``model.make_cache``. Each test's docstring names the bug it catches."""

from __future__ import annotations

import copy
import gc
import sys
import types
import weakref

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as mlx_cache

import kvcompress
from conftest import tiny_llama
from _regression_helpers import prompt_tokens


# ------------------------------------------------------------------------------------------
# SqueezeAttention: budgets live in the caches, not in the model
# ------------------------------------------------------------------------------------------


def _caches_reachable_from(root) -> list:
    """kvcompress caches / prompt groups reachable from ``root`` through object references
    (weak references followed; module globals, classes of builtins and arrays not entered)."""
    from kvcompress.engine import Engine
    from kvcompress.group import PromptGroup

    module_dicts = {id(vars(m)) for m in list(sys.modules.values()) if m is not None and hasattr(m, "__dict__")}
    seen, stack, found = set(), [root], []
    while stack and len(seen) < 400_000:
        o = stack.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, (Engine, PromptGroup)):
            found.append(o)
            continue
        if isinstance(o, weakref.ref):
            target = o()
            if target is not None:
                stack.append(target)
            continue
        if isinstance(o, (types.ModuleType, mx.array, str, bytes, int, float)) or id(o) in module_dicts:
            continue
        if isinstance(o, type) and o.__module__ == "builtins":
            continue
        stack.extend(gc.get_referents(o))
    return found


def test_squeeze_two_caches_on_one_model_each_resplit_like_a_single_cache():
    """Bug: SqueezeAttention installed a per-call prompt recorder into the model (class swap,
    state keyed on the caches' ``id``). A second ``make_prompt_cache`` on the same model rebound
    it, so the FIRST cache list kept uniform budgets; a deep copy of a cache list was not
    recorded either; and the model kept references to the caches after generation."""
    prompt = mx.array(prompt_tokens(40))
    kw = dict(budget=16)

    alone_model = tiny_llama(n_layers=4, hidden=32, seed=5)
    alone = kvcompress.make_prompt_cache(alone_model, "squeeze", **kw)
    alone_tokens = [int(t) for t, _ in generate_step(prompt, alone_model, prompt_cache=alone, max_tokens=8)]
    budgets = [c.budget for c in alone]
    assert len(set(budgets)) > 1, f"the prompt did not re-split the budgets: {budgets}"

    model = tiny_llama(n_layers=4, hidden=32, seed=5)
    first = kvcompress.make_prompt_cache(model, "squeeze", **kw)
    pristine = copy.deepcopy(first)  # copied before the prompt
    second = kvcompress.make_prompt_cache(model, "squeeze", **kw)
    first_tokens = [int(t) for t, _ in generate_step(prompt, model, prompt_cache=first, max_tokens=8)]
    assert [c.budget for c in first] == budgets
    assert first_tokens == alone_tokens

    copy_tokens = [int(t) for t, _ in generate_step(prompt, model, prompt_cache=pristine, max_tokens=8)]
    assert [c.budget for c in pristine] == budgets and copy_tokens == alone_tokens
    second_tokens = [int(t) for t, _ in generate_step(prompt, model, prompt_cache=second, max_tokens=8)]
    assert [c.budget for c in second] == budgets and second_tokens == alone_tokens

    found = _caches_reachable_from(model)
    assert not found, f"the model holds references to {len(found)} cache object(s): {found[:3]}"


# ------------------------------------------------------------------------------------------
# Sliding-window masks are refused when the cache is built
# ------------------------------------------------------------------------------------------


def _cohere2(pattern: int):
    from mlx_lm.models import cohere2

    mx.random.seed(0)
    args = cohere2.ModelArgs(
        model_type="cohere2", hidden_size=32, head_dim=8, num_hidden_layers=2 * pattern, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=97, sliding_window=8, sliding_window_pattern=pattern,
    )
    return cohere2.Model(args)


def test_window_mask_over_full_attention_layers_is_refused_at_build():
    """Bug: a model that asks a full-attention layer's cache for a sliding-window mask (Cohere 2
    with ``sliding_window_pattern=1``: every layer is a KVCache and the window mask is made from
    layer 0's cache) built its compressed caches fine and then failed in the middle of
    generation. It is now a ConfigError from ``make_prompt_cache``.

    (A Llama with ``sliding_window`` and no ``layer_types`` is not such a model in mlx-lm 0.32:
    its ``ModelArgs`` fills ``layer_types`` with full attention and it never windows them, so it
    is -- rightly -- accepted; see the next test.)"""
    with pytest.raises(kvcompress.ConfigError, match="sliding"):
        kvcompress.make_prompt_cache(_cohere2(1), "h2o", budget=12)


def test_models_whose_window_has_rotating_caches_are_compressed():
    """Bug (found by these tests, fixed in kvcompress/factory.py): the build-time window check
    refused every model with a ``sliding_window`` and no ``layer_types`` -- Gemma 3 and Cohere 2,
    whose windowed layers have their own RotatingKVCache and whose full-attention layers are not
    windowed -- which 104e127 compressed correctly. A Llama with ``sliding_window`` but only
    full-attention layers is accepted too."""
    from mlx_lm.models import gemma3_text, llama

    mx.random.seed(0)
    gemma = gemma3_text.Model(gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=32, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        head_dim=8, num_key_value_heads=2, vocab_size=97, sliding_window=8, sliding_window_pattern=2,
    ))
    plain_llama = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=97, sliding_window=8,
    ))
    for m in (gemma, _cohere2(2), plain_llama):
        caches = kvcompress.make_prompt_cache(m, "h2o", budget=12)
        kinds = [type(c).__name__ for c in caches]
        assert "CompressedKVCache" in kinds, kinds
        toks = [int(t) for t, _ in generate_step(mx.array(prompt_tokens(30)), m, prompt_cache=caches, max_tokens=4)]
        assert len(toks) == 4
        offsets = {c.offset for c in caches if isinstance(c, kvcompress.CompressedKVCache)}
        assert len(offsets) == 1 and offsets.pop() >= 33


# ------------------------------------------------------------------------------------------
# make_prompt_cache: config files, a patched make_cache, mlx-lm's entry point
# ------------------------------------------------------------------------------------------


def test_make_prompt_cache_from_a_config_file_or_dict(tmp_path):
    """Bug: ``make_prompt_cache(model, config=...)`` did not exist: a TOML/JSON config (what the
    CLI and the docs use) had to be turned into a method by hand."""
    model = tiny_llama(n_layers=2, hidden=32, heads=4, kv_heads=2, vocab=97, seed=4)
    toml = tmp_path / "method.toml"
    toml.write_text('method = "h2o"\n[params]\nbudget = 20\nn_sink = 2\n')
    for config in (str(toml), toml, {"method": "h2o", "params": {"budget": 20, "n_sink": 2}}):
        caches = kvcompress.make_prompt_cache(model, config=config)
        assert [type(c) for c in caches] == [kvcompress.CompressedKVCache] * 2
        assert [c.budget for c in caches] == [20, 20]
        assert caches[0].method.name == "h2o" and caches[0].method.selector.n_sink == 2


def test_patched_model_make_cache_does_not_recurse():
    """Bug: ``model.make_cache = lambda: kvcompress.make_prompt_cache(model, ...)`` recursed
    (kvcompress asked ``model.make_cache()`` for the default layers), so mlx-lm's own
    ``make_prompt_cache(model)`` -- used by ``generate_step`` without a prompt cache -- could
    not return compressed caches."""
    model = tiny_llama(n_layers=2, hidden=32, heads=4, kv_heads=2, vocab=97, seed=4)
    model.make_cache = lambda: kvcompress.make_prompt_cache(model, "h2o", budget=12)
    caches = mlx_cache.make_prompt_cache(model)
    assert [type(c) for c in caches] == [kvcompress.CompressedKVCache] * 2
    toks = [int(t) for t, _ in generate_step(mx.array(prompt_tokens(30)), model, max_tokens=5)]
    direct = kvcompress.make_prompt_cache(model, "h2o", budget=12)
    assert toks == [int(t) for t, _ in generate_step(mx.array(prompt_tokens(30)), model, prompt_cache=direct, max_tokens=5)]
