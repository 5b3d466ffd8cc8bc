"""Decode attention over head-group rows (AdaKV's storage) without the owner mask.

A row holds the slots of ``g`` KV heads, each slot tagged with its head, so the heads hold
different counts within uniform bytes. Masking every query head to its own KV head's slots
costs ``g`` times the softmax of uniform budgets (and on the CPU the softmax, not the products,
is most of a decode step's attention). Instead each head's slots are listed once, as columns:

* :class:`HeadColumns` ``dest [B, R, g, W]``: the row slot of each of head ``h``'s columns,
  :data:`PAD` where the head holds fewer than ``W``;
* a decode step takes the products of its query over the whole row (``[B, R, G, T]``, one
  matrix product per row as before), gathers each query head's own columns, takes the softmax
  over those ``W`` alone and puts the weights back on the row's slots, zero elsewhere, for the
  value product and the mass: exactly the masked row's visible set, ``1 / g`` of its softmax;
* on the CPU, where kvcompress's kernels are built, :func:`attend_owned` skips the lists: one
  kernel takes each query head's softmax over its own slots of the row, reading the owner from
  the slots' packed positions (a gather, a softmax and a scatter in one pass, the same
  ``1 / g``);
* the list is rebuilt after an eviction (or any other change of the row's layout) and extended
  by one column per decode token (the ``g`` slots the token was written to, which
  :attr:`Slots.appended` names). ``W`` must be read
  on the host: :meth:`Slots.head_bound` bounds it without waiting for the step in flight.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from .._lowbit import owner_softmax
from ..ops import NEG, _exp_shifted, _f32

__all__ = ["HeadColumns", "PAD", "attend_columns", "attend_owned", "head_columns"]

#: a column no head holds: negative indices wrap, so it reads (and writes) one column past the
#: row, which :func:`attend_columns` appends to the products (a logit of ``NEG``) and drops
PAD = -1


class HeadColumns:
    """What a head-group row's layout lets decode attention skip recomputing: ``dest``, the
    column lists of the layout ``version`` (None: none listed), and the most slots any head
    holds, ``counts`` (an int, or a scalar array evaluated with that step and read later),
    when the slots had stored ``tokens`` tokens."""

    def __init__(self, version: int, dest: Optional[mx.array], counts, tokens: int):
        self.version, self.dest, self.counts, self.tokens = version, dest, counts, tokens


def head_columns(slots) -> mx.array:
    """``dest [B, R, g, W]`` int32 for the row layout ``slots`` holds now (see the module)."""
    cols: Optional[HeadColumns] = slots.columns
    if cols is not None and cols.dest is not None:
        if cols.version == slots.version:
            return cols.dest
        app = slots.appended
        if app is not None and app[:2] == (cols.version, slots.version):  # one token: a column (its g slots)
            cols.dest = mx.concatenate([cols.dest, app[2][..., None]], axis=-1)
            cols.version = slots.version
            return cols.dest
    w = slots.head_bound()
    owner = slots.owner()
    counts = slots.head_counts(owner)
    slot, ok = slots.head_index(counts, w, owner)
    dest = mx.where(ok, slot, PAD)
    slots.counted(counts, dest)
    return dest


def attend_columns(queries, keys, values, scale: float, dest: mx.array, mass: bool):
    """One query per head over head-group rows through :func:`head_columns` ``dest``: the
    masked row's softmax (:func:`kvcompress.ops.attention` with ``owner``) over each head's own
    slots only. Returns ``(out [B, H_q, 1, D], "group" mass [B, R, T] or None)``.

    ``e = exp(x - max x)`` is taken over the columns, but summed on the row (slot order), so
    the result depends on the row's layout only, never on the lists' order or padding: a saved
    and loaded cache, whose lists are rebuilt, continues bit for bit."""
    b, h_q = queries.shape[:2]
    r, t = keys.shape[1], keys.shape[2]
    g = dest.shape[2]
    rep = h_q // r // g  # query heads per KV head
    logits = _row_logits(queries, keys, scale)
    # one more column (PAD's) of NEG; [B, R, g, rep, T + 1]: each KV head's query heads together
    logits = mx.pad(logits.reshape(b, r, g, rep, t), [(0, 0)] * 4 + [(0, 1)], constant_values=NEG)
    at = dest[:, :, :, None, :]  # each query head's KV head's columns
    x = mx.take_along_axis(logits, at, axis=-1)
    e = _exp_shifted(x)  # as ops' softmax (0 on padding)
    # onto the row's slots, zero elsewhere (padding onto the extra column, dropped)
    full = mx.put_along_axis(mx.zeros(logits.shape, mx.float32), at, e, axis=-1).reshape(b, r, h_q // r, t + 1)[..., :t]
    return _weighted(full / full.sum(axis=-1, keepdims=True), queries, values, g, mass)


def attend_owned(queries, keys, values, scale: float, pos: mx.array, shift: int, g: int, mass: bool):
    """:func:`attend_columns` without the lists, where the CPU kernels run (else None): the
    products over the row, then each query head's softmax over the slots whose packed position
    ``pos`` ``[B, R, T]`` names its KV head (``pos >> shift``;
    :func:`kvcompress._lowbit.owner_softmax`: the max and the sum over those slots, in slot
    order, 0 elsewhere), then the value product. The result depends on the row's layout only,
    as the columns' does."""
    kernel = owner_softmax()
    if kernel is None:
        return None
    logits = _row_logits(queries, keys, scale)
    b, r, hr, t = logits.shape
    w = kernel(logits.reshape(b, r, g, hr // g, t), pos, shift=shift).reshape(b, r, hr, t)
    return _weighted(w, queries, values, g, mass)


def _row_logits(queries, keys, scale: float) -> mx.array:
    """``[B, R, G, T]`` float32: each row's query heads (one query each) against all its slots."""
    b, h_q, _, d = queries.shape
    r = keys.shape[1]
    return (_f32(queries.reshape(b, r, h_q // r, d)) * scale) @ _f32(keys).swapaxes(-1, -2)


def _weighted(w: mx.array, queries, values, g: int, mass: bool):
    """``(out [B, H_q, 1, D], "group" mass or None)`` from the row weights ``w`` ``[B, R, G, T]``."""
    out = (w @ _f32(values)).reshape(queries.shape[0], queries.shape[1], 1, -1).astype(queries.dtype)
    return out, (w.mean(axis=2) * g if mass else None)
