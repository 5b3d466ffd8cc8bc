"""Scoring passes: extra forwards a scorer asks for, run before the model's next call.

A scorer with the optional hook ``pass_tokens(state)`` (see
:class:`~kvcompress.components.ScorerHooks`) may ask for token ids ``[B, M]`` (``-1``: padding)
to be run through the whole model against the stored cache, e.g. KVzip's context
reconstruction. The model hook (:func:`kvcompress.mlxlm.attention.install`) calls
:func:`before_call` before every model call; it asks the first compressed cache's scorer until
the answer is None and runs each pass against temporary per-layer views:

* a :class:`PassView` holds the layer's stored slots followed by the pass tokens (keys, values,
  positions ``offset + i``); real arrays are only concatenated, never written, and nothing is
  stored or evicted; with head groups (AdaKV rows) each pass token takes one slot per head of a
  row, as a stored token does, and every query head sees only its own KV head's slots;
* caches that are not kvcompress caches (sliding-window, SSM layers) are deep-copied;
* each layer's scorer sees the pass as an :class:`~kvcompress.Observation` with
  ``scoring_pass=True`` (the pass's queries, the view's keys and positions, ``tokens`` the pass
  ids); only the scores of the stored slots and the new scorer state go back.

Because passes run before the *next* call, a step trimmed afterwards (speculative decoding), a
copied or a saved cache behave like one that never saw the removed tokens. The cost is counted
in every layer's diagnostics (``scoring_passes``, ``scoring_pass_tokens`` per row,
``scoring_pass_seconds``): whole-model figures.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable, Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from .. import _state, ops
from ..contexts import KEEP_STEPS, Observation, Predictions
from ..errors import KVCompressError
from ..storage import as_float
from .engine import Engine
from .slots import split_owner

__all__ = ["PassView", "before_call", "after_call", "MAX_PASSES"]

#: passes one model call may run before the scorer is considered stuck
MAX_PASSES = 100_000


class PassView:
    """One compressed layer during a scoring pass: stored slots, then the pass's tokens."""

    def __init__(self, cache, ids: mx.array):
        self.cache = cache
        b, m = ids.shape
        self._ids = ids
        self._m = m
        off = mx.array(cache._rows.offset, dtype=mx.int32).reshape(-1, 1, 1)
        qpos = off + mx.arange(m, dtype=mx.int32).reshape(1, 1, m)
        self._qpos = mx.where((ids >= 0)[:, None, :] & (qpos >= 0), qpos, -1)  # [B, 1, M]
        self._weight = (self._qpos >= 0).astype(mx.float32)
        self._t = 0 if cache.keys is None else cache._slots.n
        self._pos = self._owner = self._keys = self._bias = self._weights = self._out = None
        self._g = 1  # KV heads per row of slots (head groups), once the view holds the stored ones
        # what models read from a cache (pipeline models chain their last cache's keys to the
        # output with mx.depends): the view's own reference, so the real cache is never written
        self.keys = cache.keys

    @property
    def offset(self):
        return self.cache.offset

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kw):
        if N == 1:
            return None
        return create_causal_mask(N, self._t) if return_array else "causal"

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        c = self.cache
        sl = c._slots
        if c.keys is None:
            b, h, m, _ = keys.shape
            self._pos = mx.broadcast_to(self._qpos, (b, h, m))
            return keys, values
        # head groups: the pass's tokens join each row as its stored tokens do, one slot per head
        keys, values = sl.group_heads(keys), sl.group_heads(values)
        b, h, m, _ = keys.shape
        new_pos = sl.new_pos_from(self._qpos, b, h) if sl.g > 1 else mx.broadcast_to(self._qpos, (b, h, m))
        # a pass is a whole-context forward: low-bit slots are read dequantized, like a chunk's
        v, k = as_float(c.keys_and_values()[1]), as_float(c._viewed_keys())
        self._pos = mx.concatenate([sl.pos, new_pos], axis=2)
        if sl.g > 1:  # plain positions and each slot's owner head, read by attend and observe
            (self._pos, self._owner), self._g = split_owner(self._pos), sl.g
        return mx.concatenate([k, keys.astype(k.dtype)], axis=2), mx.concatenate([v, values.astype(v.dtype)], axis=2)

    def attend(self, sdpa, queries, keys, values, scale, mask, sinks=None):
        """Attention under the slots' positions (the stored slots' exact mask, causal in the pass)."""
        self._keys = keys
        # a model's additive mask is part of its attention scores (MLA's RoPE part): keep it
        self._bias = mask if isinstance(mask, mx.array) and mask.dtype != mx.bool_ else None
        out, self._weights = ops.attention(
            queries, keys, values, scale, self._pos, self._qpos, sinks=sinks, bias=self._bias,
            mass="weights" if self.cache._wants_pass_weights else None, owner=self._owner, heads_per_row=self._g,
        )
        self._out = out
        return out

    def step_arrays(self) -> list:
        """Nothing to tie: a pass's scores reach the real cache, whose next step is tied."""
        return []

    def observe(self, queries: mx.array, scale: float) -> None:
        c = self.cache
        b, h = self._pos.shape[:2]
        scores = mx.zeros((b, h, self._pos.shape[-1]), mx.float32)
        if self._t:
            scores = mx.concatenate([c._slots.score, scores[..., self._t :]], axis=-1)
        obs = Observation(
            queries=queries, keys=self._keys, positions=self._pos, query_positions=self._qpos,
            n_new=self._m, scale=scale, offset=c._offset(), offsets=tuple(c._rows.seen()), layer=c.info,
            n_valid=(self._m,) * b, query_weight=self._weight, state=_state.snapshot(c._states["scorer"]),
            tokens=self._ids, scoring_pass=True, bias=self._bias, group=c.group, weights=self._weights,
            owner=self._owner, heads_per_row=self._g,
        )
        new = c.method.scorer.observe(scores, obs)
        if new.shape[1] != h:  # attention over per-head projections of shared KV (MLA): the group's mean
            new = new.mean(axis=1, keepdims=True)
        if self._t:
            new = new[..., : self._t]
            c._slots.score = new if new.dtype == mx.float32 else new.astype(mx.float32)
        c._states["scorer"] = obs.state
        c._slots.observed = None  # the scorer last saw the pass's keys, not the stored ones
        c._unreduced = c._reduce
        if self._weights is not None:
            # the probabilities [B, H, G, N, T] are consumed now, in this layer: a lazy pass would
            # keep every layer's alive until the whole call is evaluated
            mx.async_eval(c._slots.score, self._out)
            self._weights = self._out = None


def _sharded() -> bool:
    return mx.distributed.is_available() and mx.distributed.init().size() > 1


def _engines(cache_list) -> list:
    return [c for c in cache_list if isinstance(c, Engine)]


def run_passes(call: Callable[[mx.array, list], Any], cache_list: list) -> int:
    """Run every scoring pass the caches' scorer asks for; returns how many ran."""
    engines = _engines(cache_list)
    asker = next((c for c in engines if c._has_passes), None)
    if asker is None or asker.keys is None:
        return 0  # nothing stored yet: nothing to score
    ask = asker._hooks.scorer.pass_tokens
    n = 0
    while True:
        ids = ask(asker._states["scorer"])
        if ids is None:
            return n
        n += 1
        if n > MAX_PASSES:
            raise KVCompressError(
                f"scorer {type(asker.method.scorer).__name__}.pass_tokens asked for more than "
                f"{MAX_PASSES} scoring passes before one model call; its observe must consume them"
            )
        ids = ids if isinstance(ids, mx.array) else mx.array(ids)
        ids = ids.astype(mx.int32)
        if ids.ndim != 2 or (asker._rows.held and ids.shape[0] != len(asker._rows.held)):
            raise KVCompressError(
                f"pass_tokens must return [B, M] token ids for the cache's {len(asker._rows.held)} rows, "
                f"got shape {tuple(ids.shape)}"
            )
        t0 = time.perf_counter()
        views = [PassView(c, ids) if isinstance(c, Engine) else copy.deepcopy(c) for c in cache_list]
        out = call(mx.maximum(ids, 0), views)
        # Only the layers' scores are needed: the final norm and the vocabulary projection stay
        # unevaluated, unless the ranks of a sharded model must meet in the whole call's collectives.
        mx.eval(out if _sharded() else [], [c._slots.score for c in engines if c._slots.score is not None],
                [_state.flatten_state(c._states["scorer"])[1] for c in engines])
        dt = time.perf_counter() - t0
        per_row = (ids >= 0).sum(axis=1).tolist()
        for c in engines:
            c._passes += 1
            c._pass_seconds += dt
            rows = c._rows.passed or [0] * len(per_row)
            c._rows.passed = [a + int(x) for a, x in zip(rows, per_row)]


def before_call(call: Callable[[mx.array, list], Any], cache_list, inputs) -> None:
    """What the model hook does before a model call: run the scoring passes the caches ask
    for, then hand the call's token ids to the caches whose scorer requires ``"tokens"``."""
    if not isinstance(cache_list, (list, tuple)):
        return
    engines = _engines(cache_list)
    if not engines or not any(c._has_passes or c._wants_tokens for c in engines):
        return
    run_passes(call, list(cache_list))
    tok = None
    if isinstance(inputs, mx.array) and inputs.ndim in (1, 2) and mx.issubdtype(inputs.dtype, mx.integer):
        tok = (inputs[None] if inputs.ndim == 1 else inputs).astype(mx.int32)
    for c in engines:
        c._hooked = c._has_passes or c._wants_tokens
        c.hand_tokens(tok)


def wants_head(cache_list) -> bool:
    """Whether a model call with ``cache_list`` should record its output projection's input: a
    cache's scorer requires ``"predictions"`` and the call is longer than :data:`KEEP_STEPS`
    (its predictions are then projected a block of positions at a time)."""
    if not isinstance(cache_list, (list, tuple)):
        return False
    first = next((c for c in _engines(cache_list) if c._wants_predictions), None)
    tok = None if first is None else first._tokens
    return tok is not None and tok.ndim == 2 and tok.shape[1] > KEEP_STEPS


def after_call(cache_list, logits, head=None) -> None:
    """What the model hook does after a model call: hand the model's next-token predictions
    (:class:`~kvcompress.Predictions`, computed once) to the caches whose scorer requires
    ``"predictions"``, before the next call can evict the call's tokens. ``head``:
    ``(hidden [B, N, d], project)`` when ``logits`` is exactly ``project(hidden)``: a long
    call's predictions are then projected in blocks (:meth:`Predictions.from_head`)."""
    if not isinstance(cache_list, (list, tuple)):
        return
    engines = [c for c in _engines(cache_list) if c._wants_predictions]
    if not engines:
        return
    first = engines[0]
    tok = first._undo_tokens
    if tok is None or not isinstance(logits, mx.array) or logits.ndim != 3 or tuple(logits.shape[:2]) != tuple(tok.shape):
        shape = getattr(logits, "shape", type(logits).__name__)
        raise KVCompressError(
            f"scorer {type(first.method.scorer).__name__} scores tokens by the model's predictions, but the "
            f"model call returned {shape!r} where logits [B, N, vocab] for its {None if tok is None else tuple(tok.shape)} "
            "input ids were expected; this model cannot use this method"
        )
    if head is not None and tok.shape[1] > KEEP_STEPS:
        pred = Predictions.from_head(tok, head[0], head[1], tuple(first._last_valid))
    else:
        pred = Predictions.from_logits(tok, logits, tuple(first._last_valid))
    for c in engines:
        c.observe_predictions(pred)
