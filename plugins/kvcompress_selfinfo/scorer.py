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

``keep_ids``: token ids scored :data:`UNKNOWN` wherever they occur, so they and the span units
that hold them stay while the budget holds them, e.g. a chat template's turn markers
(:func:`special_ids`). Empty by default: on SmolLM2-135M at 2k, 4x keeping the markers lost
later turns (the held turns crowd facts out; docs/methods/selfinfo.md).

``floor_ids`` / ``floor``: token ids scored at least ``floor`` nats, ``max(I, floor)`` -- a
bounded weight, not a guarantee, e.g. the digits of numbers (:func:`digit_ids`): a digit costs
the model about ``log 10`` nats, so a number sums less than the words around it and leaves first.

Both take ids or a name resolved with the model's tokenizer when the cache is built
(``make_prompt_cache(model, ..., tokenizer=...)``; the CLIs pass theirs): ``keep_ids="special"``
(:func:`special_ids`; refused without a tokenizer) and ``floor_ids="digits"`` (:func:`digit_ids`;
without a tokenizer no floor, with a warning). The ``selfinfo`` method's defaults are
``floor_ids="digits", floor=7``; the scorer's own are the paper's rule, no floor.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, ClassVar, Optional

import attrs
import mlx.core as mx
from attrs.validators import ge, instance_of

from kvcompress import ConfigError, rows_field

__all__ = ["SelfInfoScorer", "SelfInfoState", "UNKNOWN", "digit_ids", "special_ids"]

#: the score of a token whose prediction is unknown (kept ahead of every predicted token)
UNKNOWN = 1.0e4


def special_ids(tokenizer) -> tuple:
    """A Hugging Face / mlx-lm tokenizer's special token ids (BOS, EOS, a chat template's turn
    markers), sorted, for ``SelfInfoScorer(keep_ids=...)``."""
    return tuple(sorted({int(i) for i in getattr(tokenizer, "all_special_ids", ()) or ()}))


def digit_ids(tokenizer) -> tuple:
    """A Hugging Face / mlx-lm tokenizer's ids of the tokens made only of ASCII digits (after a
    leading space marker), sorted, for ``SelfInfoScorer(floor_ids=...)``."""
    out = set()
    for tok, i in tokenizer.get_vocab().items():
        t = tok.lstrip(" \u0120\u2581")  # GPT-2's and SentencePiece's space markers
        if t and t.isascii() and t.isdigit():
            out.add(int(i))
    return tuple(sorted(out))


#: the name each of ``keep_ids`` / ``floor_ids`` accepts, resolved by :meth:`SelfInfoScorer.with_tokenizer`
_NAMES = {"keep_ids": "special", "floor_ids": "digits"}


def _ids_or_name(value):
    return value if isinstance(value, str) else tuple(value)


def _check_ids(_inst, attribute, value) -> None:
    name = _NAMES[attribute.name]
    if isinstance(value, str):
        if value != name:
            raise ValueError(f"{attribute.name} must be token ids or {name!r}, got {value!r}")
        return
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ValueError(f"{attribute.name} must be token ids (ints >= 0) or {name!r}, got {list(value)!r}")


def _one_of(tok: mx.array, ids: tuple) -> mx.array:
    """Bool, ``tok``'s shape: whether each token id is one of ``ids``."""
    return (tok[..., None] == mx.array(ids, dtype=mx.int32)).any(axis=-1)


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
    last prediction the state keeps (for the next call's first token); ``keep_ids``: token ids
    scored :data:`UNKNOWN` (kept ahead of every predicted token); ``floor_ids``: token ids scored
    at least ``floor`` nats."""

    top_k: int = attrs.field(default=64, validator=[instance_of(int), ge(1)])
    keep_ids: Any = attrs.field(default=(), converter=_ids_or_name, validator=_check_ids)
    floor_ids: Any = attrs.field(default=(), converter=_ids_or_name, validator=_check_ids)
    floor: float = attrs.field(default=0.0, converter=float, validator=ge(0.0))

    requires: ClassVar[frozenset] = frozenset({"positions", "tokens", "predictions"})
    provides: ClassVar[frozenset] = frozenset()

    def with_tokenizer(self, tokenizer) -> "SelfInfoScorer":
        """``keep_ids="special"`` / ``floor_ids="digits"`` as the tokenizer's ids (see the module)."""
        out = {}
        if self.keep_ids == "special":
            if tokenizer is None:
                raise ConfigError("selfinfo: keep_ids='special' needs the model's tokenizer: pass tokenizer= to "
                                  "make_prompt_cache / attach, or give the ids (keep_ids=[...])")
            out["keep_ids"] = special_ids(tokenizer)
        if self.floor_ids == "digits":
            if callable(getattr(tokenizer, "get_vocab", None)):
                out["floor_ids"] = digit_ids(tokenizer)
            else:
                warnings.warn("selfinfo: floor_ids='digits' needs the model's tokenizer and its vocabulary "
                              "(make_prompt_cache(..., tokenizer=...)); without it no token gets the floor", stacklevel=2)
                out["floor_ids"] = ()
        return attrs.evolve(self, **out) if out else self

    def init_state(self, layer) -> SelfInfoState:
        return SelfInfoState()

    def observe(self, scores: mx.array, obs) -> mx.array:
        """Nothing from the attention: the step's tokens are scored once the call's predictions
        arrive (:meth:`observe_predictions`), before anything can evict them."""
        return scores

    def observe_predictions(self, scores: mx.array, obs) -> mx.array:
        pred, st = obs.predictions, obs.state or SelfInfoState()
        n_valid = tuple(obs.n_valid or (obs.n_new,) * len(obs.offsets))
        key = ("selfinfo", self.top_k, self.keep_ids, self.floor_ids, self.floor, st.ids, st.logp, tuple(obs.offsets), n_valid)
        info, start, valid, ids, logp = pred.once(key, lambda: self._token_info(pred, st, obs.tokens, obs.offsets, n_valid))
        obs.state = SelfInfoState(ids=ids, logp=logp)
        p = obs.positions
        if obs.n_new == 1:  # a decode step: the row's one new slot takes the token's information
            return mx.where(p == start[:, :, None], info[:, :, None], scores)
        n = obs.n_new
        idx = p - start[:, :, None]
        new = (p >= 0) & (idx >= 0) & (idx < valid[:, :, None])
        full = mx.broadcast_to(info[:, None, :], (p.shape[0], p.shape[1], n))
        return mx.where(new, mx.take_along_axis(full, mx.clip(idx, 0, n - 1), axis=-1), scores)

    def _token_info(self, pred, st: SelfInfoState, tokens, offsets, n_valid) -> tuple:
        """``(I [B, N] float32 per input token, position of token 0 [B, 1], real tokens [B, 1],
        the new state's ids and log-probabilities)``: the same in every layer, computed once."""
        tok = tokens.astype(mx.int32)
        b, n = tok.shape
        valid = mx.array(n_valid, dtype=mx.int32).reshape(-1, 1)
        start = mx.array(offsets, dtype=mx.int32).reshape(-1, 1) - valid  # position of token 0
        qpos = start + mx.arange(n, dtype=mx.int32).reshape(1, n)
        info = pred.surprisal
        if st.ids is not None:  # the call's first token, from the previous call's last prediction
            hit = st.ids == tok[:, :1]
            first = mx.where(hit.any(axis=1), -mx.where(hit, st.logp, 0.0).sum(axis=1), -st.logp.min(axis=1))
            info = mx.concatenate([first[:, None], info[:, 1:]], axis=1)
        # a prediction exists when the token before is real: in this call, or the previous one
        before = mx.concatenate([mx.full((b, 1), st.ids is not None), qpos[:, :-1] >= 0], axis=1) & (qpos > 0)
        info = mx.where(before & ~mx.isnan(info), info, UNKNOWN)
        if self.floor_ids and self.floor > 0:  # at least ``floor`` nats (a bounded weight, not a guarantee)
            info = mx.where(_one_of(tok, self.floor_ids), mx.maximum(info, self.floor), info)
        if self.keep_ids:
            info = mx.where(_one_of(tok, self.keep_ids), UNKNOWN, info)
        ids, logp = pred.top(self.top_k)
        if st.ids is not None:  # a row without tokens this call keeps its previous prediction
            real = valid > 0
            ids, logp = mx.where(real, ids, st.ids), mx.where(real, logp, st.logp)
        return info, start, valid, ids, logp
