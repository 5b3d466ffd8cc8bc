"""The key-norm score: a token whose key has a small L2 norm is kept (Devoto et al., 2024).

Devoto, Zhao, Scardapane, Minervini, "A Simple and Effective L2 Norm-Based Strategy for KV
Cache Compression", EMNLP 2024, arXiv:2406.11430. The paper observes that keys with a low L2
norm tend to receive high attention, and compresses the cache by keeping the lowest-norm keys.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import mlx.core as mx

__all__ = ["KeyNormScorer", "key_norm_score"]


def key_norm_score(keys: mx.array) -> mx.array:
    """``s_j = -||k_j||_2`` for keys ``[B, H_kv, T, D]`` -> ``[B, H_kv, T]`` float32.

    The sign makes "higher score = more worth keeping", so kvcompress's ``lowest`` selector
    evicts the highest-norm keys, as the paper does.
    """
    k = keys.astype(mx.float32)
    return -mx.sqrt((k * k).sum(axis=-1))


@attrs.frozen
class KeyNormScorer:
    """Score every stored slot by ``-||k||_2`` of its (post-RoPE) key.

    Query-free: the score depends on the stored keys only, so it needs nothing from the cache
    beyond the keys and is recomputed from them after each step (a merge that changes a key
    changes its score). It provides ``key_norm``, not ``attention_mass``, so dispositions that
    gate on attention mass (``gated_merge``) are rejected when the method is built.
    """

    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset({"key_norm"})

    def observe(self, scores: mx.array, obs) -> mx.array:
        return key_norm_score(obs.keys)
