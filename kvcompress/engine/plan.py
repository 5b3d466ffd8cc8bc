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

from ..storage import as_float


class _PlanMixin:
    _planned: Optional[tuple] = None

    def _plan_key(self) -> tuple:
        """What an eviction is built from: the arrays (by identity: every change makes new
        ones) and the host bookkeeping (by value)."""
        return (
            (self.keys, self.values, self._pos, self._score, self._states["selector"],
             self._states["disposition"], self._written),
            (self._n, self._g, self._rounds, tuple(self._rows.offset), tuple(self._rows.held),
             tuple(self._rows.budget), tuple(self._rows.pad or ())),
        )

    def _plan_next(self) -> None:
        """After a step is observed: plan the next single-token step's eviction, if it needs one
        and the disposition plans."""
        self._planned = None
        plan_hook = self._hooks.disposition.plan
        if plan_hook is None or self._reduce or self.group.rebudget_pending or self._rows.pending is not None:
            return
        need = self._rows.need([1] * len(self._rows), self._g)
        if not any(need):
            return
        ev = self._eviction(need)
        plan = plan_hook(ev)
        if plan is not None:
            self._planned = (self._plan_key(), need, ev, plan)

    def _take_plan(self, need: list) -> Optional[tuple]:
        """``(ev, plan)`` planned for exactly this eviction of this state, else None."""
        p, self._planned = self._planned, None
        if p is None or p[1] != need:
            return None
        key = self._plan_key()
        if any(a is not b for a, b in zip(p[0][0], key[0])) or p[0][1] != key[1]:
            return None
        return p[2], p[3]

    def _plan_arrays(self) -> list:
        """The planned eviction's arrays (evaluated with the step that planned it)."""
        if self._planned is None:
            return []
        ev, plan = self._planned[2], self._planned[3]
        return [ev.evict, *(a for a in plan if isinstance(a, mx.array))]

    def _float_kv(self) -> tuple:
        """The stored keys and values as components see them (low-bit slots lazily dequantized:
        only what a component reads is computed)."""
        k, v = self.keys_and_values()
        return as_float(k), as_float(v)

    def _written_slots(self):
        """The slots written since the last eviction, if those are all that changed (else None)."""
        w = self._written
        if w is None or w[0] is not self.keys:
            return None
        if len(w[1]) == 1:
            return w[1][0]
        return mx.concatenate(w[1], axis=-1) if w[1] else mx.zeros(self._pos.shape[:2] + (0,), mx.int32)
