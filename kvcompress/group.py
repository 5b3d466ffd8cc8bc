"""The caches of one prompt: a group the layers share for cross-layer decisions.

:func:`~kvcompress.make_prompt_cache` gives every compressed layer of one prompt the same
:class:`PromptGroup`. It holds references to its member caches (by layer) and a scratch dict for
decisions made across layers within one step (ChunkKV's layer-wise index reuse). A deep copy of
the cache list copies the group once, so the copies share a new group. A cache written to a file
records its group's id; layers read back in order rejoin one group (:func:`join`), so a load --
by kvcompress or by mlx-lm's own loader -- restores the sharing.
"""

from __future__ import annotations

import threading
import uuid
import weakref
from typing import Optional

import attrs

__all__ = ["PromptGroup", "join", "new_group"]


@attrs.define(eq=False)
class PromptGroup:
    """Shared by the compressed layers of one prompt (or one batch of prompts)."""

    id: str = attrs.field(factory=lambda: uuid.uuid4().hex)
    members: dict = attrs.field(factory=dict, repr=False)  # layer index -> weak reference to a cache
    scratch: dict = attrs.field(factory=dict, repr=False)  # per-step cross-layer data, never saved
    #: every layer observed the prompt, and the ranks of a pipeline still have to agree budgets
    rebudget_pending: bool = False
    #: the lowest member layer: the first a forward updates (where :meth:`check_aligned` runs)
    first: Optional[int] = None

    def add(self, layer: int, cache) -> None:
        """Register ``cache`` as the group's ``layer``; the group holds it weakly (the caches hold
        the group), so dropping a prompt's caches frees them without a garbage-collector pass."""
        self.members[layer] = weakref.ref(cache)
        self.first = layer if self.first is None else min(self.first, layer)

    def check_aligned(self, cache) -> None:
        """At the start of a forward (``cache`` is the first layer): every member has seen the same
        tokens. A member left behind by the last forward means the model runs fewer layers than
        the cache list holds (mlx-lm models ``zip`` them): refused before this step changes anything."""
        behind = [c for c in self.caches() if c is not cache and c.rows_offset != cache.rows_offset]
        if behind:
            from .errors import KVCompressError

            raise KVCompressError(
                f"the model's last forward updated compressed layer {cache.info.layer} (tokens seen "
                f"{cache.rows_offset}) but not layer(s) {[c.info.layer for c in behind]} (tokens seen "
                f"{behind[0].rows_offset}): the cache list holds more layers than the model runs; use it "
                "with the model it was made for (kvcompress.install(model) checks a list before each call)"
            )

    def caches(self) -> list:
        """Member caches ordered by layer."""
        out = []
        for k in sorted(self.members):
            ref = self.members[k]
            cache = ref() if ref is not None else None
            if cache is not None:
                out.append(cache)
        return out

    def reduce_scores(self) -> None:
        """Agree the scores of every member that needs it across the tensor-parallel ranks, in
        one collective: the mean over ranks of each cache's pending scores (see
        :meth:`Engine.reduction`). Scores of step ``t`` are agreed at the start of step ``t + 1``,
        before any layer evicts with them, so one ``all_sum`` per step serves every layer."""
        import mlx.core as mx

        from .mlxlm.distributed import record, world

        pending = [c for c in self.caches() if c.awaits_reduction]
        if not pending:
            return
        parts = [c.reduction() for c in pending]
        flat = mx.concatenate([p.reshape(-1) for p in parts]) if len(parts) > 1 else parts[0].reshape(-1)
        record(flat)
        total = mx.distributed.all_sum(flat, group=world()) / pending[0].info.tp_size
        i = 0
        for c, p in zip(pending, parts):
            c.set_reduced(total[i : i + p.size].reshape(p.shape))
            i += p.size

    def rebudget(self) -> None:
        """New per-layer, per-row budgets from the budget component's ``rebudget`` hook, given
        every layer's state -- gathered across the ranks of a pipeline, so each rank takes its
        part of budgets computed for the whole model."""
        self.rebudget_pending = False
        members = self.caches()
        first = members[0]
        sel = first.method.selector
        from .engine.rows import room_to_evict

        min_b = 1
        while not room_to_evict(sel, min_b):
            min_b += 1
        if first.info.pp_size > 1:
            states = _gather_states(members, "budget")
        else:
            states = [c.component_state("budget") for c in members]
        current = [first.rows_budget] * len(states)
        budgets = first.method.hook_set().budget.rebudget(states, current, min_b)
        if budgets is not None:  # one entry per layer of ``states``: all layers, or these members
            for i, c in enumerate(members):
                c.set_row_budgets(list(budgets[c.info.layer if first.info.pp_size > 1 else i]))

    def __deepcopy__(self, memo):
        """A new, empty group: each copied cache registers itself in it (see the engine)."""
        new = PromptGroup(id=uuid.uuid4().hex)
        memo[id(self)] = new
        return new

    def __getstate__(self):  # pickling (e.g. multiprocessing) keeps only the id
        return {"id": self.id}

    def __setstate__(self, state):
        self.id, self.members, self.scratch = state["id"], {}, {}
        self.rebudget_pending, self.first = False, None


_LOCK = threading.Lock()
_OPEN: "weakref.WeakValueDictionary[str, PromptGroup]" = weakref.WeakValueDictionary()


def new_group() -> PromptGroup:
    return PromptGroup()


def join(key: str, layer: int, group_id: Optional[str] = None) -> PromptGroup:
    """The group for layer ``layer`` of the caches being rebuilt under ``key``.

    Layers are rebuilt one after the other (load, batch merge, row extraction): a layer joins the
    open group of ``key`` unless that group already has this layer, which starts a new group
    (so reading the same file twice gives two independent groups).
    """
    with _LOCK:
        group = _OPEN.get(key)
        if group is None or layer in group.members:
            group = PromptGroup(id=group_id or uuid.uuid4().hex)
            _OPEN[key] = group
        group.members.setdefault(layer, None)  # reserve the layer; the cache adds itself
        return group


def _gather_states(members: list, kind: str) -> list:
    """Every layer's ``kind`` state of the whole model (pipeline ranks each hold some layers):
    each rank writes its layers' state arrays into a zero table of all layers, one ``all_sum``
    fills it. Layers' states must share one structure (they come from one component)."""
    import mlx.core as mx

    from ._state import flatten_state, restore_state
    from .mlxlm.distributed import record, world

    first = members[0]
    comp = first.method.component(kind)
    meta, arrays = flatten_state(first.component_state(kind))
    shapes = [(a.shape, a.dtype) for a in arrays]
    width = sum(a.size for a in arrays)
    table = mx.zeros((first.info.n_layers, width), mx.float32)
    for c in members:
        _, arrs = flatten_state(c.component_state(kind))
        row = mx.concatenate([a.astype(mx.float32).reshape(-1) for a in arrs])
        table[c.info.layer] = row
    record(table)
    table = mx.distributed.all_sum(table, group=world())
    out = []
    for layer in range(first.info.n_layers):
        parts, i = [], 0
        for shape, dtype in shapes:
            n = 1
            for d in shape:
                n *= d
            parts.append(table[layer, i : i + n].reshape(shape).astype(dtype))
            i += n
        out.append(restore_state(comp, meta, parts))
    return out
