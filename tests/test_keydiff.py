"""KeyDiff scorer against a NumPy reference; the eviction it drives in a cache."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvcompress
from kvcompress import Observation
from kvcompress._contracts.synthetic import LAYER, normal, offsets, shuffled_positions
from kvcompress_keydiff import KeyDiffScorer

from conftest import tiny_llama

D, H_KV = 16, 2


def reference(keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """``-cos(k_j, mean of the normalised held keys)`` per (row, head); 0 for empty slots."""
    out = np.zeros(positions.shape)
    for b in range(keys.shape[0]):
        for h in range(keys.shape[1]):
            held = positions[b, h] >= 0
            unit = keys[b, h] / np.linalg.norm(keys[b, h], axis=-1, keepdims=True)
            anchor = unit[held].mean(axis=0)
            cos = unit @ anchor / np.linalg.norm(anchor)
            out[b, h] = np.where(held, -cos, 0.0)
    return out


def _obs(rng, batch, gqa, dtype, t_old=9, n_new=3):
    held = [t_old - 3 * (b % 2) for b in range(2)]  # row 1 holds 3 empty slots
    pos = np.concatenate([shuffled_positions(rng, t_old, held)[:batch],
                          np.broadcast_to(np.arange(n_new) + np.array(held[:batch]).reshape(-1, 1, 1),
                                          (batch, H_KV, n_new))], axis=-1).astype(np.int32)
    seen = [h + n_new for h in held[:batch]]
    t = t_old + n_new
    keys = normal(rng, (batch, H_KV, t, D), dtype) * 3.0 + 1.0  # a shared direction, as real keys have
    obs = Observation(
        queries=normal(rng, (batch, H_KV * gqa, n_new, D), dtype), keys=keys, positions=mx.array(pos),
        query_positions=offsets(held[:batch]) + mx.arange(n_new, dtype=mx.int32).reshape(1, 1, n_new),
        n_new=n_new, scale=D**-0.5, offset=offsets(seen), offsets=tuple(seen), layer=LAYER,
        n_valid=(n_new,) * batch,
    )
    return mx.zeros(pos.shape, mx.float32), obs


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("gqa", [1, 2, 4])
def test_scores_match_numpy_reference(dtype, batch, gqa):
    rng = np.random.default_rng(5 + batch + gqa)
    scores, obs = _obs(rng, batch, gqa, dtype)
    out = KeyDiffScorer().observe(scores, obs)
    assert out.dtype == mx.float32 and out.shape == scores.shape
    pos = np.array(obs.positions)
    want = reference(np.array(obs.keys.astype(mx.float32), dtype=np.float64), pos)
    got = np.array(out)
    assert np.allclose(got, want, atol=2e-5), np.abs(got - want).max()
    assert (got >= -1 - 1e-5).all() and (got <= 1 + 1e-5).all()
    # empty slots neither score nor move the anchor: garbage in them changes nothing
    junk = mx.where(obs.positions[..., None] < 0, 1e3, obs.keys)
    again = KeyDiffScorer().observe(scores, Observation(**{**_fields(obs), "keys": junk}))
    assert np.allclose(np.array(again), got, atol=1e-6)
    # query-free: other queries give the same scores
    other = KeyDiffScorer().observe(scores, Observation(**{**_fields(obs), "queries": -obs.queries}))
    assert np.array_equal(np.array(other), got)


def _fields(obs):
    import attrs

    return {f.name: getattr(obs, f.name) for f in attrs.fields(type(obs)) if f.init}


def test_cache_keeps_the_most_distinctive_keys():
    """After a prefill past the budget, each head keeps the sinks, the recent window and the
    keys farthest from its mean key direction (the reference's choice from the stored keys)."""
    model = tiny_llama(n_layers=2, hidden=64, heads=4, kv_heads=2, seed=1)
    budget, n_sink, recent = 20, 2, 4
    cache = kvcompress.make_prompt_cache(model, "keydiff", budget=budget, n_sink=n_sink, recent=recent)
    prompt = mx.array(np.random.default_rng(0).integers(0, 97, 48))
    model(prompt[None], cache=cache)
    before = [(np.array(c.keys_and_values()[0]), np.array(c.slot_positions)) for c in cache]
    model(mx.array([[5]]), cache=cache)  # the deferred eviction happens at the next update
    for c, (keys, pos) in zip(cache, before):
        s = reference(keys.astype(np.float64), pos)
        kept = np.array(c.slot_positions)
        for h in range(keys.shape[1]):
            free = (pos[0, h] >= n_sink) & (pos[0, h] < 48 - recent)
            order = np.argsort(-s[0, h][free], kind="stable")
            want = set(pos[0, h][free][order[: budget - 1 - n_sink - recent]].tolist())
            want |= set(range(n_sink)) | set(range(48 - recent, 48))
            got = set(kept[0, h].tolist()) - {48, -1}
            assert got == want, h


@pytest.mark.parametrize("g", [2, 4])
def test_head_groups_score_each_head_against_its_own_anchor(g):
    """A row holding ``g`` heads' slots (AdaKV's head groups, slots tagged by ``owner``) scores
    every slot as the reference scores it among its own head's slots alone."""
    rng = np.random.default_rng(g)
    t = 7 * g
    owner = rng.permutation(np.repeat(np.arange(g), 7)).reshape(1, 1, t).astype(np.int32)
    pos = np.zeros((1, 1, t), np.int32)
    for h in range(g):
        pos[owner == h] = rng.permutation(7)
    pos[0, 0, 3] = owner[0, 0, 3] = -1  # one empty slot
    keys = rng.standard_normal((1, 1, t, D)).astype(np.float32) * 3.0 + 1.0
    obs = Observation(
        queries=mx.zeros((1, 2, 1, D)), keys=mx.array(keys), positions=mx.array(pos),
        query_positions=mx.full((1, 1, 1), 7, mx.int32), n_new=1, scale=D**-0.5,
        offset=offsets([8]), offsets=(8,), layer=LAYER, n_valid=(1,),
        owner=mx.array(owner), heads_per_row=g,
    )
    got = np.array(KeyDiffScorer().observe(mx.zeros(pos.shape, mx.float32), obs))[0, 0]
    for h in range(g):
        mine = np.flatnonzero(owner[0, 0] == h)
        want = reference(keys[:, :, mine].astype(np.float64), pos[:, :, mine])[0, 0]
        assert np.allclose(got[mine], want, atol=2e-5)
    assert got[3] == 0.0


def _scores_match(cache, atol=3e-5):
    for c in cache:
        keys = np.array(c.keys_and_values()[0].astype(mx.float32), dtype=np.float64)
        pos = np.array(c.slot_positions)
        got, want = np.array(c.slot_scores), reference(keys, pos)
        assert np.allclose(got, want, atol=atol), np.abs(got - want).max()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kept_norms_give_the_scores_of_the_stored_keys_through_decode(dtype, tmp_path):
    """Each slot's inverse norm is kept between steps and redone only where a token was written
    (``Observation.written``): through decode, the step after a trim, a save/load and a copy
    the scores are the reference of the keys the cache holds."""
    import copy

    model = tiny_llama(n_layers=2, hidden=64, heads=4, kv_heads=2, seed=3)
    model.set_dtype(getattr(mx, dtype))
    cache = kvcompress.make_prompt_cache(model, "keydiff", budget=16, n_sink=2, recent=2)
    ids = np.random.default_rng(4).integers(0, 97, 80)
    model(mx.array(ids[None, :40]), cache=cache)
    for i in range(40, 52):
        model(mx.array([[int(ids[i])]]), cache=cache)
        _scores_match(cache)
    assert all(c.trim(1) == 1 for c in cache)  # (its scores are the step's before: not checked)
    for i in range(52, 56):
        model(mx.array([[int(ids[i])]]), cache=cache)
        _scores_match(cache)
    kvcompress.save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
    loaded = kvcompress.load_prompt_cache(str(tmp_path / "c.safetensors"), model=model)
    twin = copy.deepcopy(cache)
    for c in (loaded, twin):
        for i in range(56, 62):
            model(mx.array([[int(ids[i])]]), cache=c)
            _scores_match(c)


def test_a_decode_step_redoes_the_norm_of_the_written_slot_only(monkeypatch):
    """The cache tells the scorer which slots changed: at each decode step past the budget,
    exactly the slot the new token went into (per row and head); the prompt chunk and the first
    step (which carries out the prompt's deferred eviction and compacts) lay out new slots and
    say nothing (every norm is computed)."""
    seen = []
    observe = KeyDiffScorer.observe

    def spy(self, scores, obs):
        seen.append((obs.written, obs.positions, obs.offsets))
        return observe(self, scores, obs)

    monkeypatch.setattr(KeyDiffScorer, "observe", spy)
    model = tiny_llama(n_layers=1, hidden=64, heads=4, kv_heads=2, seed=5)
    cache = kvcompress.make_prompt_cache(model, "keydiff", budget=12, n_sink=2, recent=2)
    model(mx.arange(30).reshape(1, 30), cache=cache)
    for t in range(5):
        model(mx.array([[40 + t]]), cache=cache)
    assert seen[0][0] is None
    for written, pos, offsets in seen[2:]:
        assert written is not None and written.shape == (1, 2, 1)
        newest = np.array(mx.take_along_axis(pos, written, axis=-1))
        assert (newest == offsets[0] - 1).all()
