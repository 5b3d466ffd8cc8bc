"""The method-agnostic engine behind :class:`CompressedKVCache` and :class:`BatchCompressedKVCache`.

Storage is ``[B, H, T, D]`` with a position per slot (``-1``: empty). Rows may hold different
numbers of tokens; the host keeps, per row, the tokens seen (``offset``), the tokens held and
the budget, so no step needs a device sync to know what to do. One step of ``S`` tokens:

1. **Evict (deferred).** A row over budget with its new tokens keeps ``budget - 1`` old ones:
   ``e = n - (budget - 1)`` slots leave (``evict_count(e)`` for chunk selectors), chosen by the
   selector on the scores the previous steps left, folded in by the disposition, and become
   empty. The count does not depend on ``S``, so a step trimmed afterwards is exact.
2. **Store.** A single token goes into an empty slot of its row; a chunk is appended after
   the held slots (empty slots moved to the left first).
3. **Attend.** The mask comes from the slot positions (:func:`kvcompress.ops.visibility`), so it
   is exact for any layout; without empty slots it is plain ``None`` / ``"causal"``.
4. **Observe.** The scorer updates the scores from the step's real queries.

**Head groups.** A selector may let ``g`` KV heads share one row of slots (its ``head_group``
hook): the row holds ``g * budget`` slots, each tagged with the head it belongs to (packed into
the high bits of its stored position), so heads hold different numbers of tokens within the
same bytes (AdaKV's head-wise budgets). A query head sees only its own head's slots; components
get plain positions plus ``owner``. With ``g = 1`` (every other selector) nothing changes.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from .attend import UNDO_TOKENS, _AttendMixin
from .plan import _PlanMixin
from .steps import STATE_VERSION, _StateMixin
from .report import _ViewMixin
from ..components import KINDS
from ..contexts import Eviction, LayerInfo, Selection
from ..errors import ConfigError
from ..group import PromptGroup, new_group
from .rows import Rows, room_to_evict
from ..storage import concat_slots, fill_from_end, put_slots, rewritten, take_slots, zeros_like_rows

__all__ = ["Engine", "UNDO_TOKENS", "STATE_VERSION", "before_update"]

_OWNER_SHIFT = 24  # head-group owner bits above the position (positions < 2**24 tokens)
_POS_MASK = (1 << _OWNER_SHIFT) - 1


#: what runs before every ``update_and_fetch``'s storing: the mlx-lm glue registers its attention
#: wrapper here (:func:`kvcompress.mlxlm.attention.ensure_wrapped`, when that module is imported,
#: which importing kvcompress does), so the engine imports nothing from :mod:`kvcompress.mlxlm`
_BEFORE_UPDATE: list = []


def before_update(fn) -> None:
    """Register ``fn()`` to run before every step's storing (once per function)."""
    if fn not in _BEFORE_UPDATE:
        _BEFORE_UPDATE.append(fn)


def _ensure_wrapped() -> None:
    for fn in _BEFORE_UPDATE:
        fn()


class Engine(_PlanMixin, _AttendMixin, _StateMixin, _ViewMixin, _BaseCache):
    step = 256
    #: whether the rows are a batch as users see it (per-row figures as lists, rows that may
    #: hold different counts); a single-sequence cache reports one value
    BATCHED = False

    def __init__(self, method, budget, layer=0, group: Optional[PromptGroup] = None, info: Optional[LayerInfo] = None,
                 offsets: Optional[list] = None):
        self.info = info if info is not None else LayerInfo(layer=int(layer))
        self._use(method)
        self._store = method.storage  # how the kept slots are held (kvcompress.storage)
        self._rows = Rows(self._check_budget(budget), offsets)  # per-row host facts (rows.py)
        self.group = group if group is not None else new_group()
        self.group.add(self.info.layer, self)
        inits = {k: self._hooks.of(k).init_state for k in KINDS}
        self._states = {k: init(self.info) if init else None for k, init in inits.items()}
        self._undo_predictions = None  # the last step's, while it can be trimmed
        self._hooked = False  # the model hook ran before this call (scorers with scoring passes)
        self._restored = False  # rebuilt from a saved state (its model may not be prepared for it)
        self._tokens = self._step_tokens = self._undo_tokens = None
        self._passes, self._pass_seconds = 0, 0.0
        # scores that must agree across tensor-parallel ranks: a decision over all heads of the
        # layer ("head_shared"), or KV heads every rank holds while their queries are split (MLA)
        self._unreduced = False
        self.keys = self.values = self._pos = self._score = None
        self._n = 0  # stored width T
        self._rounds = 0
        self._query_steps = self._proxy_steps = 0
        self._pending = None  # (S, valid per row, query positions) of a step not yet observed
        self._undo = None
        self._step_mass = None
        self._attended = None
        self._io_seen = False
        self._io_input = None  # the layer's input during a prompt's first forward
        self._last_valid: list = []
        self._last_slots = None
        self._written: Optional[tuple] = None  # (keys, slots written since the last eviction)
        self._off_cache: tuple = (None, None)
        self._off_array: tuple = (None, None)
        self._attn_keys = self._bias = None
        self._g = 0  # KV heads per storage row (0: not known before the first step)
        if self.info.n_kv_heads:  # a head group that cannot work is refused now
            self._hooks.selector.head_group(self.info, self.info.n_kv_heads)

    def _use(self, method) -> None:
        """The method's hooks and what its components declare they need from the engine."""
        self.method, self._hooks = method, method.hook_set()
        self._wants_mass = "step_mass" in method.scorer.requires
        self._wants_io = "layer_io" in method.budget.requires
        self._needs_queries = "queries" in method.scorer.requires
        # the model hook hands over each call's token ids (before) and next-token predictions
        # (after, contexts.Predictions: indexed by the ids, so such a scorer gets both)
        self._wants_predictions = "predictions" in method.scorer.requires
        self._wants_tokens = "tokens" in method.scorer.requires or self._wants_predictions
        if self._wants_predictions and self._hooks.scorer.observe_predictions is None:
            raise ConfigError(
                f"scorer {type(method.scorer).__name__} requires 'predictions' but defines no "
                "observe_predictions(scores, obs) hook to receive them"
            )
        self._has_passes = self._hooks.scorer.pass_tokens is not None
        self._wants_pass_weights = "pass_weights" in method.scorer.requires
        # scores that must agree across tensor-parallel ranks: a decision over all heads of the
        # layer ("head_shared"), or KV heads every rank holds while their queries are split (MLA)
        self._head_shared = "head_shared" in method.scorer.provides
        self._reduce = self.info.tp_size > 1 and (self.info.kv_replicated or self._head_shared)

    def replace_method(self, method) -> None:
        """Continue with ``method``, a composition whose component states fit this cache's (a
        benchmark's ablation: the same method with scoring switched off)."""
        self._use(method)

    @classmethod
    def restore(cls, method, budget: int, state, info, group):
        """A ``cls`` engine rebuilt from a saved ``state`` list of ``method`` (marked restored:
        its model may not be prepared for it, which the first step checks)."""
        obj = cls.__new__(cls)
        Engine.__init__(obj, method, budget, info=info, group=group)
        obj.state = state
        obj._restored = True
        return obj

    def _check_budget(self, budget) -> int:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise ConfigError(f"budget of layer {self.info.layer} must be a positive int, got {budget!r}")
        if not room_to_evict(self.method.selector, budget):
            reserved = self.method.selector.reserved(budget)
            raise ConfigError(
                f"layer {self.info.layer}: budget {budget} leaves no room to evict: the selector "
                f"always keeps {reserved} tokens (sinks + recent window); use a budget > {reserved} "
                "or fewer protected tokens"
            )
        return budget

    def set_row_budgets(self, budgets: list) -> None:
        """Each row's budget (tokens per KV head), checked; the next steps evict to them."""
        self._rows.budget = [self._check_budget(int(b)) for b in budgets]

    def set_budget(self, budget: int) -> None:
        """One budget for every row, and for rows a first step starts."""
        b = self._check_budget(budget)
        self._rows.default_budget = b
        self._rows.budget = [b] * len(self._rows.budget)

    def _budget_arg(self):
        """The budget components see: one int, or ``[B, 1, 1]`` when rows differ."""
        b = self._rows.budget
        return b[0] if len(set(b)) == 1 else self._arr(b)

    def _holes(self) -> bool:
        return any(n != self._n for n in self._rows.held)

    def _setup_groups(self, h: int) -> None:
        """KV heads per storage row, from the selector's ``head_group`` hook (1 without it)."""
        g = int(self._hooks.selector.head_group(self.info, h))
        if g < 1 or h % g or g >= 128:
            raise ConfigError(f"layer {self.info.layer}: head group {g} must divide the {h} KV heads (and be < 128)")
        self._g = g

    def _positions(self) -> mx.array:
        """Token position of each slot (-1: empty), without the head-group owner bits."""
        if self._g <= 1:
            return self._pos
        return mx.where(self._pos >= 0, self._pos & _POS_MASK, -1)

    def _owner(self):
        """Head of each slot within its row (head groups only; -1: empty), else None."""
        if self._g <= 1:
            return None
        return mx.where(self._pos >= 0, self._pos >> _OWNER_SHIFT, -1)

    def _arr(self, values: list) -> mx.array:
        """``[B, 1, 1]`` int32 of per-row host values (a 0-d array when every row agrees)."""
        if len(values) > 1 and values.count(values[0]) != len(values):
            return mx.array(values, dtype=mx.int32).reshape(-1, 1, 1)
        return mx.array(values[0] if values else 0, dtype=mx.int32)

    def _offset(self) -> mx.array:
        """The offsets as an array, built once per value of the host offsets."""
        seen = self._rows.seen()
        key = tuple(seen)
        if self._off_cache[0] != key:
            self._off_cache = (key, self._arr(seen))
        return self._off_cache[1]

    def _qpos(self, S: int) -> mx.array:
        """``[B, 1, S]`` int32 positions of the last step's tokens."""
        if S == 1:
            return (self._offset() - 1).reshape(-1, 1, 1) if len(set(self._rows.offset)) > 1 else mx.full(
                (len(self._rows.offset), 1, 1), self._rows.offset[0] - 1, mx.int32)
        start = mx.array([o - S for o in self._rows.offset], dtype=mx.int32).reshape(-1, 1, 1)
        return start + mx.arange(S, dtype=mx.int32).reshape(1, 1, S)

    # ----------------------------------------------------------------------------------------
    # update_and_fetch
    # ----------------------------------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store a step's post-RoPE ``keys``/``values`` ``[B, H, S, D]``; return all stored."""
        self._check_input(keys, values)
        b, h, S, _ = keys.shape
        tokens = self._refuse_step(b, S)  # a step that cannot be exact is refused: nothing changed yet
        proxied = self._pending is not None
        if proxied:
            self._unobserved_step()
        if self._unreduced:
            self.group.reduce_scores()
        if self.group.rebudget_pending:
            self.group.rebudget()
        # every update, not only an empty cache's first: a cache loaded (or unpickled) in a fresh
        # process must find the wrapper installed too (a no-op once no new module was imported)
        _ensure_wrapped()
        if not self._g:
            self._setup_groups(h)
        g = self._g
        if g > 1:  # rows of g heads, token-major: [t0: h0..h(g-1)][t1: ...]
            keys = keys.reshape(b, h // g, g, S, -1).transpose(0, 1, 3, 2, 4).reshape(b, h // g, S * g, -1)
            values = values.reshape(b, h // g, g, S, -1).transpose(0, 1, 3, 2, 4).reshape(b, h // g, S * g, -1)
        if self._store.quantized:
            if self.keys is None:
                self._store.check_head_dim(keys.shape[-1], values.shape[-1])
            keys, values = self._store.store(keys, "keys"), self._store.store(values, "values")
        self._rows.ensure(b)
        if self._wants_tokens:
            self._step_tokens = tokens
        valid = self._rows.take_valid(S)
        need = self._rows.need(valid, g)
        freed = self._evict(need) if any(need) else None
        if S == 1 and all(self._n - n >= g for n in self._rows.held) and self._n <= max(self._rows.held) + g:
            self._write_into_holes(keys, values, freed, valid)
        else:
            if freed is not None:
                self._mark_freed(*freed)
            if self._holes():
                self._compact()
            self._append(keys, values, valid, S)
        self._rows.advance(S, valid)  # a right-padded prompt's offsets count its padding until finalize()
        self._pending = (S, valid, None)
        self._last_valid = valid
        self._undo = None
        v = self.keys_and_values()[1]
        k = self._attended = self._viewed_keys()
        if proxied:  # no attention wrapper to tie the proxy's scores to the output: tie them to the keys
            k = mx.depends([k], self.step_arrays())[0]
        return k, v

    def keys_and_values(self):
        if self.keys.shape[2] == self._n:
            return self.keys, self.values
        return self.keys[..., : self._n, :], self.values[..., : self._n, :]

    def _evict(self, need: list):
        """Free ``need[b]`` slots (or the selector's whole chunks) per row; returns
        ``(slots [B, H, E], real [B, H, E] or None)``."""
        planned = self._take_plan(need)
        if planned is not None:  # selected and read at the end of the step before
            ev, plan = planned
            k, v, self._score = self._hooks.disposition.apply(ev, plan)
        else:
            ev = self._eviction(need)
            k, v, self._score = self.method.disposition.dispose(ev)
        self._states["disposition"] = ev.state
        if self._store.quantized:  # what the disposition rewrote is stored again (the rest as it was)
            held = self.keys_and_values()
            rows = (None, None) if ev.rewritten is None else ev.rewritten[1:]
            k, v = (rewritten(new, seen, old, None if ev.rewritten is None else (ev.rewritten[0], r))
                    for new, seen, old, r in zip((k, v), (ev.keys, ev.values), held, rows))
        self.keys, self.values = k, v
        self._written = (k, [])
        self._rounds += 1
        self._rows.freed(ev.counts)
        return (ev.evict, ev.real)

    def _eviction(self, need: list) -> Eviction:
        """The selector's choice of ``need[b]`` slots per row, as the disposition sees it."""
        count = self._hooks.selector.evict_count
        counts = [int(count(e)) if e else e for e in need]
        uniform = len(set(counts)) == 1
        k, v = self._float_kv()
        seen = self._rows.seen()
        off, offs, bud = self._offset(), tuple(seen), self._budget_arg()
        sel_c = self.method.selector
        pos, owner = self._positions(), self._owner()
        protected = sel_c.protected(pos, off, bud)
        if self._holes():
            protected = protected | (self._pos < 0)
        slots = sel_c.select(
            Selection(
                scores=self._score, positions=pos, protected=protected, n_evict=max(need),
                budget=bud, offset=off, offsets=offs, layer=self.info,
                row_counts=None if uniform else self._arr(need), state=self._states["selector"],
                group=self.group, owner=owner, heads_per_row=self._g,
            )
        ).astype(mx.int32)
        real = None if uniform else mx.arange(slots.shape[-1]).reshape(1, 1, -1) < self._arr(counts)
        ev = Eviction(
            keys=k, values=v, scores=self._score, positions=pos, evict=slots, protected=protected,
            offset=off, offsets=offs, layer=self.info, counts=tuple(counts), draw_id=self._rounds, real=real,
            state=self._states["disposition"], group=self.group, owner=owner, heads_per_row=self._g,
            written=self._written_slots(), stored=self.keys_and_values() if self._store.quantized else None,
        )
        return ev

    def _mark_freed(self, slots: mx.array, real) -> None:
        """Freed slots become empty (position -1)."""
        gone = mx.full(slots.shape, -1, mx.int32)
        if real is not None:
            gone = mx.where(real, gone, mx.take_along_axis(self._pos, slots, axis=-1))
        self._pos = mx.put_along_axis(self._pos, slots, gone, axis=-1)

    def _write_into_holes(self, keys, values, freed, valid) -> None:
        """One token (``g`` slots per row) into empty slots: the ones just freed, if exactly."""
        b, h, g = keys.shape[0], keys.shape[1], self._g
        if freed is not None and freed[1] is None and freed[0].shape[-1] == g:
            slot = freed[0]  # the slots each row just freed: the token goes there
        else:
            if freed is not None:
                self._mark_freed(*freed)
            if g == 1:
                slot = mx.argmax(self._pos < 0, axis=-1, keepdims=True).astype(mx.int32)
            else:
                ar = mx.arange(self._n, dtype=mx.int32)
                slot = mx.argsort(mx.where(self._pos < 0, ar, ar + self._n), axis=-1)[..., :g].astype(mx.int32)
        idx = slot[..., None]
        chain = self._written is not None and self._written[0] is self.keys and len(self._written[1]) < 8
        self.keys = put_slots(self.keys, idx, keys)
        self.values = put_slots(self.values, idx, values)
        pos = self._new_positions(valid, 1, b, h)
        self._pos = mx.put_along_axis(self._pos, slot, pos, axis=-1)
        self._score = mx.put_along_axis(self._score, slot, mx.zeros((b, h, g), mx.float32), axis=-1)
        self._rows.stored(valid, g)
        self._last_slots = slot
        self._written = (self.keys, self._written[1] + [slot]) if chain else None

    def _new_positions(self, valid: list, S: int, b: int, h: int) -> mx.array:
        """Positions of a step's tokens before the offsets advance (-1 for padding), ``g`` slots
        per token with head groups (the owner in the high bits)."""
        if self._g > 1:
            pos = self._token_positions(valid, S, b, 1)  # [B, 1, S]
            owner = mx.arange(self._g, dtype=mx.int32).reshape(1, 1, 1, self._g) << _OWNER_SHIFT
            packed = mx.where(pos[..., None] >= 0, pos[..., None] | owner, -1)  # [B, 1, S, g]
            return mx.broadcast_to(packed.reshape(pos.shape[0], 1, S * self._g), (b, h, S * self._g))
        return self._token_positions(valid, S, b, h)

    def _token_positions(self, valid: list, S: int, b: int, h: int) -> mx.array:
        if S == 1 and all(x == 1 for x in valid) and min(self._rows.offset) >= 0:
            if len(set(self._rows.offset)) == 1:
                return mx.full((b, h, 1), self._rows.offset[0], mx.int32)
            return mx.broadcast_to(mx.array(self._rows.offset, dtype=mx.int32).reshape(-1, 1, 1), (b, h, 1))
        pos = mx.array(self._rows.offset, dtype=mx.int32).reshape(-1, 1, 1) + mx.arange(S, dtype=mx.int32).reshape(1, 1, S)
        if any(x < S for x in valid) or any(o < 0 for o in self._rows.offset):
            ok = (mx.arange(S).reshape(1, 1, S) < mx.array(valid, dtype=mx.int32).reshape(-1, 1, 1)) & (pos >= 0)
            pos = mx.where(ok, pos, -1)
        return mx.broadcast_to(pos, (b, h, S))

    def _compact(self) -> None:
        """Move empty slots to the left and drop those every row has; with equal rows, only the
        live slots above the count move into the holes below it (:func:`fill_from_end`)."""
        t, w, self._written = self._n, max(self._rows.held), None
        if len(set(self._rows.held)) == 1 and 4 * (t - w) <= t:
            dst, src = fill_from_end(self._pos, t - w)
            self.keys, self.values = (put_slots(a, dst, take_slots(a, src)) for a in (self.keys, self.values))
            self._pos, self._score = (
                mx.put_along_axis(a, dst, mx.take_along_axis(a, src, axis=-1), axis=-1)[..., :w]
                for a in (self._pos, self._score))
        else:
            ar = mx.arange(t, dtype=mx.int32)
            order = mx.argsort(mx.where(self._pos >= 0, ar + t, ar), axis=-1)[..., t - w :]
            self.keys, self.values = (take_slots(a, order) for a in self.keys_and_values())
            self._pos, self._score = (mx.take_along_axis(a, order, axis=-1) for a in (self._pos, self._score))
        self._n = w

    def _append(self, keys, values, valid, tokens: int) -> None:
        b, h, S, _ = keys.shape  # S = tokens * g slots
        prev = self._n
        if self.keys is None or prev + S > self.keys.shape[2]:
            need = prev + S
            cap = (need + self.step - 1) // self.step * self.step
            top = self._g * max(self._rows.budget)
            cap = min(cap, top) if need <= top else need
            new_k, new_v = zeros_like_rows(keys, b, h, cap - prev), zeros_like_rows(values, b, h, cap - prev)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
                self._pos = mx.zeros((b, h, 0), mx.int32)
                self._score = mx.zeros((b, h, 0), mx.float32)
            else:
                self.keys = concat_slots([self.keys[..., :prev, :], new_k])
                self.values = concat_slots([self.values[..., :prev, :], new_v])
        self._written = None  # (the slice update below keeps the array object)
        self.keys[..., prev : prev + S, :] = keys
        self.values[..., prev : prev + S, :] = values
        self._pos = mx.concatenate([self._pos, self._new_positions(valid, tokens, b, h)], axis=2)
        self._score = mx.concatenate([self._score, mx.zeros((b, h, S), mx.float32)], axis=2)
        self._n = prev + S
        self._rows.stored(valid, self._g)
        self._last_slots = None

