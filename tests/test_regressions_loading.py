"""Regression tests (issue 22, part 1): a cache list meets a model it was not prepared for.

A cache loaded in a fresh process and continued with mlx-lm's idiom (``load_prompt_cache`` +
``generate_step``) continues exactly like the uninterrupted run for every registered method, with
either loader, from a prompted or an empty saved cache; a model defined outside mlx-lm's package
gets the query-observing wrapper too; what cannot be exact without the model hook is refused
before the cache changes; a cache list made for a model with another layer count is refused.
Each test's docstring names the bug it catches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import kvcompress
from _regression_helpers import METHODS, caches_for, prompt_tokens
from conftest import REPO, tiny_llama

MODEL_KW = dict(n_layers=2, hidden=32, heads=4, kv_heads=2, vocab=97, seed=11)
FIRST, SECOND, STEPS = prompt_tokens(64, salt=1), prompt_tokens(9, salt=5), 12

_CONTINUE = '''
def continue_run(model, caches, prompt, steps):
    """generate_step (mlx-lm's idiom) over ``prompt``: the tokens, a digest of every step's
    log-probabilities, each layer's score source and tokens seen."""
    import hashlib
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step
    h, toks = hashlib.sha256(), []
    for tok, logprobs in generate_step(mx.array(prompt), model, prompt_cache=caches, max_tokens=steps):
        toks.append(int(tok))
        h.update(np.array(logprobs.astype(mx.float32)).tobytes())
    return {"tokens": toks, "digest": h.hexdigest(), "sources": [c.score_source for c in caches],
            "offsets": [c.offset for c in caches], "budgets": [c.budget for c in caches]}
'''

_CHILD = '''
import json, sys, types
sys.path.insert(0, {tests!r})
{prelude}
import kvcompress
from mlx_lm.models.cache import load_prompt_cache as mlx_load
{continue_src}
model = {build}
out = {{}}
for key, path in {jobs!r}:
    loader = mlx_load if key.endswith(":mlx") else kvcompress.load_prompt_cache
    caches = loader(path)
    try:
        out[key] = continue_run(model, caches, {second!r}, {steps})
    except Exception as exc:
        out[key] = {{"error": f"{{type(exc).__name__}}: {{exc}}"}}
print("RESULT" + json.dumps(out))
'''


def _child(jobs, build="tiny_llama(**{kw!r})", prelude="from conftest import tiny_llama") -> dict:
    code = _CHILD.format(tests=str(REPO / "tests"), prelude=prelude, continue_src=_CONTINUE,
                         build=build.format(kw=MODEL_KW), jobs=jobs, second=SECOND, steps=STEPS)
    env = dict(os.environ)
    root = Path(kvcompress.__file__).parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "plugins"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


def _continue(model, caches):
    scope: dict = {}
    exec(_CONTINUE, scope)
    return scope["continue_run"](model, caches, SECOND, STEPS)


@pytest.fixture(scope="module")
def fresh_process_runs(tmp_path_factory):
    """Per method and saved state (``prompted``: after a prompt and 4 decode steps, ``empty``:
    straight from make_prompt_cache): the uninterrupted run, and the run of the saved file in one
    fresh process through each loader."""
    tmp = tmp_path_factory.mktemp("fresh")
    model = tiny_llama(**MODEL_KW)
    jobs, expected = [], {}
    for method in METHODS:
        for state in ("prompted", "empty"):
            caches = caches_for(model, method, 24)
            if state == "prompted":
                for _ in generate_step(mx.array(FIRST), model, prompt_cache=caches, max_tokens=4):
                    pass
                assert caches[0].evictions > 0, method  # the saved cache has already evicted
            path = str(tmp / f"{method}-{state}.safetensors")
            kvcompress.save_prompt_cache(path, caches)
            expected[f"{method}:{state}"] = _continue(model, caches)
            jobs += [(f"{method}:{state}:kvcompress", path), (f"{method}:{state}:mlx", path)]
    return expected, _child(jobs)


@pytest.mark.parametrize("method", METHODS)
def test_a_cache_loaded_in_a_fresh_process_continues_like_the_uninterrupted_run(fresh_process_runs, method):
    """Bug: in a fresh process mlx-lm's idiom (``load_prompt_cache`` + ``generate``) never installed
    the model hook, so kvzip refused its first step and a saved empty squeeze cache never re-split
    its budgets (uniform budgets, a different continuation, no error). mlx-lm's ``generate_step``
    now installs the hook when given kvcompress caches: every method, from a prompted or an empty
    saved cache, through kvcompress's or mlx-lm's loader, continues bit-exactly (tokens,
    log-probabilities, score sources, budgets)."""
    expected, got = fresh_process_runs
    for state in ("prompted", "empty"):
        want = expected[f"{method}:{state}"]
        for loader in ("kvcompress", "mlx"):
            run = got[f"{method}:{state}:{loader}"]
            assert "error" not in run, (state, loader, run.get("error"))
            assert run == want, (state, loader)


_CUSTOM = '''
CUSTOM = """
from mlx_lm.models import llama
from mlx_lm.models.base import scaled_dot_product_attention


class Attention(llama.Attention):
    def __call__(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        o = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))


def build(model):
    for layer in model.layers:
        layer.self_attn.__class__ = Attention
    return model
"""
custom = types.ModuleType("custom_attention")
exec(CUSTOM, custom.__dict__)
sys.modules["custom_attention"] = custom
'''


def test_a_model_defined_outside_mlx_lm_scores_with_real_queries_after_loading(tmp_path):
    """Bug: the attention wrapper reached only ``mlx_lm.models.*`` modules on its own (other
    modules only through ``kvcompress.install(model)``), so a model whose attention lives in the
    user's own module, with a cache loaded in a fresh process, fell back to the key-as-query proxy
    (score source "mixed") and evicted other tokens. Every module holding mlx-lm's attention
    function is now wrapped: the continuation is exact, with real-query scores."""
    import types

    scope = {"types": types, "sys": sys}
    exec(_CUSTOM, scope)
    model = scope["custom"].build(tiny_llama(**MODEL_KW))
    caches = caches_for(model, "h2o", 16, recent_ratio=0.0)
    for _ in generate_step(mx.array(FIRST), model, prompt_cache=caches, max_tokens=4):
        pass
    path = str(tmp_path / "h2o.safetensors")
    kvcompress.save_prompt_cache(path, caches)
    want = _continue(model, caches)
    assert want["sources"] == ["queries"] * 2
    got = _child([("h2o:kvcompress", path)], build="custom.build(tiny_llama(**{kw!r}))",
                 prelude="from conftest import tiny_llama\n" + _CUSTOM)
    assert got["h2o:kvcompress"] == want


def _saved(model, method, tmp_path, prompt=True, **params):
    caches = caches_for(model, method, 16, **params)
    if prompt:
        model(mx.array([FIRST]), cache=caches)
    path = str(tmp_path / f"{method}.safetensors")
    kvcompress.save_prompt_cache(path, caches)
    return path


def _state(caches) -> list:
    return [(c.offset, c.tokens_kept, list(c.rows_budget), c.score_source) for c in caches]


def test_steps_that_need_the_model_hook_are_refused_without_it(tmp_path):
    """Bug: a loaded empty squeeze cache used with ``model(...)`` directly (no model hook, so no
    layer input/output) never re-split its budgets: every layer kept the uniform budget, silently.
    That step is now refused before the cache changes, naming kvcompress.install; after install
    the same call re-splits the budgets as a fresh cache does."""
    built = tiny_llama(n_layers=4, hidden=32, heads=4, kv_heads=2, vocab=97, seed=3)
    path = _saved(built, "squeeze", tmp_path, prompt=False)
    fresh = kvcompress.make_prompt_cache(built, "squeeze", budget=16)
    built(mx.array([FIRST]), cache=fresh)
    assert len({c.budget for c in fresh}) > 1  # the fresh cache re-splits

    other = tiny_llama(n_layers=4, hidden=32, heads=4, kv_heads=2, vocab=97, seed=3)  # no hook
    loaded = kvcompress.load_prompt_cache(path)
    before = _state(loaded)
    with pytest.raises(kvcompress.KVCompressError, match=r"layer's input and attention output.*kvcompress\.install"):
        other(mx.array([FIRST]), cache=loaded)
    assert _state(loaded) == before
    kvcompress.install(other)
    other(mx.array([FIRST]), cache=loaded)
    assert [c.budget for c in loaded] == [c.budget for c in fresh]


def test_a_cache_that_scored_with_real_queries_never_continues_with_the_proxy():
    """Bug: a cache whose steps had been scored with the real queries silently continued with the
    key-as-query proxy (score source "mixed", other evictions, one RuntimeWarning per process)
    when the model stopped calling mlx-lm's attention function with it. The next step is now
    refused."""
    model = tiny_llama(n_layers=1, hidden=32, heads=4, kv_heads=2, vocab=97, seed=4)
    caches = caches_for(model, "h2o", 12, recent_ratio=0.0)
    model(mx.array([FIRST]), cache=caches)
    c = caches[0]
    assert c.score_source == "queries"
    k = mx.zeros((1, 2, 1, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        c.update_and_fetch(k, k)  # a step attended without the wrapper: nobody observes it
        seen = c.offset
        with pytest.raises(kvcompress.KVCompressError, match="real queries.*key-as-query proxy"):
            c.update_and_fetch(k, k)
    assert c.offset == seen and c.score_source == "queries"


@pytest.mark.parametrize("n_layers", [3, 7])
def test_a_cache_list_made_for_another_layer_count_is_refused(tmp_path, n_layers):
    """Bug: a file saved for a 5-layer model continued without error on a 3- or 7-layer model
    of the same head shape (mlx-lm models zip their layers with the cache list: layers never
    updated, or never run). ``generate_step``, a hooked model, ``load_prompt_cache(model=)`` and
    the cache itself (for an unhooked model that runs fewer layers) now refuse it, before the step
    changes any cache."""
    five = tiny_llama(n_layers=5, hidden=32, heads=4, kv_heads=2, vocab=97, seed=2)
    path = _saved(five, "h2o", tmp_path)
    other = tiny_llama(n_layers=n_layers, hidden=32, heads=4, kv_heads=2, vocab=97, seed=2)
    with pytest.raises(kvcompress.CacheMismatch, match=rf"holds 5 layer cache\(s\).*runs {n_layers} layer"):
        kvcompress.load_prompt_cache(path, model=other)
    loaded = kvcompress.load_prompt_cache(path)
    before = _state(loaded)
    with pytest.raises(kvcompress.CacheMismatch, match="use the cache with the model it was made for"):
        next(generate_step(mx.array(SECOND), other, prompt_cache=loaded, max_tokens=2))
    assert _state(loaded) == before
    with pytest.raises(kvcompress.CacheMismatch):  # the model is hooked now: any call checks
        other(mx.array([SECOND]), cache=loaded)
    assert _state(loaded) == before
    # the same list on its own model runs
    assert [int(t) for t, _ in generate_step(mx.array(SECOND), five, prompt_cache=loaded, max_tokens=2)]


def test_an_unhooked_model_with_fewer_layers_is_refused_at_its_next_forward(tmp_path):
    """Bug: without the model hook (``model(...)`` called directly on a loaded list), a 3-layer
    model used the first 3 of 5 layer caches and never updated the others, silently. The first
    layer's next update now finds the others left behind and refuses the step."""
    five = tiny_llama(n_layers=5, hidden=32, heads=4, kv_heads=2, vocab=97, seed=2)
    path = _saved(five, "h2o", tmp_path)
    three = tiny_llama(n_layers=3, hidden=32, heads=4, kv_heads=2, vocab=97, seed=2)
    loaded = kvcompress.load_prompt_cache(path)
    three(mx.array([SECOND]), cache=loaded)  # the first forward cannot tell
    seen = [c.offset for c in loaded]
    with pytest.raises(kvcompress.KVCompressError, match=r"not layer\(s\) \[3, 4\].*more layers than the model runs"):
        three(mx.array([[5]]), cache=loaded)
    assert [c.offset for c in loaded] == seen


def test_the_model_hook_leaves_plain_mlx_lm_caches_alone():
    """The model hook checks and prepares only lists holding kvcompress caches: a hooked model
    called with mlx-lm's own caches computes exactly what the same model without the hook does."""
    from mlx_lm.models.cache import make_prompt_cache

    hooked, plain = (tiny_llama(n_layers=2, hidden=32, heads=4, kv_heads=2, vocab=97, seed=6) for _ in range(2))
    kvcompress.install(hooked)
    assert type(hooked) is not type(plain)
    a, b = make_prompt_cache(hooked), make_prompt_cache(plain)
    for step in (SECOND, [5], [9]):
        x, y = hooked(mx.array([step]), cache=a), plain(mx.array([step]), cache=b)
        assert mx.array_equal(x, y).item()
