"""Gated merge: fold evicted tokens into survivors instead of dropping them (CaM, ICML 2024).

For each evicted slot ``l`` (per batch, KV head):

* **gate** (Eq. 14): ``p = clamp(A_l / A_t, 0, 1)``, ``merge ~ Bernoulli(p)``, with ``A`` the
  scorer's attention mass and ``A_t`` the target's score (``target="nearest"``) or the mean score
  of the target window (``target="window"``). Each draw is a hash of ``(seed, layer, KV head,
  tokens the row has seen, the loser's position)`` -- global identities and row-local facts, so
  a sequence draws the same alone, in any batch row, or with its heads split across machines.
* **target**: ``"nearest"`` -- the non-sink survivor whose key is most cosine-similar to ``k_l``;
  ``"window"`` -- the paper's rule, the next ``merge_window`` (m) kept tokens after ``l``.
* **blend**: nearest: ``x_t <- (1 - w) x_t + w x_l`` with
  ``w = max(cos(k_l, k_t), 0) * a_l / (a_l + a_t)`` (``sim_weighted``), where
  ``a_j = A_j / (offset - pos_j)`` is slot j's attention mass per query since it arrived: the
  paper's attention-prominence weighting (an importance-weighted average of the two values)
  scaled by key similarity, so a dissimilar loser barely perturbs its target and a duplicate of
  equal importance is averaged in; or ``w = 1/2`` (``mean``); window: ``v_t <- v_t + v_l / m`` for each of the m targets (the
  paper's additive rule). Values always; keys only with ``merge_keys``.
  When several losers ``L_t`` of one step (a prefill chunk) pick the same target, the blend is
  the same weighted average taken over the target and all of them at once:
  ``x_t <- x_t + sum_{l in L_t} w_l (x_l - x_t)`` with
  ``w_l = max(cos(k_l, k_t), 0) * a_l / (a_t + sum_{i in L_t} a_i)`` (``mean``:
  ``w_l = 1 / (1 + |L_t|)``), so ``x_t`` stays a convex combination however many losers it
  absorbs; with one loser this is the rule above. (Adding each loser's pairwise
  ``w_l (x_l - x_t)`` independently would move ``x_t`` by ``sum w_l``, past every loser when
  the sum exceeds 1.)
* **mass** (``transfer_mass``): a merged loser's score moves to its target(s) (split evenly over
  a window), as the design note does; off, the target keeps its own score.

``merge="drop"`` does nothing at all, so the method is bit-for-bit the drop method.

Only the entries ``ev.real`` marks leave (a batch row may free fewer slots than others); empty
slots (position ``-1``) and sinks are never targets. Merges are counted per row and head in the
disposition's state (``diagnostics``: merges per KV head, per row).

A decode step (one loser per row) runs the nearest-target merge as one ``mx.compile``d
function of the arrays (compiled once per shape and configuration; offsets and draw keys enter
as arrays, so they never trigger a retrace): the same operations, fused.
``KVCOMPRESS_NO_COMPILE=1`` runs them eagerly. Two things in it are not the merge and are kept
off the device's per-step work: the (seed, layer, head, offset) part of each draw is hashed on
the host (the same bits), and the key norms ``|k_j|`` of the cosine are reused from the last
eviction (``MergeState.norms``, a derived field: not saved) for every slot the cache did not
write since (``Eviction.written``), so a step computes one norm per row and head, not ``T``.
"""

from __future__ import annotations

from typing import Callable, ClassVar, Literal, Optional

import attrs
import mlx.core as mx
from attrs.validators import ge, in_, instance_of

from kvcompress import derived_field, ops, rows_field

from .draws import _draw_keys, _draws, _host_draw_keys, _seed_base, _u32, bernoulli_gate, gate_probability, gate_uniforms
from .weights import _per_target_sum, _prominence_share, _scatter_add
from .stored import _key_norms, _write_rows, blend_row, is_low_bit, stored_rows

__all__ = ["GatedMerge", "MergeState", "gate_probability", "bernoulli_gate", "gate_uniforms"]


def _evicted_mask(evict: mx.array, t: int, real: Optional[mx.array] = None) -> mx.array:
    """``[B, H, T]`` bool: the slots that really leave (entries ``real`` marks; all if None)."""
    shape = evict.shape[:-1] + (t,)
    leave = mx.ones(evict.shape, mx.bool_) if real is None else mx.broadcast_to(real, evict.shape)
    return mx.put_along_axis(mx.zeros(shape, mx.bool_), evict, leave, axis=-1)


@attrs.define
class MergeState:
    """Merges done so far, per batch row and KV head (``[B, H]`` int32); ``norms``: the stored
    keys' norms ``[B, H, T]`` float32 as of the last decode eviction (reused for the slots the
    cache did not write since, :attr:`kvcompress.Eviction.written`; None: none kept)."""

    merges: Optional[mx.array] = rows_field()
    norms: Optional[mx.array] = derived_field()


@attrs.frozen
class GatedMerge:
    """CaM's gated merge of evicted tokens (see module docstring for the math)."""

    merge: Literal["sim_weighted", "mean", "drop"] = attrs.field(
        default="sim_weighted", validator=in_(("sim_weighted", "mean", "drop"))
    )
    merge_gate: bool = attrs.field(default=True, validator=instance_of(bool))
    merge_keys: bool = attrs.field(default=False, validator=instance_of(bool))
    target: Literal["nearest", "window"] = attrs.field(default="nearest", validator=in_(("nearest", "window")))
    merge_window: int = attrs.field(default=32, validator=[instance_of(int), ge(1)])
    n_sink: int = attrs.field(default=4, validator=[instance_of(int), ge(0)])
    transfer_mass: bool = attrs.field(default=True, validator=instance_of(bool))
    seed: int = attrs.field(default=0, validator=instance_of(int))

    requires: ClassVar[frozenset] = frozenset({"attention_mass"})
    provides: ClassVar[frozenset] = frozenset({"head_groups"})

    def init_state(self, layer) -> MergeState:
        return MergeState()

    def diagnostics(self, state: Optional[MergeState]) -> dict:
        """``merges``: evicted tokens merged into a survivor, per row (mean over KV heads)."""
        if state is None or state.merges is None:
            return {"merges": [0.0]}
        return {"merges": [float(x) for x in state.merges.astype(mx.float32).mean(axis=1).tolist()]}

    def dispose(self, ev):
        if self.merge == "drop":
            return ev.keys, ev.values, ev.scores
        fn = self._merge_nearest if self.target == "nearest" else self._merge_window
        keys, values, scores, done, norms = fn(ev)
        self._record(ev, done, norms)
        return keys, values, scores

    def plan(self, ev):
        """A decode step's nearest-target merge, reads only (:meth:`_nearest_rows`); None where
        there is no such plan (drop, the window rule, chunks, head groups)."""
        if self.merge == "drop" or self.target != "nearest" or ev.evict.shape[-1] != 1 or ev.owner is not None:
            return None
        return self._nearest_rows(ev)

    def apply(self, ev, plan):
        """The writes of a :meth:`plan`: the same keys, values, scores and state as dispose."""
        keys, values, scores, done, norms = _write_rows(ev, plan)
        self._record(ev, done, norms)
        return keys, values, scores

    def _record(self, ev, done, norms) -> None:
        if isinstance(ev.state, MergeState):
            m = done if ev.state.merges is None else ev.state.merges + done
            if ev.draw_id % 128 == 127:  # keep the lazy counter's graph from growing unbounded
                mx.async_eval(m)
            ev.state = attrs.evolve(ev.state, merges=m, norms=norms)

    def _draw_inputs(self, ev) -> mx.array:
        """:func:`_draw_keys` ``[B, H, 1 | E]`` of each loser's row and KV head (on the host
        when the heads are known there; the same bits as on the device)."""
        b, h = ev.evict.shape[:2]
        base = _seed_base(self.seed, ev.layer.layer)
        if ev.owner is None and len(ev.offsets) == b:
            heads = tuple(range(ev.layer.head_offset, ev.layer.head_offset + h))
            return _host_draw_keys(base, heads, tuple(int(o) & 0xFFFFFFFF for o in ev.offsets))
        if ev.owner is None:
            heads = ev.layer.head_ids(h)
        else:  # head groups: the loser's own KV head (row * heads per row + its owner), globally
            row = mx.arange(h, dtype=mx.int32).reshape(1, h, 1) * ev.heads_per_row
            heads = (ev.layer.head_offset + row + mx.take_along_axis(ev.owner, ev.evict, axis=-1)).astype(mx.uint32)
        return _draw_keys(mx.array(base, mx.uint32), heads, _u32(ev.offset))

    # -- the design note's rule: one most-similar survivor ---------------------------------

    def nearest_target(self, keys, positions, evict, real=None, owner=None):
        """``(target [B,H,E] int32, cos [B,H,E] float32, has_target [B,H,E] bool)``."""
        return _nearest_target(keys, positions, evict, self.n_sink, real, owner)[:3]

    def _merge_nearest(self, ev):
        if ev.evict.shape[-1] == 1:  # decode: one loser, one target -> row updates, no scatter
            return _write_rows(ev, self._nearest_rows(ev))
        grouped = ev.owner is not None
        fn = _nearest_merge_fn(self.merge, self.merge_gate, self.merge_keys, self.n_sink, self.transfer_mass, False,
                               grouped)
        real = ev.real if ev.real is not None else mx.array(True)
        owner = ev.owner if grouped else ev.positions  # (unused without head groups)
        *out, _ = fn(ev.keys, ev.values, ev.scores, ev.positions, ev.evict, real, ev.offset, self._draw_inputs(ev),
                     owner, ev.scores, ev.evict)
        return (*out, None)

    def _nearest_rows(self, ev):
        """One loser per row and head: ``(target [B, H, 1], value row [B, H, 1, D], key row or
        None, target score [B, H, 1] or None, merges [B, H], norms or None)`` -- what the merge
        writes (None: left as is), from the compiled function. The key norms of the last eviction
        are redone only for the slots written since (unless merged keys change them)."""
        grouped = ev.owner is not None
        prev = ev.state.norms if isinstance(ev.state, MergeState) else None
        reuse = not self.merge_keys and ev.written is not None and prev is not None and (
            prev.shape == ev.positions.shape)
        fn = _nearest_merge_fn(self.merge, self.merge_gate, self.merge_keys, self.n_sink, self.transfer_mass, True,
                               grouped, reuse)
        real = ev.real if ev.real is not None else mx.array(True)
        owner = ev.owner if grouped else ev.positions  # (unused without head groups)
        norms = (prev, ev.written) if reuse else (ev.scores, ev.evict)  # (unused without reuse)
        if not grouped and is_low_bit(ev):  # gathered from the codes: the store is never dequantized whole
            choose = single_choice_fn(self.merge, self.merge_gate, self.n_sink)
            target, vrow, krow, s_t, done, norms = stored_rows(ev, choose, self._draw_inputs(ev), prev, reuse,
                                                               self.merge_keys)
            return target, vrow, krow, s_t if self.transfer_mass else None, done, norms
        target, vrow, krow, s_t, done, norms = fn(ev.keys, ev.values, ev.scores, ev.positions, ev.evict, real,
                                                  ev.offset, self._draw_inputs(ev), owner, *norms)
        return (target, vrow, krow if self.merge_keys else None, s_t if self.transfer_mass else None, done,
                None if self.merge_keys else norms)

    # -- the paper's rule: the next m kept tokens --------------------------------------------

    def window_targets(self, positions, evict, real=None, owner=None):
        """``(targets [B,H,E,m'] int32, valid [B,H,E,m'] bool)``: the next m kept tokens by position
        (slots that really leave -- ``real`` -- are never targets; entries a row does not free are;
        with head groups only the loser's own head's slots)."""
        t = positions.shape[-1]
        pos_l = mx.take_along_axis(positions, evict, axis=-1)  # [B,H,E]
        d = positions[:, :, None, :] - pos_l[..., None]  # [B,H,E,T]
        ok = (d > 0) & ~_evicted_mask(evict, t, real)[:, :, None, :] & (positions >= self.n_sink)[:, :, None, :]
        if owner is not None:
            ok = ok & (owner[:, :, None, :] == mx.take_along_axis(owner, evict, axis=-1)[..., None])
        big = mx.array(2**30, dtype=d.dtype)
        key = mx.where(ok, d, big)
        m = min(self.merge_window, t)
        order = mx.argsort(key, axis=-1)[..., :m] if m == t else mx.argpartition(key, kth=m - 1, axis=-1)[..., :m]
        order = order.astype(mx.int32)
        valid = mx.take_along_axis(ok, order, axis=-1)
        return order, valid

    def _merge_window(self, ev):
        b, h, e = ev.evict.shape
        targets, valid = self.window_targets(ev.positions, ev.evict, ev.real, ev.owner)
        m = targets.shape[-1]
        count = valid.astype(mx.float32).sum(-1)  # [B,H,E]
        s_l = mx.take_along_axis(ev.scores, ev.evict, axis=-1)
        flat_t = targets.reshape(b, h, e * m)
        s_win = mx.take_along_axis(ev.scores, flat_t, axis=-1).reshape(b, h, e, m)
        mean_t = (s_win * valid).sum(-1) / mx.maximum(count, 1.0)
        do = count > 0
        if ev.real is not None:
            do = do & ev.real
        if self.merge_gate:
            pos_l = mx.take_along_axis(ev.positions, ev.evict, axis=-1)
            do = do & (_draws(self._draw_inputs(ev), pos_l) < gate_probability(s_l, mean_t))
        share = mx.where(valid & do[..., None], 1.0 / mx.maximum(count, 1.0)[..., None], 0.0)  # [B,H,E,m]

        def add(x):
            xl = mx.take_along_axis(x, ev.evict[..., None], axis=2).astype(mx.float32)  # [B,H,E,D]
            delta = (share[..., None] * xl[:, :, :, None, :]).reshape(b, h, e * m, x.shape[-1])
            return _scatter_add(x.astype(mx.float32), flat_t, delta).astype(x.dtype)

        values = add(ev.values)
        keys = add(ev.keys) if self.merge_keys else ev.keys
        done = do.astype(mx.int32).sum(axis=-1)
        if not self.transfer_mass:
            return keys, values, ev.scores, done, None
        scores = _scatter_add(ev.scores, flat_t, (share * s_l[..., None]).reshape(b, h, e * m))
        return keys, values, scores, done, None


# --------------------------------------------------------------------------------------------
# The nearest-target merge as a pure function of arrays (compiled for decode)
# --------------------------------------------------------------------------------------------

_COMPILE = ops.COMPILE
_FNS: dict = {}


def _nearest_target(keys, positions, evict, n_sink: int, real=None, owner=None, norms=None):
    """``(target, cos, has_target, norms)`` (``norms``: every slot's key norm, given or computed)."""
    t = keys.shape[2]
    kl = mx.take_along_axis(keys, evict[..., None], axis=2)  # [B,H,E,D]
    dots = (keys @ kl.swapaxes(-1, -2)).swapaxes(-1, -2).astype(mx.float32)  # [B,H,E,T] (T rows: cheaper on the CPU)
    if norms is None:
        norms = _key_norms(keys)  # [B,H,T]
    norm_l = mx.take_along_axis(norms, evict, axis=-1)  # [B,H,E]
    invalid = positions < n_sink  # sinks, and empty slots (position -1)
    if evict.shape[-1] == 1:  # one loser: its position (unique in its head), an element-wise compare
        invalid = invalid | (positions == mx.take_along_axis(positions, evict, axis=-1))
    else:
        invalid = invalid | _evicted_mask(evict, t, real)  # only slots that really leave
    cos = dots / (norms[:, :, None, :] * norm_l[..., None] + 1e-12)
    invalid = invalid[:, :, None, :]
    if owner is not None:  # head groups: only the loser's own head's slots
        invalid = invalid | (owner[:, :, None, :] != mx.take_along_axis(owner, evict, axis=-1)[..., None])
    cos = mx.where(invalid, -mx.inf, cos)
    target = mx.argmax(cos, axis=-1).astype(mx.int32)
    best = mx.max(cos, axis=-1)  # = cos at the target
    return target, best, best > -mx.inf, norms


def _nearest_merge_fn(merge: str, gate: bool, merge_keys: bool, n_sink: int, transfer_mass: bool,
                      single: bool, grouped: bool = False, reuse: bool = False) -> Callable:
    """``f(keys, values, scores, positions, evict, real, offset, draw_keys, owner, prev_norms,
    written)`` for one configuration. Several losers per row (a chunk): ``-> (keys, values,
    scores, merges [B, H], norms)``. ``single`` (one loser, decode; compiled): the rows the merge
    writes, ``-> (target [B, H, 1], value row [B, H, 1, D], key row, target score [B, H, 1],
    merges, norms [B, H, T])``. ``reuse``: ``prev_norms`` hold every slot's key norm but those of
    the ``written`` slots, which are redone (else every norm is computed)."""
    cfg = (merge, gate, merge_keys, n_sink, transfer_mass, single, grouped, reuse)
    fn = _FNS.get(cfg)
    if fn is not None:
        return fn

    def merge_fn(keys, values, scores, positions, evict, real, off, draw_keys, owner, prev_norms, written):
        norms = None
        if reuse:
            fresh = _key_norms(mx.take_along_axis(keys, written[..., None], axis=2))
            norms = mx.put_along_axis(prev_norms, written, fresh, axis=-1)
        if single and not grouped:  # one loser per row and head: the choice shared with low-bit slots
            kl = mx.take_along_axis(keys, evict[..., None], axis=2)
            dots = (keys @ kl.swapaxes(-1, -2)).swapaxes(-1, -2).astype(mx.float32)[:, :, 0]  # [B,H,T]
            norms = _key_norms(keys) if norms is None else norms
            target, w, s_new, count = choose(dots, norms, scores, positions, evict, real, off, draw_keys)
            xl, xt = (mx.take_along_axis(values, i[..., None], axis=2) for i in (evict, target))
            krow = blend_row(*(mx.take_along_axis(keys, i[..., None], axis=2) for i in (evict, target)), w) \
                if merge_keys else target
            return target, blend_row(xl, xt, w), krow, s_new, count, norms
        target, cos, has, norms = _nearest_target(keys, positions, evict, n_sink, real, owner if grouped else None,
                                                  norms)
        s_l = mx.take_along_axis(scores, evict, axis=-1)
        s_t = mx.take_along_axis(scores, target, axis=-1)
        do = has & real
        if gate:
            pos_l = mx.take_along_axis(positions, evict, axis=-1)
            do = do & (_draws(draw_keys, pos_l) < gate_probability(s_l, s_t))
        # Several losers of one step may share a target (prefill): each weight is then taken
        # against the target and all of them together, so x_t stays a convex combination.
        if merge == "sim_weighted":
            do = do & (cos > 0)  # w = 0: nothing would move, so it is not counted as a merge
            w = cos * _prominence_share(positions, evict, target, s_l, s_t, off, None if single else do)
            do = do & (w > 0)
        elif single:
            w = mx.full(cos.shape, 0.5)
        else:
            w = 1.0 / (1.0 + _per_target_sum(target, do.astype(mx.float32), keys.shape[2]))
        w = mx.where(do, w, 0.0)[..., None]  # [B,H,E,1]

        def delta(x):  # w (x_l - x_t) in float32, and x_t
            xl = mx.take_along_axis(x, evict[..., None], axis=2).astype(mx.float32)
            xt = mx.take_along_axis(x, target[..., None], axis=2).astype(mx.float32)
            return w * (xl - xt), xt

        def row(x):  # one loser: the target's new row
            d, xt = delta(x)
            return (xt + d).astype(x.dtype)

        def blend(x):
            return _scatter_add(x.astype(mx.float32), target, delta(x)[0]).astype(x.dtype)

        count = do.astype(mx.int32).sum(axis=-1)
        moved = mx.where(do, s_l, 0.0)
        if single:  # (a placeholder array where merge_keys is off: compiled outputs are arrays)
            return target, row(values), row(keys) if merge_keys else target, s_t + moved, count, norms
        new_keys = blend(keys) if merge_keys else keys
        new_scores = _scatter_add(scores, target, moved) if transfer_mass else scores
        return new_keys, blend(values), new_scores, count, norms

    choose = single_choice_fn(merge, gate, n_sink, False)
    fn = mx.compile(merge_fn) if (single and _COMPILE) else merge_fn
    _FNS[cfg] = fn
    return fn


def single_choice_fn(merge: str, gate: bool, n_sink: int, compiled: bool = True) -> Callable:
    """``f(dots [B,H,T], norms [B,H,T], scores, positions, evict [B,H,1], real, off, draw_keys)
    -> (target [B,H,1], w [B,H,1], target score + moved mass, merges [B,H])``: one loser per row
    and head (decode), its nearest survivor by cosine (``dots``: the loser's key against every
    stored key), the gate and the blend weight -- what float and low-bit slots both run."""
    key = ("choice", merge, gate, n_sink, compiled and _COMPILE)
    fn = _FNS.get(key)
    if fn is not None:
        return fn

    def choose(dots, norms, scores, positions, evict, real, off, draw_keys):
        norm_l = mx.take_along_axis(norms, evict, axis=-1)
        invalid = (positions < n_sink) | (positions == mx.take_along_axis(positions, evict, axis=-1))
        cos = mx.where(invalid, -mx.inf, dots / (norms * norm_l + 1e-12))
        target = mx.argmax(cos, axis=-1, keepdims=True).astype(mx.int32)
        best = mx.max(cos, axis=-1, keepdims=True)
        s_l = mx.take_along_axis(scores, evict, axis=-1)
        s_t = mx.take_along_axis(scores, target, axis=-1)
        do = (best > -mx.inf) & real
        if gate:
            do = do & (_draws(draw_keys, mx.take_along_axis(positions, evict, axis=-1)) < gate_probability(s_l, s_t))
        if merge == "sim_weighted":
            do = do & (best > 0)  # w = 0: nothing would move, so it is not counted as a merge
            w = best * _prominence_share(positions, evict, target, s_l, s_t, off, None)
            do = do & (w > 0)
        else:
            w = mx.full(best.shape, 0.5)
        w = mx.where(do, w, 0.0)
        return target, w, s_t + mx.where(do, s_l, 0.0), do.astype(mx.int32).sum(axis=-1)

    fn = mx.compile(choose) if (compiled and _COMPILE) else choose
    _FNS[key] = fn
    return fn
