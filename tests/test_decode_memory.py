"""Memory held while decoding stays bounded, below the budget and above it, for every method.

mlx-lm's ``generate_step`` evaluates only the model's output each step. Whatever a cache updates
that the output does not depend on (scores accumulated below the budget, positions, a scorer's
state) would stay a lazy graph growing by one step per token and holding every step's keys; the
attention wrapper ties it to the output. A regression shows up as active memory growing by a
whole keys buffer per layer and token (megabytes here) where the cache itself grows by bytes.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import kvcompress
from conftest import tiny_llama

METHODS = sorted(kvcompress.get_registry().methods)
PROMPT = 160
STEPS = 60
#: bytes a cache may legitimately add over STEPS tokens (KIVI keeps every token, quantized;
#: the others hold a bounded cache or grow by a few bytes of positions and scores per token)
SLACK = 256 * 1024


def _active_after(model, cache, prompt, marks) -> dict:
    out = {}
    gen = generate_step(prompt, model, prompt_cache=cache, max_tokens=max(marks) + 2, prefill_step_size=64)
    for i, _ in enumerate(gen):
        if i in marks:
            mx.synchronize()
            out[i] = mx.get_active_memory()
        if i >= max(marks):
            break
    gen.close()
    return out


@pytest.mark.parametrize("budget", [4096, 96], ids=["below_budget", "evicting"])
@pytest.mark.parametrize("method", METHODS)
def test_decode_memory_does_not_grow_per_token(method, budget):
    model = tiny_llama(n_layers=3, hidden=128, heads=4, kv_heads=2, seed=3)
    prompt = mx.array(np.random.default_rng(3).integers(0, 97, PROMPT), dtype=mx.int32)
    cache = kvcompress.make_prompt_cache(model, method, budget=budget)
    mem = _active_after(model, cache, prompt, (10, 10 + STEPS))
    # one leaked keys buffer per layer and step would be >= STEPS * 3 * PROMPT * 2 * 32 * 4 bytes
    leak = STEPS * 3 * PROMPT * 2 * 32 * 4
    assert SLACK < leak / 4
    assert mem[10 + STEPS] - mem[10] < SLACK, (method, budget, mem)


def test_proxy_scored_decode_memory_does_not_grow(monkeypatch):
    """A model whose attention bypasses mlx-lm's function (key-as-query proxy scores, computed at
    the next step's update): those scores are tied to the keys the model reads, so the lazy
    graph spans one step, not the whole generation."""
    import warnings

    from kvcompress.engine import attend as _engine_attend
    from test_real_queries import _BypassModel

    monkeypatch.setattr(_engine_attend, "_proxy_warned", True)
    mx.random.seed(0)
    model = _BypassModel(dim=128, heads=4, n_layers=3)
    mx.eval(model.parameters())
    cache = kvcompress.make_prompt_cache(model, "h2o", budget=4096)
    mx.eval(model(mx.array(np.random.default_rng(4).integers(0, 50, (1, PROMPT)), dtype=mx.int32), cache=cache))
    tok, mem = mx.array([[1]], dtype=mx.int32), {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(10 + STEPS + 1):
            tok = mx.argmax(model(tok, cache=cache)[:, -1:], axis=-1)
            mx.eval(tok)
            if i in (10, 10 + STEPS):
                mx.synchronize()
                mem[i] = mx.get_active_memory()
    assert all(c.score_source == "proxy" for c in cache)
    assert mem[10 + STEPS] - mem[10] < SLACK, mem


@pytest.mark.parametrize("method", ["h2o", "cam"])
def test_batch_generator_decode_memory_does_not_grow(method):
    """The same through mlx-lm's continuous batching (``BatchGenerator``: one batch cache, rows
    of different lengths), below the budget."""
    from mlx_lm.generate import BatchGenerator

    model = tiny_llama(n_layers=3, hidden=128, heads=4, kv_heads=2, seed=3)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 97, n).tolist() for n in (PROMPT, PROMPT - 40)]
    caches = [kvcompress.make_prompt_cache(model, method, budget=4096) for _ in prompts]
    gen = BatchGenerator(model, max_tokens=10 + STEPS + 5, prefill_step_size=64)
    gen.insert(prompts, caches=caches)
    mem, steps = {}, 0
    for _ in range(10 * STEPS):
        _, responses = gen.next()
        steps += bool(responses)
        if steps in (10, 10 + STEPS) and steps not in mem:
            mx.synchronize()
            mem[steps] = mx.get_active_memory()
        if steps > 10 + STEPS:
            break
    gen.close()
    assert mem[10 + STEPS] - mem[10] < SLACK, mem
