"""Shared by ``tests/test_equivalence_*.py``: the methods under test, the float32 tolerance, test
token ids, a fresh tiny model, ``mlx_lm.generate``'s prompt split and a max-abs-difference."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import kvcompress
from conftest import tiny_llama

METHODS = sorted(kvcompress.get_registry().methods)
ATOL = 1e-6  # float32: the no-eviction path must be the same computation as KVCache
#: a compressing chunk of a mass scorer attends with kvcompress's float32 attention-with-mass:
#: the same math as KVCache's attention, summed in another order (a masking error is ~1e-1)
ATOL_FUSED = 1e-5


def maxdiff(a: mx.array, b: mx.array) -> float:
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())


def prefill_chunks(n: int, step: int) -> list[tuple[int, int]]:
    """mlx_lm.generate's prompt split: chunks of ``step`` over the first n-1 tokens, then the last."""
    out, i = [], 0
    while n - i > 1:
        j = i + min(step, n - i - 1)
        out.append((i, j))
        i = j
    out.append((i, n))
    return out


def token_ids(n: int, vocab: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, vocab, size=n), dtype=mx.int32)


def fresh_tiny(**kw):
    """A new tiny model per test: components may bind to a model instance (``bind``)."""
    return tiny_llama(**kw)
