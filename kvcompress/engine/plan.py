"""Planned evictions: a decode step's eviction chosen and read at the end of the step before.

A disposition that reads the stored keys/values to decide what it writes (CaM's merge reads the
loser's key, every key for the cosine, the loser's and the target's values) and then writes into
the same arrays in the same step makes MLX copy each array it both reads and writes: the write
cannot reuse the buffer while a read of it is still queued. For such a disposition the engine
splits the eviction in two (the optional disposition hooks ``plan`` and ``apply``):

* at the end of a step, once the scorer has observed it, the engine builds the eviction the next
  single-token step will need -- the selector's choice over the scores as they now stand -- and
  the disposition's ``plan(ev)`` reads what it needs (small arrays: the target, the blended row);
  the plan is evaluated with the step's output, while the step's attention reads the same arrays;
* at the next step's start, if nothing changed since, ``apply(ev, plan)`` only writes.

Both halves are the same operations on the same state as ``dispose(ev)`` would run at the next
step's start, so the result is identical. Anything that changes the cache in between (a trim, a
chunk, a load, a batch edit, a proxy-scored step, a rebudget) drops the plan, which is then never
used: the eviction runs ``dispose`` as usual. Plans are not made where scores are agreed across
ranks at the next step's start.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx



class PlannedEviction:
    """The part that holds at most one eviction planned for the next single-token step:
    ``planned = (key, need, eviction, plan)``, used only if the engine's key (what an eviction is
    built from) and the need are still the same when that step comes."""

    def __init__(self):
        self.planned: Optional[tuple] = None

    def store(self, key: tuple, need: list, ev, plan) -> None:
        self.planned = (key, need, ev, plan)

    def clear(self) -> None:
        self.planned = None

    def take(self, key: tuple, need: list) -> Optional[tuple]:
        """``(ev, plan)`` if planned for exactly this ``need`` and ``key`` (arrays by identity,
        host facts by value), else None; the plan is dropped either way."""
        p, self.planned = self.planned, None
        if p is None or p[1] != need:
            return None
        if any(a is not b for a, b in zip(p[0][0], key[0])) or p[0][1] != key[1]:
            return None
        return p[2], p[3]

    def arrays(self) -> list:
        """The planned eviction's arrays (evaluated with the step that planned it)."""
        if self.planned is None:
            return []
        ev, plan = self.planned[2], self.planned[3]
        return [ev.evict, *(a for a in plan if isinstance(a, mx.array))]

    def __deepcopy__(self, memo) -> "PlannedEviction":
        return PlannedEviction()  # a copy plans its own next eviction


class _PlanMixin:

    def _plan_key(self) -> tuple:
        """What an eviction is built from: the arrays (by identity: every change makes new
        ones) and the host bookkeeping (by value)."""
        return (
            (self.keys, self.values, self._slots.pos, self._slots.score, self._states["selector"],
             self._states["disposition"], self._slots.written),
            (self._slots.n, self._slots.g, self._rounds, tuple(self._rows.offset), tuple(self._rows.held),
             tuple(self._rows.budget), tuple(self._rows.pad or ())),
        )

    def _plan_next(self) -> None:
        """After a step is observed: plan the next single-token step's eviction, if it needs one
        and the disposition plans."""
        self._plan.clear()
        plan_hook = self._hooks.disposition.plan
        if plan_hook is None or self._reduce or self.group.rebudget_pending or self._rows.pending is not None:
            return
        need = self._rows.need([1] * len(self._rows), self._slots.g)
        if not any(need):
            return
        ev = self._eviction(need)
        plan = plan_hook(ev)
        if plan is not None:
            self._plan.store(self._plan_key(), need, ev, plan)

    def _take_plan(self, need: list) -> Optional[tuple]:
        """``(ev, plan)`` planned for exactly this eviction of this state, else None."""
        return self._plan.take(self._plan_key(), need)
