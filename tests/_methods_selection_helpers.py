"""Shared by ``tests/test_methods_selection_*.py``: one :class:`CompressedKVCache` driven with
random keys, values and real queries, with the test head size and its scale."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

import kvcompress
from kvcompress import CompressedKVCache

D = 8
SCALE = D**-0.5


# ------------------------------------------------------------------------------------------------
# Driving one cache with random keys, values and real queries
# ------------------------------------------------------------------------------------------------


class Driver:
    """One :class:`CompressedKVCache` fed random K/V and observed with random queries."""

    def __init__(self, method, budget, b=1, hq=4, hkv=2, seed=0, **params):
        m = kvcompress.build_method(method, budget=budget, **params)
        self.cache = CompressedKVCache(m, budget)
        self.rng = np.random.default_rng(seed)
        self.b, self.hq, self.hkv = b, hq, hkv
        self.queries = []  # every step's queries, in order

    def _rand(self, *shape):
        return mx.array(self.rng.standard_normal(shape).astype(np.float32))

    def step(self, s: int):
        k, v = self._rand(self.b, self.hkv, s, D), self._rand(self.b, self.hkv, s, D)
        q = self._rand(self.b, self.hq, s, D)
        keys, _ = self.cache.update_and_fetch(k, v)
        self.cache.observe(q, SCALE)
        self.queries.append(np.array(q))
        return np.array(keys)

    def last_queries(self, m: int) -> np.ndarray:
        return np.concatenate(self.queries, axis=2)[:, :, -m:]

    @property
    def pos(self) -> np.ndarray:
        if self.cache.empty():
            return np.zeros((self.b, self.hkv, 0), np.int32)
        return np.array(self.cache.slot_positions)

    @property
    def scores(self) -> np.ndarray:
        if self.cache.empty():
            return np.zeros((self.b, self.hkv, 0), np.float32)
        return np.array(self.cache.slot_scores)
