"""Attention over head-group rows (AdaKV's storage: several KV heads' slots share a row, each
slot tagged with its head). After an eviction a chunk attends each KV head's own slots gathered
out of the row, and a decode step takes each query head's softmax over its own KV head's column
list only -- or, where kvcompress's CPU kernels run, each query head's softmax over the slots
its KV head owns in one kernel (:func:`kvcompress.engine.heads.attend_owned`, no lists). Each
must see exactly what the owner-masked attention over the whole row sees
(:func:`kvcompress.ops.attention` with ``owner``): the same outputs and the same attention mass
(sums in another order: a tolerance), so the same scores and evictions. The column lists' own
tests run with the kernels' path switched off (``columns``)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base

import kvcompress
from kvcompress import CompressedKVCache, ops
from test_lowbit import kernel  # noqa: F401  (the fixture: the built module, or a skip with the reason)
from kvcompress.engine import heads
from kvcompress.engine.heads import PAD

D = 16


@pytest.fixture
def columns(monkeypatch):
    """Decode over head-group rows by the column lists (the path where the CPU kernels do not run)."""
    monkeypatch.setattr(heads, "owner_softmax", lambda: None)


@pytest.fixture(params=["columns", "kernel"])
def decode_path(request, monkeypatch):
    """Both decode paths: the column lists, and the CPU kernels' owner softmax (skipped with the
    reason where they cannot be built)."""
    if request.param == "columns":
        monkeypatch.setattr(heads, "owner_softmax", lambda: None)
    else:
        request.getfixturevalue("kernel")
    return request.param


def _step(c, rng, n, kv_heads, rep, batch):
    """One step straight to the cache through mlx-lm's attention function; returns the output,
    the owner-masked reference over the row, the scores' change and the reference mass."""
    k = mx.array(rng.standard_normal((batch, kv_heads, n, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((batch, kv_heads, n, D)).astype(np.float32))
    q = mx.array(rng.standard_normal((batch, kv_heads * rep, n, D)).astype(np.float32) * 2)
    kk, vv = c.update_and_fetch(k, v)
    slots = c.parts.slots
    before = np.array(c.slot_scores)
    qpos = mx.broadcast_to(mx.arange(c.offset - n, c.offset, dtype=mx.int32).reshape(1, 1, n), (batch, 1, n))
    want, mass = ops.attention(q, kk, vv, D**-0.5, slots.positions(), qpos, owner=slots.owner(),
                               heads_per_row=c.heads_per_row, mass="group")
    mask = c.make_mask(n, return_array=False) if n > 1 else None
    out = base.scaled_dot_product_attention(q, kk, vv, cache=c, scale=D**-0.5, mask=mask)
    return np.array(out), np.array(want), np.array(c.slot_scores) - before, np.array(mass)


@pytest.mark.parametrize("scorer", ["h2o", "snapkv"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("kv_heads,rep", [(2, 2), (3, 3), (4, 1)])
@pytest.mark.parametrize("step", [1, 8])
def test_steps_attend_each_heads_own_slots_as_the_owner_mask_does(scorer, batch, kv_heads, rep, step, decode_path):
    """Chunks (each head's slots gathered) and decode steps (each head's columns, rebuilt after
    an eviction, extended by a column per token in between when ``step`` > heads per row; or the
    kernels' owner softmax)."""
    method = kvcompress.build_method(scorer=scorer, selector={"name": "adaptive", "recent": 2, "step": step},
                                     disposition="drop", budget={"name": "uniform", "budget": 16})
    c = CompressedKVCache(method, 16)
    rng = np.random.default_rng(batch * 7 + kv_heads + step)
    for n in [24, 24, 8, 24, 3] + [1] * 12 + [20, 4] + [1] * 12:  # chunks gathered (> 16), short steps masked
        out, want, gained, mass = _step(c, rng, n, kv_heads, rep, batch)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
        if scorer == "h2o":  # H2O adds the step's mass: the attention's own, put back on the row
            np.testing.assert_allclose(gained, mass, rtol=1e-4, atol=1e-6)
    assert c.heads_per_row == kv_heads and c.evictions > 0


@pytest.mark.parametrize("step", [1, 5, 16])
@pytest.mark.parametrize("batch", [1, 2])
def test_decode_columns_list_each_heads_slots_exactly_once(step, batch, columns):
    """After every decode step the column lists describe the row as it stands: head ``h``'s
    columns are exactly the slots it owns, each once, and the host bound covers the most any
    head holds."""
    from conftest import tiny_llama

    model = tiny_llama(n_layers=2, hidden=64, heads=8, kv_heads=4, seed=3)
    tokens = mx.array(np.random.default_rng(step + batch).integers(1, 97, (batch, 120)), dtype=mx.int32)
    caches = kvcompress.make_prompt_cache(model, "adakv", budget=24, recent=2, step=step)
    model(tokens[:, :40], cache=caches)
    for i in range(40, 120):
        model(tokens[:, i : i + 1], cache=caches)
        for c in caches:
            sl = c.parts.slots
            assert sl.columns is not None and sl.columns.version == sl.version  # this step's attention used them
            dest, owner = np.array(sl.columns.dest), np.array(sl.owner())
            assert sl.head_bound() >= max(int((owner == h).sum(-1).max()) for h in range(sl.g))
            for b, r, h in np.ndindex(*dest.shape[:3]):
                listed = dest[b, r, h][dest[b, r, h] != PAD]
                assert sorted(listed.tolist()) == np.flatnonzero(owner[b, r] == h).tolist()
    assert caches[0].evictions > 1


def test_decode_reads_on_the_host_only_counts_taken_at_an_earlier_step(columns):
    """The column lists' width is read on the host when they are rebuilt (after an eviction):
    from the counts an earlier step took (already evaluated with that step), so a decode step
    never waits on the one in flight. Every host read a decode step makes is of such an array."""
    from unittest import mock

    from conftest import tiny_llama

    model = tiny_llama(n_layers=2, hidden=64, heads=8, kv_heads=4, seed=4)
    tokens = mx.array(np.random.default_rng(4).integers(1, 97, (1, 110)), dtype=mx.int32)
    caches = kvcompress.make_prompt_cache(model, "adakv", budget=24, recent=2, step=16)
    mx.eval(model(tokens[:, :40], cache=caches))
    mx.eval(model(tokens[:, 40:41], cache=caches))  # the first rebuild after the prompt
    reads, item = [], mx.array.item

    def spy(a):
        reads.append(a)
        return item(a)

    rebuilds = 0
    for i in range(41, 110):
        taken = [c.parts.slots.columns.counts for c in caches]
        versions = [c.parts.slots.columns.version for c in caches]
        with mock.patch.object(mx.array, "item", spy):
            out = model(tokens[:, i : i + 1], cache=caches)
        assert all(any(a is t for t in taken if isinstance(t, mx.array)) for a in reads), i
        rebuilds += sum(c.parts.slots.columns.version != v + 1 for c, v in zip(caches, versions))
        reads.clear()
        mx.eval(out)
    assert rebuilds > 4  # evictions rebuilt the lists, each reading an earlier step's counts


@pytest.mark.parametrize("batch", [1, 2])
def test_tokens_after_an_eviction_take_the_first_empty_slots_in_turn(batch):
    """An eviction that frees several tokens' slots lists the row's empty slots once, in
    order; the token of that step and each following one take the next ``g`` of that list,
    which are exactly the first ``g`` empty slots of the row as it stood (what a search would
    pick, and what a loaded cache, which keeps no list, picks), so a saved cache continues in
    the same layout."""
    from conftest import tiny_llama

    model = tiny_llama(n_layers=1, hidden=64, heads=8, kv_heads=4, seed=6)
    tokens = mx.array(np.random.default_rng(6 + batch).integers(1, 97, (batch, 120)), dtype=mx.int32)
    (c,) = kvcompress.make_prompt_cache(model, "adakv", budget=24, recent=2, step=16)
    model(tokens[:, :40], cache=[c])
    listed = filled = 0
    for i in range(40, 120):
        sl = c.parts.slots
        model(tokens[:, i : i + 1], cache=[c])
        listed += sl.free is not None
        if sl.last is None:  # appended after the stored slots
            continue
        filled += 1
        taken, after = np.sort(np.array(sl.last), axis=-1), np.array(sl.pos)
        for b, r in np.ndindex(*taken.shape[:2]):
            empty_before = np.union1d(np.flatnonzero(after[b, r] < 0), taken[b, r])
            assert taken[b, r].tolist() == empty_before[: sl.g].tolist(), i
    assert listed > 10 and filled > 10 and c.evictions > 3


@pytest.mark.parametrize("batch", [1, 2])
def test_kernel_decode_reads_nothing_on_the_host_and_lists_nothing(kernel, batch):
    """With the CPU kernels a decode step over head-group rows builds no column lists (nothing
    derived from the layout is held) and reads nothing on the host, eviction steps included,
    and its output is the column path's on the same cache (copies, so both see one layout)."""
    import copy
    from unittest import mock

    from conftest import tiny_llama

    model = tiny_llama(n_layers=2, hidden=64, heads=8, kv_heads=4, seed=5)
    tokens = mx.array(np.random.default_rng(5 + batch).integers(1, 97, (batch, 100)), dtype=mx.int32)
    caches = kvcompress.make_prompt_cache(model, "adakv", budget=24, recent=2, step=8)
    mx.eval(model(tokens[:, :40], cache=caches))
    reads, item = [], mx.array.item

    def spy(a):
        reads.append(a)
        return item(a)

    for i in range(40, 100):
        if i % 15 == 0:  # the same step both ways, on copies of the cache
            got = model(tokens[:, i : i + 1], cache=copy.deepcopy(caches))
            with mock.patch.object(heads, "owner_softmax", lambda: None):
                want = model(tokens[:, i : i + 1], cache=copy.deepcopy(caches))
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5)
        with mock.patch.object(mx.array, "item", spy):
            out = model(tokens[:, i : i + 1], cache=caches)
        assert reads == [], i
        mx.eval(out)
        assert all(c.parts.slots.extra_nbytes() == 0 for c in caches)
    assert caches[0].evictions > 3
