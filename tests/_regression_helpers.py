"""Shared by the regression tests ``tests/test_regressions_*.py`` -- one test per bug of the review
"Core contracts, one attention path, and the bugs a review found" (each fails on commit 104e127 and
passes since the engine rewrite), plus the bugs these tests found afterwards: per-method caches,
prompts, greedy steps and the positions a cache holds. Their ``model`` fixture is in conftest.py."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

import kvcompress
from conftest import tiny_llama

METHODS = sorted(kvcompress.get_registry().methods)
#: small windows / chunks so that small budgets evict (the methods' defaults are 32 / 10)
PARAMS = {
    "snapkv": dict(recent=4),
    "pyramidkv": dict(recent=4),
    "snapkv_merge": dict(recent=4),
    "chunkkv": dict(recent=4, chunk=4),
    "tova_chunk": dict(chunk=4),
    "selfinfo": dict(recent=4, span=4, step=4),
    "adakv": dict(recent=4, step=4),
}


def caches_for(model, method: str, want: int = 12, **params) -> list:
    """``make_prompt_cache`` with the smallest budget >= ``want`` the method accepts."""
    params = {**PARAMS.get(method, {}), **params}
    b = max(want, kvcompress.build_method(method, **params).selector.reserved(want) + 1)
    for _ in range(64):
        try:
            return kvcompress.make_prompt_cache(model, method, budget=b, **params)
        except kvcompress.ConfigError:
            b += 1
    raise AssertionError(f"no budget accepted by {method}")


def prompt_tokens(n: int, salt: int = 0) -> list:
    return [(7 * i + 3 + salt) % 96 + 1 for i in range(n)]


def greedy(model, caches, token: int, n: int):
    """``n`` greedy steps from ``token``: (tokens, float32 logits of each step)."""
    toks, logits = [], []
    for _ in range(n):
        out = model(mx.array([[token]]), cache=caches)[0, -1].astype(mx.float32)
        token = int(mx.argmax(out).item())
        toks.append(token)
        logits.append(np.array(out))
    return toks, logits


def held(c, row: int = 0) -> np.ndarray:
    """``[H, W]`` sorted positions each KV head holds, padded with -1 (head-wise budgets let
    heads hold different counts)."""
    pos = np.array(c.head_view()[2])[row]
    rows = [np.sort(p[p >= 0]) for p in pos]
    w = max(len(r) for r in rows)
    return np.stack([np.pad(r, (0, w - len(r)), constant_values=-1) for r in rows])


@functools.lru_cache(maxsize=None)
def batches_uneven(method: str) -> bool:
    """Whether the method's caches batch rows that free different numbers of slots in one step
    (a method that cannot refuses with ConfigError, and the batch rules skip it; every built-in
    method can -- KIVI's batch rows are tested directly in test_kivi_batch.py)."""
    m = tiny_llama(n_layers=1, hidden=32, heads=4, kv_heads=2, vocab=97, seed=1)
    a, b = caches_for(m, method), caches_for(m, method)
    m(mx.array([prompt_tokens(30)]), cache=a)
    m(mx.array([prompt_tokens(3)]), cache=b)
    batch = [type(x).merge([x, y]) for x, y in zip(a, b)]
    try:
        mx.eval(m(mx.array([[5], [6]]), cache=batch))
    except kvcompress.ConfigError:
        return False
    return True
