"""``Slots`` (``kvcompress/engine/slots.py``): the device storage and its layout operations,
tested without a model. The invariant every operation keeps: the set of ``(position, key,
value, score)`` a row holds changes only as the operation says (freed slots leave, new ones
arrive), whatever the slot order."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress.engine import Slots

B, H, D = 2, 2, 4


def _held(s: Slots) -> list:
    """Per (row, head): {position: (key[0], value[0], score)} of the non-empty slots."""
    k, v = s.kv()
    pos, k, v, sc = (np.array(a) for a in (s.pos, k, v, s.score))
    return [[{int(p): (float(k[b, h, j, 0]), float(v[b, h, j, 0]), float(sc[b, h, j]))
              for j, p in enumerate(pos[b, h]) if p >= 0} for h in range(H)] for b in range(B)]


def _step(s: Slots, offset: int, S: int):
    g = mx.arange(offset, offset + S, dtype=mx.float32).reshape(1, 1, S, 1)
    keys = mx.broadcast_to(g, (B, H, S, D)) + 0.5
    pos = s.new_positions([offset] * B, [S] * B, S, B, H)
    return keys, -keys, pos


def _filled(n: int) -> Slots:
    s = Slots()
    s.g = 1
    k, v, pos = _step(s, 0, n)
    s.append(k, v, pos, top=64)
    s.score = mx.broadcast_to(mx.arange(n, dtype=mx.float32), (B, H, n)) * 0.25
    return s


@settings(max_examples=60, deadline=None)
@given(n=st.integers(4, 40), data=st.data())
def test_freeing_then_compacting_keeps_exactly_the_survivors(n, data):
    s = _filled(n)
    before = _held(s)
    e = data.draw(st.integers(1, n - 1))
    free = np.stack([np.stack([np.random.default_rng(b * 7 + h + n).permutation(n)[:e] for h in range(H)])
                     for b in range(B)]).astype(np.int32)
    s.mark_freed(mx.array(free), None)
    s.compact([n - e] * B)
    after = _held(s)
    assert s.n == n - e and s.pos.shape[-1] == n - e
    for b in range(B):
        for h in range(H):
            gone = {int(p) for p in free[b, h]}
            assert after[b][h] == {p: x for p, x in before[b][h].items() if p not in gone}


@settings(max_examples=40, deadline=None)
@given(n=st.integers(4, 30), data=st.data())
def test_a_token_goes_into_the_slot_its_row_just_freed(n, data):
    s = _filled(n)
    before = _held(s)
    j = data.draw(st.integers(0, n - 1))
    freed = mx.full((B, H, 1), j, mx.int32)
    k, v, pos = _step(s, n, 1)
    s.write_token(k, v, (freed, None), pos)
    after = _held(s)
    assert s.n == n and s.last is not None and (np.array(s.last) == j).all()
    for b in range(B):
        for h in range(H):
            want = {p: x for p, x in before[b][h].items() if p != j}
            want[n] = (n + 0.5, -(n + 0.5), 0.0)  # the new token, score 0
            assert after[b][h] == want
    s.drop_last(1, s.score)  # an exact trim frees it again
    assert all(n not in hd for row in _held(s) for hd in row)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(2, 20), width=st.integers(0, 30), rows=st.lists(st.integers(0, B - 1), min_size=1, max_size=3))
def test_rows_taken_and_laid_out_keep_what_they_hold(n, width, rows):
    s = _filled(n)
    before = _held(s)
    width = max(width, n)  # a layout never drops a held slot
    part = s.take_rows(rows)
    out = Slots()
    out.set_layouts([part.laid_out(width)], width)
    assert out.n == width
    k, v = out.kv()
    pos, k, v, sc = (np.array(a) for a in (out.pos, k, v, out.score))
    for i, b in enumerate(rows):
        for h in range(H):
            got = {int(p): (float(k[i, h, j, 0]), float(v[i, h, j, 0]), float(sc[i, h, j]))
                   for j, p in enumerate(pos[i, h]) if p >= 0}
            assert got == before[b][h]
            assert (pos[i, h, : width - n] == -1).all()  # empty slots first, held slots last


def test_head_groups_pack_the_owner_above_the_position():
    s = Slots()
    s.g = 2
    pos = s.new_positions([5, 9], [3, 3], 3, 2, 1)  # [B, 1, S * g]
    s.pos = pos
    assert np.array(s.positions()).tolist() == [[[5, 5, 6, 6, 7, 7]], [[9, 9, 10, 10, 11, 11]]]
    assert np.array(s.owner()).tolist() == [[[0, 1, 0, 1, 0, 1]]] * 2
