"""KeyDiff's key-similarity score (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache
Eviction for Long-Context LLM Inference in Resource-Constrained Environments", arXiv 2504.15364).

Per (row, KV head), with ``k_hat_j = k_j / ||k_j||`` over the held slots ``J`` (position >= 0)::

    a   = (1/|J|) sum_{j in J} k_hat_j                     (the anchor, Sec. 3.2)
    s_j = -cos(k_j, a) = -(k_hat_j . a) / ||a||             (Eq. 4; higher = more distinctive)

The tokens whose keys point most along the mean key direction leave first. The score needs no
queries and no attention pass, so it suits fused attention paths; it is recomputed from the
stored keys after every step (plain MLX ops, float32). Empty slots score 0 and never enter the
anchor. With head groups (AdaKV's head-wise budgets) each head's anchor is taken over its own
slots of the row.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import mlx.core as mx

__all__ = ["KeyDiffScorer"]

_EPS = 1e-12


@attrs.frozen
class KeyDiffScorer:
    """``s_j = -cos(k_j, mean_{i held} k_i / ||k_i||)`` per row and KV head; see the module docstring.

    Computed with two fused normalisations and two products per step: ``u_j = rms_norm(k_j)``
    (norm ``sqrt(D)``), ``a = sum_{held} u_j`` (the anchor up to a positive factor, which a
    cosine ignores), ``s_j = -u_j . rms_norm(a) / D``.
    """

    requires: ClassVar[frozenset] = frozenset({"keys", "positions"})
    provides: ClassVar[frozenset] = frozenset({"key_similarity", "head_groups"})

    def observe(self, scores, obs):
        d = obs.keys.shape[-1]
        u = mx.fast.rms_norm(obs.keys.astype(mx.float32), None, _EPS)  # [B, H, T, D]
        held = obs.positions >= 0  # [B, H, T] ([B, 1, T] for keys per query head)
        if obs.owner is not None and obs.heads_per_row > 1:  # one anchor per head of the row
            heads = mx.arange(obs.heads_per_row, dtype=obs.owner.dtype).reshape(1, 1, -1, 1)
            mine = ((obs.owner[:, :, None, :] == heads) & held[:, :, None, :]).astype(mx.float32)
            anchor = mx.fast.rms_norm(mine @ u, None, _EPS) * (-1.0 / d)  # [B, H, g, D]
            sims = u @ anchor.swapaxes(-1, -2)  # [B, H, T, g]
            own = mx.maximum(obs.owner, 0)[..., None]
            return mx.where(held, mx.take_along_axis(sims, own, axis=-1)[..., 0], 0.0)
        anchor = held.astype(mx.float32)[:, :, None, :] @ u  # [B, H, 1, D]
        anchor = mx.fast.rms_norm(anchor, None, _EPS) * (-1.0 / d)
        return mx.where(held, (u @ anchor.swapaxes(-1, -2))[..., 0], 0.0)
