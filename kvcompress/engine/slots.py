"""Slots: one layer's device storage and every operation on its layout.

* ``keys`` / ``values`` ``[B, R, C, D]``: ``R = H_kv / g`` storage rows of ``g`` KV heads each
  (head groups, AdaKV; ``g = 1`` otherwise), capacity ``C >= n`` (grown in steps of 256); low-bit
  :class:`~kvcompress.storage.QuantizedSlots` where the method's storage quantizes;
* ``pos`` ``[B, R, n]`` int32: the token position of each slot, ``-1`` for an empty one; with head
  groups the owner head (``0..g-1``) is packed above bit 24;
* ``score`` ``[B, R, n]`` float32: the scorer's running score of each slot;
* ``n``: the stored width; ``g``: KV heads per row (0 before the first step);
* ``written``: ``(keys, [slots])`` written since the last eviction (while those are all that
  changed: a disposition may then re-read only them); ``observed``: the same since the scorer's
  last observation (``Observation.written``); ``last``: the slots the last single token
  went into (None when it was appended), which an exact trim frees;
* ``version``: counts the changes of ``pos`` (every layout change makes a new one); head groups:
  ``columns``, each head's slots listed for decode attention (:mod:`.heads`), ``appended``
  ``(version before, version after, slots [B, R, g])`` of the last token written into empty
  slots or appended (which extends the lists by a column), ``tokens``: the tokens stored so far;
  ``free``: after an eviction that freed more than one token's slots, the row's empty slots in
  order, which the following tokens take in turn (``(slots [B, R, E], taken, version)``, valid
  while the layout is that ``version``: the first empty slots, without a search per token).

Rows may hold different counts; a row's unused slots are empty (position -1), and the masks come
from the positions, so every layout here is exact for attention.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..ops import owner_mask
from ..storage import as_float, concat_slots, contiguous, fill_from_end, pad_slots, put_slots, take_slots, zeros_like_rows
from .heads import HeadColumns

__all__ = ["Slots", "OWNER_SHIFT", "split_owner"]

OWNER_SHIFT = 24  # head-group owner bits above the position (positions < 2**24 tokens)
_POS_MASK = (1 << OWNER_SHIFT) - 1


def split_owner(pos: mx.array) -> tuple:
    """Packed slot positions (head groups) -> ``(positions, owner heads)``, ``-1`` where empty."""
    return mx.where(pos >= 0, pos & _POS_MASK, -1), mx.where(pos >= 0, pos >> OWNER_SHIFT, -1)


class Slots:
    """The stored slots of one layer (see the module docstring)."""

    step = 256

    def __init__(self):
        self.version = 0
        self.tokens = 0
        self.keys = self.values = None
        self.pos: Optional[mx.array] = None
        self.score: Optional[mx.array] = None
        self.n = 0
        self.g = 0
        self.written: Optional[tuple] = None
        self.observed: Optional[tuple] = None
        self.last: Optional[mx.array] = None
        self.columns = None  # heads.HeadColumns
        self.appended: Optional[tuple] = None
        self.free: Optional[tuple] = None

    @property
    def pos(self) -> Optional[mx.array]:
        return self._pos

    @pos.setter
    def pos(self, value: Optional[mx.array]) -> None:
        self._pos = value
        self.version += 1

    # -- reading ------------------------------------------------------------------------------

    def kv(self) -> tuple:
        """The stored keys and values, ``n`` wide."""
        if self.keys.shape[2] == self.n:
            return self.keys, self.values
        return self.keys[..., : self.n, :], self.values[..., : self.n, :]

    def float_kv(self) -> tuple:
        """The stored keys and values as components see them (low-bit slots lazily dequantized:
        only what a component reads is computed)."""
        k, v = self.kv()
        return as_float(k), as_float(v)

    def positions(self) -> mx.array:
        """Token position of each slot (-1: empty), without the head-group owner bits."""
        return self.positions_and_owner()[0]

    def owner(self):
        """Head of each slot within its row (head groups only; -1: empty), else None."""
        return self.positions_and_owner()[1]

    def positions_and_owner(self) -> tuple:
        """``(positions(), owner())`` from one split."""
        return (self.pos, None) if self.g <= 1 else split_owner(self.pos)

    def head_counts(self, owner: Optional[mx.array] = None) -> mx.array:
        """``[B, R, g]`` int32: the slots each head of each row holds (head groups; ``owner``:
        :meth:`owner`, if the caller has it)."""
        owner = self.owner() if owner is None else owner
        return owner_mask(owner, self.g, self.g).astype(mx.int32).sum(axis=-1)

    def head_index(self, counts: mx.array, w: int, owner: Optional[mx.array] = None) -> tuple:
        """Each head's slots of its row in slot order, ``W = w`` columns: ``(slot [B, R, g, W]
        int32, ok [B, R, g, W])``, a head holding fewer padded (``ok`` False, ``slot`` any)."""
        g, t = self.g, self.pos.shape[-1]
        owner = self.owner() if owner is None else owner
        order = mx.argsort(mx.where(owner >= 0, owner, g) * t + mx.arange(t, dtype=mx.int32), axis=-1)  # heads contiguous
        start = mx.cumsum(counts, axis=-1) - counts  # [B, R, g]: each head's first place in that order
        col = mx.arange(w, dtype=mx.int32)
        b, r = owner.shape[:2]
        at = mx.minimum(start[..., None] + col, t - 1).reshape(b, r, g * w)
        slot = mx.take_along_axis(order, at, axis=-1).reshape(b, r, g, w).astype(mx.int32)
        return slot, col < counts[..., None]

    def head_slots(self) -> tuple:
        """:meth:`head_index` as wide as the most any head holds (read on the host, a sync):
        ``(slot [B, R, g * W], ok [B, R, g, W])``."""
        owner = self.owner()
        counts = self.head_counts(owner)
        w = max(int(counts.max().item()), 1)
        if self.columns is None or self.columns.version != self.version:  # (keep this layout's lists)
            self.counted(w)
        slot, ok = self.head_index(counts, w, owner)
        return slot.reshape(slot.shape[0], slot.shape[1], -1), ok

    def head_bound(self) -> int:
        """At least the most slots any head of any row holds: the counts last taken (an array
        computed steps ago, read now without waiting for the step in flight) plus one per token
        stored since (an eviction only removes); the exact count, a sync, when none was taken."""
        cols = self.columns
        if cols is None or cols.counts is None:
            return max(int(self.head_counts().max().item()), 1)
        return max(int(cols.counts if isinstance(cols.counts, int) else cols.counts.item()) + self.tokens - cols.tokens, 1)

    def counted(self, counts, dest: Optional[mx.array] = None) -> None:
        """The most slots any head holds now (an int, or ``[B, R, g]`` counts, lazy: their max
        is evaluated with the step, see :meth:`derived_arrays`) and, with ``dest``, the column
        lists of this layout (:mod:`.heads`)."""
        most = counts if isinstance(counts, int) else counts.max().reshape(1)
        self.columns = HeadColumns(self.version if dest is not None else -1, dest, most, self.tokens)

    def derived_arrays(self) -> list:
        """What the slots derived from the step's layout (lazy until the step is evaluated)."""
        cols = self.columns
        return [a for a in (cols.dest, cols.counts) if isinstance(a, mx.array)] if cols is not None else []

    def extra_nbytes(self) -> int:
        """Bytes of what the slots derive from their layout (the column lists, the count)."""
        return sum(a.nbytes for a in self.derived_arrays())

    def holes(self, held: list) -> bool:
        """Whether some row holds fewer slots than the width (empty slots in it)."""
        return any(n != self.n for n in held)

    def fits_one_token(self, held: list, slack: int = 0, top: int = 0) -> bool:
        """Whether one token (``g`` slots per row) fits into every row's empty slots, without
        more than one token's worth of empty width left over -- with head groups, ``slack``
        (the slots one eviction frees, refilled in place rather than compacted away: decode
        attends them by column lists, which empty slots do not widen) while the width stays
        within ``top`` (the widest budget in slots)."""
        g = self.g
        room = max(g, slack) if g > 1 and self.n <= top else g
        return all(self.n - n >= g for n in held) and self.n <= max(held) + room

    def written_slots(self, since: str = "written"):
        """The slots written since the last eviction (``since="observed"``: since the scorer's last
        observation), if those are all that changed (else None)."""
        w = getattr(self, since)
        if w is None or w[0] is not self.keys:
            return None
        if len(w[1]) == 1:
            return w[1][0]
        return mx.concatenate(w[1], axis=-1) if w[1] else mx.zeros(self.pos.shape[:2] + (0,), mx.int32)

    # -- positions of new tokens ----------------------------------------------------------------

    def new_positions(self, offsets: list, valid: list, S: int, b: int, h: int) -> mx.array:
        """Positions of a step's tokens (offsets before the step; -1 for padding), ``g`` slots
        per token with head groups (the owner in the high bits)."""
        if self.g > 1:
            if S == 1 and min(valid) == 1 and min(offsets) >= 0:  # a decode token: built on the host
                packed = mx.array([[[o | (j << OWNER_SHIFT) for j in range(self.g)]] for o in offsets], mx.int32)
                return packed if h == 1 else mx.broadcast_to(packed, (b, h, self.g))
            return self.new_pos_from(_token_positions(offsets, valid, S, b, 1), b, h)
        return _token_positions(offsets, valid, S, b, h)

    def new_pos_from(self, pos: mx.array, b: int, h: int) -> mx.array:
        """Token positions ``[B, 1, S]`` (-1: none) as the ``[B, h, S * g]`` packed positions of
        their slots in rows of ``g`` heads (token-major, as :meth:`group_heads` lays keys out)."""
        S = pos.shape[-1]
        owner = mx.arange(self.g, dtype=mx.int32).reshape(1, 1, 1, self.g) << OWNER_SHIFT
        packed = mx.where(pos[..., None] >= 0, pos[..., None] | owner, -1)  # [B, 1, S, g]
        return mx.broadcast_to(packed.reshape(pos.shape[0], 1, S * self.g), (b, h, S * self.g))

    def group_heads(self, a: mx.array) -> mx.array:
        """``[B, H, S, D]`` -> ``[B, H / g, S * g, D]``: rows of ``g`` heads, token-major
        (``[t0: h0..h(g-1)][t1: ...]``)."""
        g = self.g
        if g <= 1:
            return a
        b, h, S, _ = a.shape
        if S == 1:
            return a.reshape(b, h // g, g, -1)
        return a.reshape(b, h // g, g, S, -1).transpose(0, 1, 3, 2, 4).reshape(b, h // g, S * g, -1)

    # -- layout changes -------------------------------------------------------------------------

    def mark_freed(self, slots: mx.array, real) -> None:
        """Freed slots become empty (position -1); ``real`` ``[B, R, E]`` marks the entries that
        are (rows freeing fewer pad their list)."""
        gone = mx.full(slots.shape, -1, mx.int32)
        if real is not None:
            gone = mx.where(real, gone, mx.take_along_axis(self.pos, slots, axis=-1))
        self.pos = mx.put_along_axis(self.pos, slots, gone, axis=-1)

    def write_token(self, keys, values, freed, pos, empty: int = 0) -> None:
        """One token (``g`` slots per row) into empty slots: the ones just freed, if exactly
        that many, else the first empty ones; ``pos`` ``[B, R, g]`` their positions; ``empty``:
        the empty slots every row holds (0: rows differ), whose sorted list :attr:`free` keeps
        for the next tokens (head groups)."""
        b, h, g = keys.shape[0], keys.shape[1], self.g
        free = None
        if freed is not None and freed[1] is None and freed[0].shape[-1] == g:
            slot = freed[0]  # the slots each row just freed: the token goes there
        else:
            if freed is not None:
                self.mark_freed(*freed)
            q = self.free
            if g > 1 and q is not None and q[2] == self.version and q[0].shape[-1] - q[1] == empty >= g:
                slot, free = q[0][..., q[1] : q[1] + g], (q[0], q[1] + g)  # the next of the list
            elif g == 1:
                slot = mx.argmax(self.pos < 0, axis=-1, keepdims=True).astype(mx.int32)
            else:
                # the first k empty slots: the k smallest keys (a partition, then a sort of k)
                k = empty if empty >= 2 * g else g
                ar = mx.arange(self.n, dtype=mx.int32)
                key = mx.where(self.pos < 0, ar, ar + self.n)
                first = mx.sort(mx.partition(key, k - 1, axis=-1)[..., :k], axis=-1)
                slot, free = (first[..., :g], (first, g)) if k > g else (first, None)
        idx = slot[..., None]
        before = self.version
        chain = [w is not None and w[0] is self.keys and len(w[1]) < 8 for w in (self.written, self.observed)]
        self.keys = put_slots(self.keys, idx, keys)
        self.values = put_slots(self.values, idx, values)
        self.pos = mx.put_along_axis(self.pos, slot, pos, axis=-1)
        self.score = mx.put_along_axis(self.score, slot, mx.array(0.0), axis=-1)
        self.last = slot
        self.written = (self.keys, self.written[1] + [slot]) if chain[0] else None
        self.observed = (self.keys, self.observed[1] + [slot]) if chain[1] else None
        # into empty slots (nothing freed this step): each head's column list grows by one
        self.appended = (before, self.version, slot) if freed is None and g > 1 else None
        self.free = free + (self.version,) if free is not None else None
        self.tokens += 1

    def compact(self, held: list) -> None:
        """Move empty slots to the left and drop those every row has; with equal rows, only the
        live slots above the count move into the holes below it (:func:`fill_from_end`)."""
        t, w, self.written = self.n, max(held), None
        if len(set(held)) == 1 and 4 * (t - w) <= t:
            dst, src = fill_from_end(self.pos, t - w)
            self.keys, self.values = (put_slots(a, dst, take_slots(a, src)) for a in (self.keys, self.values))
            self.pos, self.score = (
                mx.put_along_axis(a, dst, mx.take_along_axis(a, src, axis=-1), axis=-1)[..., :w]
                for a in (self.pos, self.score))
        else:
            ar = mx.arange(t, dtype=mx.int32)
            order = mx.argsort(mx.where(self.pos >= 0, ar + t, ar), axis=-1)[..., t - w :]
            self.keys, self.values = (take_slots(a, order) for a in self.kv())
            self.pos, self.score = (mx.take_along_axis(a, order, axis=-1) for a in (self.pos, self.score))
        self.n = w

    def append(self, keys, values, pos, top: int) -> None:
        """A step's slots after the stored ones; capacity grows in steps of 256, up to ``top``
        (the widest budget in slots) unless the step needs more."""
        b, h, S, _ = keys.shape
        prev = self.n
        if self.keys is None or prev + S > self.keys.shape[2]:
            need = prev + S
            cap = (need + self.step - 1) // self.step * self.step
            cap = min(cap, top) if need <= top else need
            new_k, new_v = zeros_like_rows(keys, b, h, cap - prev), zeros_like_rows(values, b, h, cap - prev)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
                self.pos = mx.zeros((b, h, 0), mx.int32)
                self.score = mx.zeros((b, h, 0), mx.float32)
            else:
                self.keys = concat_slots([self.keys[..., :prev, :], new_k])
                self.values = concat_slots([self.values[..., :prev, :], new_v])
        self.written = self.observed = None  # (the slice update below keeps the array object)
        self.keys[..., prev : prev + S, :] = keys
        self.values[..., prev : prev + S, :] = values
        before = self.version
        self.pos = mx.concatenate([self.pos, pos], axis=2)
        # one token after the stored slots: each head's column list grows by one (head j's slot: prev + j)
        self.appended = None
        if S == self.g > 1:
            at = mx.array([prev + j for j in range(S)], mx.int32)
            self.appended = (before, self.version, mx.broadcast_to(at, (b, h, S)))
        self.score = mx.concatenate([self.score, mx.zeros((b, h, S), mx.float32)], axis=2)
        self.n = prev + S
        self.last = None
        self.tokens += S // max(self.g, 1)  # one slot per head per token

    def drop_last(self, slots: int, scores: mx.array) -> None:
        """An exact trim: the last step's ``slots`` per row leave (freed where a single token was
        written into a hole, cut where it was appended); ``scores`` as they were before it."""
        if self.last is not None:
            self.pos = mx.put_along_axis(self.pos, self.last, mx.full(self.last.shape, -1, mx.int32), axis=-1)
            self.score = scores
        else:
            self.n -= slots
            self.pos = self.pos[..., : self.n]
            self.score = scores[..., : self.n]

    # -- rows (batching) ------------------------------------------------------------------------

    def _empty_copy(self) -> "Slots":
        out = Slots()
        out.g = self.g
        return out

    def take_rows(self, rows: list) -> "Slots":
        """A new ``Slots`` holding only ``rows`` (batch axis), same width."""
        out = self._empty_copy()
        if self.keys is not None:
            idx = mx.array(rows, dtype=mx.int32)
            k, v = self.kv()
            out.keys, out.values, out.pos, out.score = k[idx], v[idx], self.pos[idx], self.score[idx]
            out.n = self.n
        return out

    def laid_out(self, width: int) -> tuple:
        """``(keys, values, positions, scores)`` with every row's slots in ``width`` columns:
        held slots last, empty slots first."""
        t = self.n
        k, v = self.kv()
        pos, score = self.pos, self.score
        if t > width:
            ar = mx.arange(t, dtype=mx.int32)
            order = mx.argsort(mx.where(pos >= 0, ar + t, ar), axis=-1)[..., t - width :]
            k, v = take_slots(k, order), take_slots(v, order)
            pos, score = mx.take_along_axis(pos, order, axis=-1), mx.take_along_axis(score, order, axis=-1)
        elif t < width:
            pad = [(0, 0), (0, 0), (width - t, 0)]
            k, v = pad_slots(k, width - t), pad_slots(v, width - t)
            pos, score = mx.pad(pos, pad, constant_values=-1), mx.pad(score, pad)
        return k, v, pos, score

    def empty_layout(self, b: int, width: int) -> tuple:
        """``b`` rows of ``width`` empty slots shaped like these."""
        h = self.keys.shape[1]
        return (zeros_like_rows(self.keys, b, h, width), zeros_like_rows(self.values, b, h, width),
                mx.full((b, h, width), -1, mx.int32), mx.zeros((b, h, width), mx.float32))

    def set_layouts(self, parts: list, width: int) -> None:
        """Replace the storage by ``parts`` (laid out ``width`` wide) stacked along the batch."""
        self.written, self.observed, self.last, self.columns = None, None, None, None
        if parts:
            k, v, pos, score = zip(*parts)
            self.keys, self.values = concat_slots(list(k), axis=0), concat_slots(list(v), axis=0)
            self.pos, self.score = mx.concatenate(pos, axis=0), mx.concatenate(score, axis=0)
            self.n = width
        else:
            self.keys = self.values = self.pos = self.score = None
            self.n = 0

    def compacted_row(self, width: int) -> None:
        """Lay out this (single-row) storage ``width`` wide, contiguous in memory."""
        k, v, pos, score = self.laid_out(width)
        self.columns = None
        self.keys, self.values = contiguous(k), contiguous(v)
        self.pos, self.score, self.n = mx.contiguous(pos), mx.contiguous(score), width


def _token_positions(offsets: list, valid: list, S: int, b: int, h: int) -> mx.array:
    if S == 1 and all(x == 1 for x in valid) and min(offsets) >= 0:
        if len(set(offsets)) == 1:
            return mx.full((b, h, 1), offsets[0], mx.int32)
        return mx.broadcast_to(mx.array(offsets, dtype=mx.int32).reshape(-1, 1, 1), (b, h, 1))
    pos = mx.array(offsets, dtype=mx.int32).reshape(-1, 1, 1) + mx.arange(S, dtype=mx.int32).reshape(1, 1, S)
    if any(x < S for x in valid) or any(o < 0 for o in offsets):
        ok = (mx.arange(S).reshape(1, 1, S) < mx.array(valid, dtype=mx.int32).reshape(-1, 1, 1)) & (pos >= 0)
        pos = mx.where(ok, pos, -1)
    return mx.broadcast_to(pos, (b, h, S))
