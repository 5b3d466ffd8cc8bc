"""KeyDiff's key-similarity score (Park et al., 2025, "KeyDiff: Key Similarity-Based KV Cache
Eviction for Long-Context LLM Inference in Resource-Constrained Environments", arXiv 2504.15364).

Per (row, KV head), with ``k_hat_j = k_j / ||k_j||`` over the held slots ``J`` (position >= 0)::

    a   = (1/|J|) sum_{j in J} k_hat_j                     (the anchor, Sec. 3.2)
    s_j = -cos(k_j, a) = -(k_hat_j . a) / ||a||             (Eq. 4; higher = more distinctive)

The tokens whose keys point most along the mean key direction leave first. The score needs no
queries and no attention pass, so it suits fused attention paths; it is recomputed from the
stored keys after every step (plain MLX ops, float32), since the anchor moves with every token.
What does not move is each key's inverse norm: it is kept per slot in the scorer's state (a
derived field: not saved) and redone only for the slots written since the last step
(``Observation.written``), which leaves two products over the keys per step. Empty slots score
0 and never enter the anchor. With head groups (AdaKV's head-wise budgets) each head's anchor is
taken over its own slots of the row.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import attrs
import mlx.core as mx

from kvcompress import derived_field

__all__ = ["KeyDiffScorer", "KeyDiffState"]

_EPS = 1e-12


@attrs.define
class KeyDiffState:
    """Per cache: ``inv`` ``[B, H, T]`` float32, each slot's ``1 / rms(k_j)`` as of the last step
    (None: not known, e.g. after loading or a batch edit; recomputed)."""

    inv: Optional[mx.array] = derived_field()


def _inv_rms(keys: mx.array) -> mx.array:
    """``[..., T]`` float32 ``1 / sqrt(mean(k^2) + eps)`` of keys ``[..., T, D]``."""
    k = keys.astype(mx.float32)
    return mx.rsqrt(mx.mean(k * k, axis=-1) + _EPS)


@attrs.frozen
class KeyDiffScorer:
    """``s_j = -cos(k_j, mean_{i held} k_i / ||k_i||)`` per row and KV head; see the module docstring.

    With ``r_j = 1 / rms(k_j)`` (``u_j = r_j k_j``, norm ``sqrt(D)``): the anchor ``a = sum_{held}
    r_j k_j`` (the mean direction up to a positive factor, which a cosine ignores), ``s_j = -r_j
    k_j . rms_norm(a) / D``: two products over the keys per step, ``r`` kept in the state.
    """

    requires: ClassVar[frozenset] = frozenset({"keys", "positions"})
    provides: ClassVar[frozenset] = frozenset({"key_similarity", "head_groups"})

    def init_state(self, layer) -> KeyDiffState:
        return KeyDiffState()

    def observe(self, scores, obs):
        d = obs.keys.shape[-1]
        k = obs.keys.astype(mx.float32)  # [B, H, T, D]
        prev = obs.state.inv if isinstance(obs.state, KeyDiffState) else None
        if obs.written is not None and prev is not None and prev.shape == k.shape[:3]:
            fresh = _inv_rms(mx.take_along_axis(k, obs.written[..., None], axis=2))
            inv = mx.put_along_axis(prev, obs.written, fresh, axis=-1)
        else:
            inv = _inv_rms(k)
        obs.state = KeyDiffState(inv=inv)
        held = obs.positions >= 0  # [B, H, T] ([B, 1, T] for keys per query head)
        w = mx.where(held, inv, 0.0)
        if obs.owner is not None and obs.heads_per_row > 1:  # one anchor per head of the row
            heads = mx.arange(obs.heads_per_row, dtype=obs.owner.dtype).reshape(1, 1, -1, 1)
            mine = mx.where(obs.owner[:, :, None, :] == heads, w[:, :, None, :], 0.0)
            anchor = mx.fast.rms_norm(mine @ k, None, _EPS) * (-1.0 / d)  # [B, H, g, D]
            sims = (k @ anchor.swapaxes(-1, -2)) * inv[..., None]  # [B, H, T, g]
            own = mx.maximum(obs.owner, 0)[..., None]
            return mx.where(held, mx.take_along_axis(sims, own, axis=-1)[..., 0], 0.0)
        anchor = mx.fast.rms_norm(w[:, :, None, :] @ k, None, _EPS) * (-1.0 / d)  # [B, H, 1, D]
        return mx.where(held, (k @ anchor.swapaxes(-1, -2))[..., 0] * inv, 0.0)
