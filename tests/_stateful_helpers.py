"""Shared by the stateful cache tests: the tiny models and per-method caches they run, and what a
cache holds read through its public protocol."""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

import kvcompress
from _regression_helpers import caches_for
from conftest import tiny_llama

METHODS = sorted(kvcompress.get_registry().methods)
VOCAB = 97
WANT_BUDGET = 12
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@functools.lru_cache(maxsize=None)
def model_for(dtype: str):
    return tiny_llama(n_layers=2, hidden=32, heads=4, kv_heads=2, vocab=VOCAB, seed=3, dtype=DTYPES[dtype])


def make_line_caches(model, method: str) -> list:
    """``make_prompt_cache`` with the smallest budget >= 12 the method accepts."""
    return caches_for(model, method, WANT_BUDGET)


def held_positions(c, row: int = 0) -> np.ndarray:
    """``[H, kept]`` sorted positions each KV head holds (``state[-3]`` is the slot positions)."""
    if c.empty():
        return np.zeros((0, 0), np.int64)
    return _held(np.array(c.head_view()[2])[row])


def read_caches(caches: list, dtype) -> dict:
    """``{id(cache): [per row: [H, kept] sorted held positions]}`` for many caches with one
    device sync; also checks that the stored keys/values have ``dtype`` and are finite."""
    lazy = []
    for c in caches:
        if c.empty():
            lazy.append(None)
            continue
        state = c.state
        k, v = state[-5], state[-4]
        assert k.dtype == dtype and v.dtype == dtype, f"stored K/V are {k.dtype}/{v.dtype}, not {dtype}"
        lazy.append((c.head_view()[2], mx.isfinite(k).all() & mx.isfinite(v).all()))
    mx.eval([x for x in lazy if x is not None])
    out = {}
    for c, x in zip(caches, lazy):
        rows = len(c.offset.tolist()) if isinstance(c, kvcompress.BatchCompressedKVCache) else 1
        if x is None:
            out[id(c)] = [np.zeros((0, 0), np.int64)] * rows
            continue
        assert x[1].item(), f"{c!r}: non-finite stored keys/values"
        pos = np.array(x[0])
        out[id(c)] = [_held(p) for p in pos]
    return out


def _held(pos: np.ndarray) -> np.ndarray:
    """``[H, W]``: each head's held positions sorted, padded with -1 (head-wise budgets let
    heads hold different counts)."""
    rows = [np.sort(p[p >= 0]) for p in pos]
    w = max(len(r) for r in rows)
    return np.stack([np.pad(r, (0, w - len(r)), constant_values=-1) for r in rows])


def row_facts(c, row: int = 0) -> tuple:
    """(offset, tokens kept, budget, evictions) of one row (scalars for a single cache)."""
    if isinstance(c, kvcompress.BatchCompressedKVCache):
        return (int(c.offset.tolist()[row]), c.tokens_kept[row], c.budget[row], c.evictions[row])
    return (int(c.offset), c.tokens_kept, c.budget, c.evictions)


def full_state(caches) -> list:
    """Every array (as numpy) and string of the caches' states: equality = nothing changed."""
    out = []
    for c in caches:
        for x in c.state:
            out.append(x if isinstance(x, str) else np.array(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x))
    return out


def same_state(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (x == y) if isinstance(x, str) else (x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True))
        for x, y in zip(a, b)
    )
