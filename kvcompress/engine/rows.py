"""Rows: a cache's per-row host bookkeeping, and the one rule for how many slots leave.

Every fact here is a Python list with one entry per row (batch sequence), so no step needs a
device sync to know what to do. Counts are in *slots*: with head groups (``g`` KV heads per
storage row, AdaKV) a token takes ``g`` slots of its row.

The eviction rule (deferred eviction, as mlx-lm's ``RotatingKVCache``): before storing ``v`` new
tokens, a row holding ``n`` slots that would exceed its budget ``b`` keeps ``g * (b - 1)`` old
slots, so ``need = n - g * (b - 1)`` leave (:meth:`Rows.need`); the selector may round that up
to whole chunks (its ``evict_count`` hook). The count does not depend on ``v``, so a trimmed step
is exact. A budget is usable only when it leaves room past the selector's protected tokens
(:func:`room_to_evict`).
"""

from __future__ import annotations

from typing import Callable, Optional

__all__ = ["Rows", "room_to_evict"]


def room_to_evict(selector, budget: int) -> bool:
    """Whether ``budget`` tokens leave a token the selector may evict (``reserved(b) < b``)."""
    return int(budget) >= 1 and selector.reserved(int(budget)) < int(budget)


class Rows:
    """Per-row host facts of one cache layer.

    ``held``: slots held; ``offset``: tokens seen including a prompt's right padding (the RoPE
    offset of the next step; negative while left padding remains); ``budget``: tokens kept;
    ``evicted``: slots evicted so far; ``passed``: scoring-pass tokens run; ``pad``: right
    padding stored so far (until ``finalize``); ``pending``: real tokens still to come of a
    right-padded prompt; ``right``: that prompt's right padding.
    """

    def __init__(self, default_budget: int, offsets: Optional[list] = None):
        self.default_budget = int(default_budget)
        b = 0 if offsets is None else len(offsets)
        self.held: list = [0] * b
        self.offset: list = [int(o) for o in offsets] if offsets is not None else []
        self.budget: list = [self.default_budget] * b
        self.evicted: list = [0] * b
        self.passed: list = [0] * b
        self.pad: Optional[list] = None
        self.pending: Optional[list] = None
        self.right: Optional[list] = None

    # -- shape ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.held)

    def ensure(self, b: int) -> None:
        """Start ``b`` empty rows if none exist yet (a single cache learns its batch at the first
        step); keep the scoring-pass counts as long as the rows."""
        if not self.held:
            self.held, self.offset = [0] * b, [0] * b
            self.budget, self.evicted = [self.default_budget] * b, [0] * b
        if len(self.passed) != b:
            self.passed = (self.passed + [0] * b)[:b]

    # -- the rules ------------------------------------------------------------------------------

    def seen(self) -> list:
        """Tokens each row has really seen (``offset`` without a prompt's right padding)."""
        if self.pad is None:
            return self.offset
        return [o - p for o, p in zip(self.offset, self.pad)]

    def take_valid(self, S: int) -> list:
        """Real tokens of each row in the next step of ``S`` (fewer in a right-padded prompt)."""
        if self.pending is None:
            return [S] * len(self.held)
        out = [min(S, r) for r in self.pending]
        self.pending = [r - v for r, v in zip(self.pending, out)]
        return out

    def need(self, valid: list, g: int) -> list:
        """Slots each row frees before storing ``valid[b]`` tokens (``g`` slots each): a row
        over its budget keeps ``g * (budget - 1)`` old slots."""
        return [max(n - g * (bud - 1), 0) if n + g * v > g * bud else 0
                for n, v, bud in zip(self.held, valid, self.budget)]

    def held_after(self, S: int, g: int, evict_count: Callable[[int, int], int]) -> int:
        """Tokens per KV head the widest row holds before appending a step of ``S`` tokens,
        after that step's eviction (``evict_count``: the selector's rounding to chunks)."""
        if not self.held:
            return 0
        need = self.need([S] * len(self.held), g)
        slots = max(n - (int(evict_count(e, b)) if e else 0) for n, e, b in zip(self.held, need, self.budget))
        return -(-slots // max(g, 1))

    def over_budget(self) -> bool:
        """Whether some row has seen more tokens than it keeps."""
        return any(o > b for o, b in zip(self.offset, self.budget))

    # -- changes -------------------------------------------------------------------------------

    def stored(self, valid: list, g: int) -> None:
        self.held = [n + g * x for n, x in zip(self.held, valid)]

    def freed(self, counts) -> None:
        self.held = [n - c for n, c in zip(self.held, counts)]
        self.evicted = [t + c for t, c in zip(self.evicted, counts)]

    def advance(self, S: int, valid: list) -> None:
        """Offsets move by the step's ``S``; a right-padded step counts its padding until
        :meth:`finalize`."""
        self.offset = [o + S for o in self.offset]
        if self.pad is not None or any(v < S for v in valid):
            self.pad = [p + S - v for p, v in zip(self.pad or [0] * len(valid), valid)]

    def rewind(self, n: int, g: int) -> None:
        """The last ``n`` tokens of every row leave (an exact trim)."""
        self.held = [x - n * g for x in self.held]
        self.offset = [o - n for o in self.offset]

    def finalize(self) -> None:
        """After a right-padded prompt: offsets count real tokens only."""
        if self.right is not None:
            self.offset = [o - p for o, p in zip(self.offset, self.right)]
            self.right = self.pending = self.pad = None

    # -- row edits (batching) ------------------------------------------------------------------

    _LISTS = ("held", "offset", "budget", "evicted", "passed")
    _PROMPT = ("pad", "pending", "right")

    def take(self, rows: list) -> "Rows":
        """A new ``Rows`` holding ``rows`` (in that order), a prompt's padding included."""
        out = Rows(self.default_budget)
        for name in self._LISTS:
            setattr(out, name, [getattr(self, name)[i] for i in rows])
        for name in self._PROMPT:
            v = getattr(self, name)
            setattr(out, name, None if v is None else [v[i] for i in rows])
        return out

    @classmethod
    def concat(cls, parts: list, default_budget: int, empty_as_row: bool = False) -> "Rows":
        """The rows of ``parts`` one after another (``empty_as_row``: a part with no rows yet, a
        single cache before its first step, counts as one row holding nothing)."""
        out = cls(default_budget)
        for p in parts:
            src = p if p.held or not empty_as_row else Rows(p.default_budget, [0])
            for name in cls._LISTS:
                getattr(out, name).extend(getattr(src, name))
        return out

    def to_meta(self) -> dict:
        return {"rows_n": self.held, "rows_off": self.offset, "rows_budget": self.budget,
                "rows_evicted": self.evicted}

    @classmethod
    def from_meta(cls, m: dict, default_budget: int, passed: Optional[list] = None) -> "Rows":
        out = cls(default_budget)
        out.held, out.offset = list(m["rows_n"]), list(m["rows_off"])
        out.budget, out.evicted = list(m["rows_budget"]), list(m["rows_evicted"])
        out.passed = list(passed) if passed is not None else [0] * len(out.held)
        return out
