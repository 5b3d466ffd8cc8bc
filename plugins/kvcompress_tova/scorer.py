"""TOVA's score: the current query's attention, averaged over every head of the layer
(Oren et al., 2024, "Transformers are Multi-State RNNs")."""

from __future__ import annotations

from typing import ClassVar

import attrs
import mlx.core as mx

__all__ = ["TOVAScorer"]


@attrs.frozen
class TOVAScorer:
    """``s_j = (1 / H_q) sum_h softmax_j(q_{h,t} . k_j * scale)`` for the step's last query ``t``.

    The score replaces the previous one after every step (it is not accumulated) and is the same
    for every KV head, so the ``lowest`` selector evicts the same slot in every head and the
    heads' slot layouts stay identical: one kept set per layer, as in the reference
    (``mean(attn_weights[:, :, -1, :], dim=1)`` then ``topk``). The mean over KV heads of the
    group-mean mass equals the mean over all query heads because groups have equal size.
    """

    requires: ClassVar[frozenset] = frozenset({"queries"})
    provides: ClassVar[frozenset] = frozenset({"attention_mass", "head_shared"})

    def observe(self, scores, obs):
        mass = obs.attention_mass(last=1)  # [B, H_kv, T]
        return mx.broadcast_to(mass.mean(axis=1, keepdims=True), mass.shape)
