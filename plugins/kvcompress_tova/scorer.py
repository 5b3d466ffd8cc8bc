"""TOVA's score: the current query's attention, averaged over every head of the layer
(Oren et al., 2024, "Transformers are Multi-State RNNs")."""

from __future__ import annotations

from typing import ClassVar

import attrs
import mlx.core as mx

__all__ = ["TOVAScorer"]


@attrs.frozen
class TOVAScorer:
    """``s_j = (1 / H_q) sum_h softmax_j(q_{h,t} . k_j * scale)`` for each row's last real query ``t``.

    The score replaces the previous one after every step (it is not accumulated) and is the same
    for every KV head, so the ``lowest`` selector evicts the same slot in every head and the
    heads' slot layouts stay identical: one kept set per layer, as in the reference
    (``mean(attn_weights[:, :, -1, :], dim=1)`` then ``topk``). The mean over KV heads of the
    group-mean mass equals the mean over all query heads because groups have equal size. A row
    with no real token in the step keeps its scores. In decode (one query) the mass is the one
    the cache computed with the step's attention (``last_mass``), not a second product.
    """

    requires: ClassVar[frozenset] = frozenset({"queries", "last_mass"})
    provides: ClassVar[frozenset] = frozenset({"attention_mass", "head_shared"})

    def observe(self, scores, obs):
        n = obs.n_new
        if all(v == n for v in obs.n_valid) or obs.query_weight is None:
            mass = obs.attention_mass(last=1)  # [B, H_kv, T]
        else:  # right-padded rows: each row's last real query
            from kvcompress.ops import attention_mass

            last = mx.arange(n).reshape(1, 1, n) == (mx.array(obs.n_valid).reshape(-1, 1, 1) - 1)
            mass = attention_mass(
                obs.queries, obs.keys, obs.scale, obs.positions, obs.query_positions,
                query_weight=last.astype(mx.float32),
            )
        new = mx.broadcast_to(mass.mean(axis=1, keepdims=True), mass.shape)
        if all(v > 0 for v in obs.n_valid):
            return new
        return mx.where(mx.array([v > 0 for v in obs.n_valid]).reshape(-1, 1, 1), new, scores)
