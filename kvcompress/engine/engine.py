"""The method-agnostic engine behind :class:`CompressedKVCache` and :class:`BatchCompressedKVCache`.

The engine owns its data through parts: :class:`~.rows.Rows` (per-row host facts: held, seen,
budget, evicted; no step needs a device sync to know what to do), :class:`~.slots.Slots` (the
``[B, H, T, D]`` storage with a position per slot, ``-1``: empty, and every layout operation),
:class:`~.plan.PlannedEviction` and the component states. The engine alone sequences a step of
``S`` tokens:

1. **Evict (deferred).** A row over budget with its new tokens keeps ``budget - 1`` old ones:
   ``e = n - (budget - 1)`` slots leave (:meth:`Rows.need`; ``evict_count(e, budget)`` for chunk
   selectors), chosen by the selector on the scores the previous steps left, folded in by the
   disposition, and become empty. The count does not depend on ``S``, so a step trimmed
   afterwards is exact.
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
from .plan import PlannedEviction, _PlanMixin
from .steps import STATE_VERSION, _StateMixin
from .report import _ViewMixin
from .._lowbit import prepare as _prepare_cpu_kernels
from ..components import KINDS
from ..contexts import Eviction, LayerInfo, Selection
from ..errors import ConfigError
from ..group import PromptGroup, new_group
from .rows import Rows, room_to_evict
from .slots import Slots
from ..storage import rewritten

__all__ = ["Engine", "UNDO_TOKENS", "STATE_VERSION", "before_update"]



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
        _prepare_cpu_kernels()  # the CPU softmax of its attention: built now, never inside a timed step
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
        self._slots = Slots()  # keys, values, positions, scores and their layout (slots.py)
        self._plan = PlannedEviction()  # the next decode step's eviction, chosen early (plan.py)
        self._rounds = 0
        self._query_steps = self._proxy_steps = 0
        self._pending = None  # (S, valid per row, query positions) of a step not yet observed
        self._undo = None
        self._step_mass = None
        self._attended = None
        self._io_seen = False
        self._io_input = None  # the layer's input during a prompt's first forward
        self._last_valid: list = []
        self._off_cache: tuple = (None, None)
        self._off_array: tuple = (None, None)
        self._attn_keys = self._bias = None
        if self.info.n_kv_heads:  # a head group that cannot work is refused now
            self._hooks.selector.head_group(self.info, self.info.n_kv_heads)

    def _use(self, method) -> None:
        """The method's hooks and what its components declare they need from the engine (its
        symbolic token ids resolved without a tokenizer where the factory did not resolve them)."""
        method = method.with_tokenizer(None)
        self.method, self._hooks = method, method.hook_set()
        self._wants_mass = "step_mass" in method.scorer.requires
        self._wants_last_mass = "last_mass" in method.scorer.requires
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
        self._slots.observed = None

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

    def _setup_groups(self, h: int) -> None:
        """KV heads per storage row, from the selector's ``head_group`` hook (1 without it)."""
        g = int(self._hooks.selector.head_group(self.info, h))
        if g < 1 or h % g or g >= 128:
            raise ConfigError(f"layer {self.info.layer}: head group {g} must divide the {h} KV heads (and be < 128)")
        self._slots.g = g

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
        if not self._slots.g:
            self._setup_groups(h)
        g = self._slots.g
        keys, values = self._slots.group_heads(keys), self._slots.group_heads(values)
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
        slots, rows = self._slots, self._rows
        if S == 1 and slots.fits_one_token(rows.held, self._hooks.selector.evict_count(g, max(rows.budget)),
                                           g * max(rows.budget)):
            empty = slots.n - rows.held[0] if len(set(rows.held)) == 1 and min(valid) == 1 else 0
            slots.write_token(keys, values, freed, slots.new_positions(rows.offset, valid, 1, b, keys.shape[1]), empty)
        else:
            if freed is not None:
                slots.mark_freed(*freed)
            if slots.holes(rows.held):
                slots.compact(rows.held)
            slots.append(keys, values, slots.new_positions(rows.offset, valid, S, b, keys.shape[1]),
                         g * max(rows.budget))
        rows.stored(valid, g)
        self._rows.advance(S, valid)  # a right-padded prompt's offsets count its padding until finalize()
        self._pending = (S, valid, None)
        self._last_valid = valid
        self._undo = None
        v = self.keys_and_values()[1]
        k = self._attended = self._viewed_keys()
        if proxied:  # no attention wrapper to tie the proxy's scores to the output: tie them to the keys
            k = mx.depends([k], self.step_arrays())[0]
        return k, v

    @property
    def keys(self):
        """The stored keys ``[B, H_kv / g, capacity, D]`` (None before the first step)."""
        return self._slots.keys

    @keys.setter
    def keys(self, value) -> None:
        # mlx-lm's pipeline models chain the last cache's keys to their output
        # (``cache[-1].keys = mx.depends(cache[-1].keys, h)``): the same values, a new array
        self._slots.keys = value

    @property
    def values(self):
        return self._slots.values

    @values.setter
    def values(self, value) -> None:
        self._slots.values = value

    def keys_and_values(self):
        """The stored keys and values, as wide as the slots in use."""
        return self._slots.kv()

    def _evict(self, need: list):
        """Free ``need[b]`` slots (or the selector's whole chunks) per row; returns
        ``(slots [B, H, E], real [B, H, E] or None)``."""
        planned = self._take_plan(need)
        if planned is not None:  # selected and read at the end of the step before
            ev, plan = planned
            k, v, self._slots.score = self._hooks.disposition.apply(ev, plan)
        else:
            ev = self._eviction(need)
            k, v, self._slots.score = self.method.disposition.dispose(ev)
        self._states["disposition"] = ev.state
        if self._store.quantized:  # what the disposition rewrote is stored again (the rest as it was)
            held = self.keys_and_values()
            rows = (None, None) if ev.rewritten is None else ev.rewritten[1:]
            k, v = (rewritten(new, seen, old, None if ev.rewritten is None else (ev.rewritten[0], r))
                    for new, seen, old, r in zip((k, v), (ev.keys, ev.values), held, rows))
        self._slots.keys, self._slots.values = k, v
        self._slots.written = (k, [])
        self._rounds += 1
        self._rows.freed(ev.counts)
        return (ev.evict, ev.real)

    def _eviction(self, need: list) -> Eviction:
        """The selector's choice of ``need[b]`` slots per row, as the disposition sees it."""
        count = self._hooks.selector.evict_count
        counts = [int(count(e, b)) if e else e for e, b in zip(need, self._rows.budget)]
        uniform = len(set(counts)) == 1
        k, v = self._slots.float_kv()
        seen = self._rows.seen()
        off, offs, bud = self._offset(), tuple(seen), self._budget_arg()
        sel_c = self.method.selector
        pos, owner = self._slots.positions_and_owner()
        protected = sel_c.protected(pos, off, bud)
        if self._slots.holes(self._rows.held):
            protected = protected | (self._slots.pos < 0)
        slots = sel_c.select(
            Selection(
                scores=self._slots.score, positions=pos, protected=protected, n_evict=max(need),
                budget=bud, offset=off, offsets=offs, layer=self.info,
                row_counts=None if uniform else self._arr(need), state=self._states["selector"],
                group=self.group, owner=owner, heads_per_row=self._slots.g, budgets=tuple(self._rows.budget),
            )
        ).astype(mx.int32)
        real = None if uniform else mx.arange(slots.shape[-1]).reshape(1, 1, -1) < self._arr(counts)
        ev = Eviction(
            keys=k, values=v, scores=self._slots.score, positions=pos, evict=slots, protected=protected,
            offset=off, offsets=offs, layer=self.info, counts=tuple(counts), draw_id=self._rounds, real=real,
            state=self._states["disposition"], group=self.group, owner=owner, heads_per_row=self._slots.g,
            written=self._slots.written_slots(), stored=self.keys_and_values() if self._store.quantized else None,
        )
        return ev
