"""Self-information score (Li et al., 2023, "Compressing Context to Enhance Inference Efficiency
of Large Language Models" -- Selective Context, arXiv 2310.06201, Sec. 2).

A token's self-information under the model itself (Eq. 1)::

    I(x_t) = -log P(x_t | x_0 .. x_{t-1})

is what the model could not predict: names, numbers, the first token of a new fact carry much;
function words and the continuation of a phrase carry little. Selective Context keeps the lexical
units with the most information, a unit's being the sum of its tokens' (Eq. 3); the ``chunk``
selector's sum over ``c`` consecutive positions is that rule with fixed-length units.

No extra forward: the model hook hands each call's log-probabilities to the cache after the
call (capability ``predictions``, :class:`kvcompress.Predictions`), before the next step can
evict. ``I`` of token ``i >= 1`` of a call comes from the same call's prediction after token
``i - 1``; the call's first token from the previous call's last prediction, which the state
keeps as its ``top_k`` most likely ids (an id outside them gets the ``top_k``-th
log-probability: a lower bound on its information). A token no prediction precedes (the
prompt's first, a batch row's first after its left padding) gets :data:`UNKNOWN`, so it stays.
Scores are float32 and the same for every head and layer: a token-level decision.
"""

from __future__ import annotations

import math
from typing import ClassVar, Optional

import attrs
import mlx.core as mx
from attrs.validators import ge, instance_of

from kvcompress import rows_field

__all__ = ["SelfInfoScorer", "SelfInfoState", "UNKNOWN"]

#: the score of a token whose prediction is unknown (kept ahead of every predicted token)
UNKNOWN = 1.0e4


@attrs.define
class SelfInfoState:
    """The previous call's last prediction per row, as its ``top_k`` most likely ids ``[B, k]``
    int32 and their log-probabilities ``[B, k]`` float32 (NaN: no prediction yet)."""

    ids: Optional[mx.array] = rows_field(fill=-1)
    logp: Optional[mx.array] = rows_field(fill=math.nan)


@attrs.frozen
class SelfInfoScorer:
    """Self-information ``I(x_t) = -log P(x_t | x_<t)`` of every stored token (Eq. 1), from the
    model's own predictions; see the module docstring. ``top_k``: ids of the previous call's
    last prediction the state keeps (for the next call's first token)."""

    top_k: int = attrs.field(default=64, validator=[instance_of(int), ge(1)])

    requires: ClassVar[frozenset] = frozenset({"positions", "tokens", "predictions"})
    provides: ClassVar[frozenset] = frozenset()

    def init_state(self, layer) -> SelfInfoState:
        return SelfInfoState()

    def observe(self, scores: mx.array, obs) -> mx.array:
        """Nothing from the attention: the step's tokens are scored once the call's predictions
        arrive (:meth:`observe_predictions`), before anything can evict them."""
        return scores

    def observe_predictions(self, scores: mx.array, obs) -> mx.array:
        pred, st = obs.predictions, obs.state or SelfInfoState()
        tok = obs.tokens.astype(mx.int32)
        b, n = tok.shape
        valid = mx.array(obs.n_valid or (n,) * b, dtype=mx.int32).reshape(-1, 1)
        start = mx.array(obs.offsets, dtype=mx.int32).reshape(-1, 1) - valid  # position of token 0
        qpos = start + mx.arange(n, dtype=mx.int32).reshape(1, n)
        info = pred.surprisal
        if st.ids is not None:  # the call's first token, from the previous call's last prediction
            hit = st.ids == tok[:, :1]
            first = mx.where(hit.any(axis=1), -mx.where(hit, st.logp, 0.0).sum(axis=1), -st.logp.min(axis=1))
            info = mx.concatenate([first[:, None], info[:, 1:]], axis=1)
        # a prediction exists when the token before is real: in this call, or the previous one
        before = mx.concatenate([mx.full((b, 1), st.ids is not None), qpos[:, :-1] >= 0], axis=1) & (qpos > 0)
        info = mx.where(before & ~mx.isnan(info), info, UNKNOWN)
        p = obs.positions
        idx = p - start[:, :, None]
        new = (p >= 0) & (idx >= 0) & (idx < valid[:, :, None])
        full = mx.broadcast_to(info[:, None, :], (b, p.shape[1], n))
        got = mx.take_along_axis(full, mx.clip(idx, 0, n - 1), axis=-1)
        k = min(self.top_k, pred.last.shape[-1])
        top = mx.argpartition(-pred.last, kth=k - 1, axis=-1)[:, :k].astype(mx.int32)
        real = valid > 0  # a row without tokens this call keeps its previous prediction
        ids, logp = top, mx.take_along_axis(pred.last, top, axis=-1)
        if st.ids is not None:
            ids, logp = mx.where(real, ids, st.ids), mx.where(real, logp, st.logp)
        obs.state = SelfInfoState(ids=ids, logp=logp)
        return mx.where(new, got, scores)
