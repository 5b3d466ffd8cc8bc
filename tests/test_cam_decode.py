"""CaM's decode fast path: the compiled one-loser merge, key norms kept between merges (only
the slots the cache wrote since its last eviction are redone) and the gate's host-side hash --
each checked against the plain computation it replaces."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress import make_prompt_cache
from kvcompress_cam.merge import GatedMerge, MergeState, gate_uniforms

from test_cam import dispose, distinct_evict, make_ev, np_, rnd
from test_cam_cache import merges, models, run  # noqa: F401 (models: fixture)


@pytest.mark.parametrize("merge", ["sim_weighted", "mean"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_compiled_decode_merge_equals_the_eager_one(merge, dtype, monkeypatch):
    """The decode path (one loser per row) runs as an ``mx.compile``d function; it computes what
    the eager operations compute (same targets, gate decisions and merge count; values to float
    rounding)."""
    from kvcompress_cam import merge as merge_mod

    b, h, t, d = 2, 4, 48, 16
    keys, values = rnd((b, h, t, d), 1, dtype), rnd((b, h, t, d), 2, dtype)
    scores = mx.abs(rnd((b, h, t), 3)) * 5
    evict = distinct_evict(b, h, t, 1, 4, low=4)
    gm = GatedMerge(merge=merge, merge_keys=True, transfer_mass=True, n_sink=4, seed=7)
    outs = []
    for compiled in (True, False):
        monkeypatch.setattr(merge_mod, "_COMPILE", compiled)
        monkeypatch.setattr(merge_mod, "_FNS", {})
        ev = make_ev(keys, values, scores, evict, layer=3, draw_id=11, offset=300)
        *arrays, n = dispose(gm, ev)
        outs.append([np_(x) for x in arrays] + [n])
        fn = merge_mod._FNS[(merge, True, True, 4, True, True, False, False)]  # the decode function in use
        assert (type(fn).__name__ == "_gc_func") == compiled  # mx.compile's wrapper type
    (kc, vc, sc, nc), (ke, ve, se, ne) = outs
    assert int(nc) == int(ne) > 0
    tol = 1e-6 if dtype == mx.float32 else 1e-3
    for a, e in ((kc, ke), (vc, ve), (sc, se)):
        np.testing.assert_allclose(a.astype(np.float32), e.astype(np.float32), atol=tol, rtol=tol)


@pytest.mark.parametrize("batch", [1, 2])
def test_decode_merge_reusing_key_norms_equals_computing_them(models, batch, monkeypatch):
    """A decode merge reuses the key norms of the previous eviction for every slot the cache did
    not write since (``Eviction.written``); through chunks, decode steps, a trimmed step and a
    deep copy it picks the targets and produces the logits of computing every norm afresh."""
    import copy

    from kvcompress.engine.slots import Slots

    model = models["gqa"]
    seen = []
    real_rows = GatedMerge._nearest_rows  # (a decode dispose's, and a planned eviction's reads)

    def spy(self, ev):
        seen.append(ev.written is not None and isinstance(ev.state, MergeState) and ev.state.norms is not None)
        return real_rows(self, ev)

    monkeypatch.setattr(GatedMerge, "_nearest_rows", spy)

    def drive(fresh: bool):
        if fresh:  # the cache never says which slots it wrote: every norm is computed
            monkeypatch.setattr(Slots, "written_slots", lambda self, since="written": None)
        else:
            monkeypatch.undo()
            monkeypatch.setattr(GatedMerge, "_nearest_rows", spy)
        caches = make_prompt_cache(model, "cam", budget=16)
        out = run(model, caches, batch=batch, n_prompt=40, n_decode=10, chunk=8, seed=3)
        tok = mx.argmax(out[-1][:, -1:], axis=-1)
        model(tok, cache=caches)
        for c in caches:  # a decode step taken back: its slot is freed, then reused
            c.trim(1)
        out += run(model, caches, batch=batch, n_prompt=1, n_decode=6, seed=4)
        twin = copy.deepcopy(caches)
        out += run(model, twin, batch=batch, n_prompt=1, n_decode=6, seed=5)
        return [np.array(x) for x in out], twin

    del seen[:]
    got, a = drive(fresh=False)
    reused = sum(seen)
    want, b = drive(fresh=True)
    assert reused >= 20  # the decode steps really reused norms
    for x, y in zip(got, want):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)
        assert (x.argmax(-1) == y.argmax(-1)).all()
    for ca, cb in zip(a, b):
        assert merges(ca) == merges(cb)
        np.testing.assert_allclose(np.array(ca.values), np.array(cb.values), atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), layer=st.integers(0, 200), head0=st.integers(0, 64),
       h=st.integers(1, 8), offsets=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=4))
def test_host_draw_keys_equal_the_device_hash(seed, layer, head0, h, offsets):
    """The decode merge hashes (seed, layer, head, offset) on the host: the same bits as the
    device hash that :func:`gate_uniforms` uses, so every gate draw is unchanged."""
    from kvcompress_cam import draws as mm

    base = mm._seed_base(seed, layer)
    host = mm._host_draw_keys(base, tuple(range(head0, head0 + h)), tuple(offsets))
    heads = mx.arange(head0, head0 + h, dtype=mx.uint32).reshape(1, h, 1)
    offs = mx.array(offsets, dtype=mx.uint32).reshape(-1, 1, 1)
    device = mm._draw_keys(mx.array(base, mx.uint32), heads, offs)
    assert host.shape == (len(offsets), h, 1)
    assert mx.array_equal(host, device).item()
    pos = mx.array(offsets, dtype=mx.int32).reshape(-1, 1, 1) // 3
    assert mx.array_equal(mm._draws(host, pos), gate_uniforms(seed, layer, heads, offs, pos)).item()


def test_written_slot_record_never_outlives_the_keys_it_describes(models):
    """The cache's record of the slots written since an eviction refers to its current keys or
    is cleared -- after decode steps, a chunk, batch merge / filter / extend / extract and a
    state reload -- so it never keeps an old keys array alive nor describes one it no longer holds."""
    from kvcompress import BatchCompressedKVCache

    model = models["gqa"]

    def check(caches):
        for c in caches:
            written = c.parts.slots.written
            assert written is None or written[0] is c.keys

    def decode(caches, rows, n, seed):
        tok = mx.array(np.random.default_rng(seed).integers(3, 90, (rows, 1)), dtype=mx.int32)
        for _ in range(n):
            tok = mx.argmax(model(tok, cache=caches)[:, -1:], axis=-1)
            mx.eval(tok)
            check(caches)

    solo = [make_prompt_cache(model, "cam", budget=16) for _ in range(3)]
    for i, caches in enumerate(solo):
        run(model, caches, n_prompt=30 + 5 * i, n_decode=4, seed=i)
        check(caches)
    batch = [BatchCompressedKVCache.merge([s[layer] for s in solo[:2]]) for layer in range(len(solo[0]))]
    check(batch)
    decode(batch, 2, 3, 7)
    assert any(c.parts.slots.written is not None for c in batch)  # decode steps are recorded
    for c, other in zip(batch, solo[2]):
        c.filter([1])
        c.extend(BatchCompressedKVCache.merge([other]))
    check(batch)
    decode(batch, 2, 3, 8)
    one = [c.extract(0) for c in batch]
    check(one)
    for c in one:
        c.state = c.state
    check(one)
    run(model, one, n_prompt=5, n_decode=3, seed=9)
    check(one)
