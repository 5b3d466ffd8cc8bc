"""What a cache shows of itself: sizes, the slots per head, bytes, diagnostics, and the
read-only views of the storage and the per-row bookkeeping that tests and tools inspect."""

from __future__ import annotations

from typing import Optional

import attrs
import mlx.core as mx

from .. import _state
from ..components import KINDS


@attrs.frozen
class Parts:
    """An engine's parts: ``rows`` (:class:`~kvcompress.engine.rows.Rows`), ``slots``
    (:class:`~kvcompress.engine.slots.Slots`), ``plan``
    (:class:`~kvcompress.engine.plan.PlannedEviction`)."""

    rows: object
    slots: object
    plan: object


class _ViewMixin:
    @property
    def slot_positions(self) -> Optional[mx.array]:
        """``[B, H, T]`` int32: the token position each stored slot holds (-1: empty), in
        storage order (None before the first step)."""
        return None if self._slots.pos is None else self._slots.positions()

    @property
    def slot_owners(self) -> Optional[mx.array]:
        """``[B, H, T]`` int32: with head groups, the head of its row each slot belongs to (-1:
        empty); None without head groups."""
        return None if self._slots.pos is None else self._slots.owner()

    @property
    def slot_scores(self) -> Optional[mx.array]:
        """``[B, H, T]`` float32: each stored slot's score, in storage order."""
        return self._slots.score

    @property
    def parts(self) -> Parts:
        """The engine's parts -- per-row host facts (``rows``), the stored slots (``slots``), the
        planned eviction (``plan``) -- for inspection by tests and tools; change a cache only
        through its methods."""
        return Parts(self._rows, self._slots, self._plan)

    @property
    def pending_step(self) -> Optional[tuple]:
        """The stored step whose queries are not observed yet: ``(S, real tokens per row, query
        positions)``, or None (the next step then scores it with its keys as queries)."""
        return self._pending

    @property
    def heads_per_row(self) -> int:
        """KV heads that share one storage row (the selector's ``head_group``; 1 without)."""
        return max(self._slots.g, 1)

    @property
    def rows_held(self) -> list:
        """Slots each batch row holds (``heads_per_row`` per token with head groups)."""
        return list(self._rows.held)

    @property
    def rows_offset(self) -> list:
        """Tokens each batch row has been given (the RoPE offset of its next step)."""
        return list(self._rows.offset)

    @property
    def default_budget(self) -> int:
        """The budget a row gets when a first step starts it (tokens per KV head)."""
        return self._rows.default_budget

    @property
    def rows_budget(self) -> list:
        """Each batch row's budget in tokens per KV head."""
        return list(self._rows.budget)

    @property
    def slot_width(self) -> int:
        """Slots stored per row, empty ones included (the width attention reads)."""
        return self._slots.n

    def offset_array(self) -> mx.array:
        """Tokens each row has been given, ``[B]`` int32 (built once per value)."""
        key = tuple(self._rows.offset)
        if self._off_array[0] != key:
            self._off_array = (key, mx.array(self._rows.offset, dtype=mx.int32))
        return self._off_array[1]

    def held_after(self, S: int) -> int:
        """Tokens per KV head the widest row holds before appending a step of ``S`` tokens, after
        that step's eviction: the step's own rule (:meth:`Rows.need`, head groups and the
        selector's chunk rounding included), for masks built ahead of the step."""
        return self._rows.held_after(S, max(self._slots.g, 1), self._hooks.selector.evict_count)

    def hand_tokens(self, ids: Optional[mx.array]) -> None:
        """The next step's input token ids ``[B, S]`` int32, as the model hook hands them over
        before the model runs (ignored unless the scorer requires ``"tokens"``)."""
        if self._wants_tokens:
            self._tokens = ids

    def size(self) -> int:
        """Tokens held per KV head (the widest row; with head groups, slots / heads per row)."""
        return -(-self._slots.n // self._slots.g) if self._slots.g > 1 else self._slots.n

    def empty(self) -> bool:
        return self.keys is None

    def head_view(self) -> tuple:
        """``(keys, values, positions, scores)`` per KV head: ``[B, H, W, D]`` / ``[B, H, W]``.

        Without head groups this is the storage itself (slots in storage order). With head groups
        each head's slots are gathered out of its row, in slot order, ``W`` the most any head holds;
        a head holding fewer is padded with position -1 (a host sync: for inspection, not decode).
        """
        k, v = self._slots.float_kv()
        if self._slots.g <= 1:
            return k, v, self._slots.pos, self._slots.score
        slot, ok = self._slots.head_slots()
        b, r, g, w = ok.shape

        def take(a, fill):
            got = mx.take_along_axis(a, slot, axis=-1).reshape(b, r, g, w)
            return mx.where(ok, got, fill).reshape(b, r * g, w)

        def take_rows(a):
            got = mx.take_along_axis(a, slot[..., None], axis=2).reshape(b, r, g, w, -1)
            return mx.where(ok[..., None], got, 0).reshape(b, r * g, w, -1).astype(a.dtype)

        return take_rows(k), take_rows(v), take(self._slots.positions(), -1), take(self._slots.score, 0.0)

    @property
    def nbytes(self) -> int:
        """Bytes of every array the cache holds (key/value buffers, positions, scores, states)."""
        extra = sum(a.nbytes for st in self._states.values()
                    for a in _state.flatten_state(st)[1] + _state.derived_arrays(st))
        if self.keys is None:
            return extra
        return (self.keys.nbytes + self.values.nbytes + self._slots.pos.nbytes + self._slots.score.nbytes + extra
                + self._slots.extra_nbytes())

    @property
    def score_source(self) -> str:
        """``"queries"`` (real queries), ``"proxy"`` (key-as-query), ``"mixed"`` or ``"none"``."""
        if self._proxy_steps and self._query_steps:
            return "mixed"
        if self._proxy_steps:
            return "proxy"
        return "queries" if self._query_steps else "none"

    def _rowwise(self, values: list):
        """A per-row figure as users see it (one value for a single-sequence cache)."""
        if self.BATCHED:
            return list(values)
        return values[0] if values else 0

    def full_cache_nbytes(self) -> int:
        """Bytes mlx-lm's ``KVCache`` would hold for the tokens seen (it grows in steps of 256)."""
        if self.keys is None:
            return 0
        _, rows, _, dk = self.keys.shape
        h = rows * max(self._slots.g, 1)  # head groups store g KV heads per row
        dv = self.values.shape[-1]
        per_token = h * (dk * self.keys.dtype.size + dv * self.values.dtype.size)
        step = 256
        return sum(-(-max(o, 0) // step) * step for o in self._rows.offset) * per_token

    @property
    def diagnostics(self) -> dict:
        """What the cache did: budget, tokens seen and kept, evictions (per row, per KV head),
        the compression in tokens and in bytes, where scores came from, plus each component's
        own figures (e.g. merges)."""
        g = max(self._slots.g, 1)
        kept = [_per_head(n, g) for n in self._rows.held or [0]]
        seen = self._rows.offset or [0]
        held = self.nbytes
        out = {
            "method": self.method.name,
            "layer": self.info.layer,
            "budget": self._rowwise(self._rows.budget or [self._rows.default_budget]),
            "offset": self._rowwise(seen),
            "tokens_kept": self._rowwise(kept),
            "compression_tokens": self._rowwise([o / n if n else 1.0 for o, n in zip(seen, kept)]),
            "compression_bytes": self.full_cache_nbytes() / held if held and self.keys is not None else 1.0,
            "evictions": self._rowwise([_per_head(e, g) for e in self._rows.evicted or [0]]),
            "score_source": self.score_source,
            # steps scored from the model's real queries / from keys as proxy queries
            "query_steps": self._query_steps,
            "proxy_steps": self._proxy_steps,
            "nbytes": held,
            # scoring passes (whole-model figures, the same in every layer): extra forwards the
            # scorer asked for, their tokens per row and their wall time
            "scoring_passes": self._passes,
            "scoring_pass_tokens": self._rowwise(self._rows.passed or [0]),
            "scoring_pass_seconds": self._pass_seconds,
        }
        for kind in KINDS:
            diagnose = self._hooks.of(kind).diagnostics
            if diagnose is not None:
                for key, value in diagnose(self._states[kind]).items():
                    out[key] = self._rowwise(value) if isinstance(value, list) else value
        return out

    @property
    def tokens_kept(self):
        """Tokens currently held per row and KV head (the mean over a head group's heads)."""
        g = max(self._slots.g, 1)
        return self._rowwise([_per_head(n, g) for n in self._rows.held or [0]])

    @property
    def evictions(self):
        """Tokens evicted so far (per row, per KV head)."""
        g = max(self._slots.g, 1)
        return self._rowwise([_per_head(e, g) for e in self._rows.evicted or [0]])


def _per_head(total: int, g: int):
    """A head group's count per KV head: an int when it divides evenly, else the mean."""
    return total // g if total % g == 0 else total / g
