"""Planned evictions (``kvcompress/engine/plan.py``): a disposition with ``plan``/``apply`` has a
decode step's eviction chosen and read at the end of the step before, and only written at the
step. The result must be exactly that of disposing at the step -- through chunks, decode steps,
a trimmed step, a multi-token step, a deep copy and a save/load, in batches -- and the step must
no longer copy the stored keys and values (the reason for the split)."""

from __future__ import annotations

import copy

import attrs
import mlx.core as mx
import numpy as np
import pytest

import kvcompress
from conftest import tiny_llama
from kvcompress import ComponentSpec, CompressedKVCache, build_method
from kvcompress.engine.plan import PlannedEviction

METHODS = sorted(kvcompress.get_registry().methods)
PLANNING = [m for m in METHODS if "plan" in build_method(m, budget=16).hooks()["disposition"]]
#: small windows so that a 16-token budget evicts (the methods' defaults are 32)
PARAMS = {"snapkv_merge": dict(recent=4)}
CAM_MODES = [
    dict(),
    dict(merge="mean"),
    dict(merge_keys=True),
    dict(transfer_mass=False),
    dict(merge_gate=False),
]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(n_layers=2, heads=4, kv_heads=2, seed=5)


def _drive(model, caches, batch: int, tmp_path, seed: int) -> list:
    """Logits of: a chunked prefill, decode steps, a step taken back, a 3-token step, more
    decode, then decode on a deep copy and on a reloaded save."""
    rng = np.random.default_rng(seed)

    def toks(n):
        return mx.array(rng.integers(3, 90, (batch, n)), dtype=mx.int32)

    out = []

    def step(cs, x):
        logits = model(x, cache=cs)
        mx.eval(logits)
        out.append(np.array(logits))
        return mx.argmax(logits[:, -1:], axis=-1).astype(mx.int32)

    prompt = toks(40)
    for i in range(0, 40, 8):
        tok = step(caches, prompt[:, i : i + 8])
    for _ in range(8):
        tok = step(caches, tok)
    step(caches, tok)
    for c in caches:
        c.trim(1)
    tok = step(caches, mx.concatenate([tok, toks(2)], axis=1))[:, -1:]
    for _ in range(5):
        tok = step(caches, tok)
    twin = copy.deepcopy(caches)
    t2 = tok
    for _ in range(4):
        t2 = step(twin, t2)
    path = str(tmp_path / f"c{seed}.safetensors")
    kvcompress.save_prompt_cache(path, caches)
    loaded = kvcompress.load_prompt_cache(path)
    for _ in range(4):
        tok = step(loaded, tok)
    out += [np.array(a) for c in loaded for a in c.state[-5:-1]]
    return out


def _compare(model, make, batch, tmp_path, monkeypatch) -> int:
    used = []
    real_take = PlannedEviction.take

    def take(self, key, need):
        p = real_take(self, key, need)
        used.append(p is not None)
        return p

    monkeypatch.setattr(PlannedEviction, "take", take)
    got = _drive(model, make(), batch, tmp_path, seed=1)
    n_used = sum(used)
    monkeypatch.setattr(PlannedEviction, "store", lambda self, *a: None)  # dispose at every step
    want = _drive(model, make(), batch, tmp_path, seed=1)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert np.array_equal(a, b)
    return n_used


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("method", PLANNING)
def test_planned_eviction_equals_disposing_at_the_step(model, method, batch, tmp_path, monkeypatch):
    assert "cam" in PLANNING
    params = PARAMS.get(method, {})
    n_used = _compare(model, lambda: kvcompress.make_prompt_cache(model, method, budget=16, **params), batch,
                      tmp_path, monkeypatch)
    assert n_used >= 2 * 15  # both layers' decode steps used their plan (not the trimmed one's)


@pytest.mark.parametrize("mode", CAM_MODES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()) or "default")
def test_planned_cam_merge_in_every_mode(model, mode, tmp_path, monkeypatch):
    _compare(model, lambda: kvcompress.make_prompt_cache(model, "cam", budget=16, **mode), 2, tmp_path, monkeypatch)


def test_a_stale_plan_is_never_applied(model):
    """After a trim the planned eviction no longer describes the cache: it is dropped."""
    caches = kvcompress.make_prompt_cache(model, "cam", budget=16)
    x = mx.array(np.random.default_rng(2).integers(3, 90, (1, 30)), dtype=mx.int32)
    mx.eval(model(x, cache=caches))
    mx.eval(model(x[:, :1], cache=caches))
    assert all(c.parts.plan.planned is not None for c in caches)
    for c in caches:
        c.trim(1)
        assert c.parts.plan.planned is None


def test_a_plan_for_another_state_is_not_taken():
    """The plan part hands a plan over only for the key (arrays by identity, host facts by
    value) and the need it was made for."""
    plan = PlannedEviction()
    a, b = mx.zeros((2,)), mx.zeros((2,))
    key = ((a, b), (3, (1, 2)))
    for other, need in [(((a, mx.zeros((2,))), (3, (1, 2))), [1]), (((a, b), (4, (1, 2))), [1]), (key, [2])]:
        plan.store(key, [1], "ev", ("p",))
        assert plan.take(other, need) is None
        assert plan.planned is None  # dropped either way
    plan.store(key, [1], "ev", ("p",))
    assert plan.take(((a, b), (3, (1, 2))), [1]) == ("ev", ("p",))


def test_a_decode_step_copies_neither_keys_nor_values():
    """The point of planning: a CaM decode step writes into the stored arrays without copying
    them (a copy of each would add ``keys.nbytes + values.nbytes`` to the step's peak memory;
    what a step allocates besides is its logits and their softmax, ~10x smaller here)."""
    from kvcompress.mlxlm.attention import ensure_wrapped
    from mlx_lm.models import base

    ensure_wrapped()
    b, h, hq, t, d = 1, 4, 16, 512, 64
    c = CompressedKVCache(build_method("cam", budget=t), t, layer=0)
    rng = [mx.random.normal((b, h, 2 * t, d), key=mx.random.key(i)) for i in (1, 2)]
    q = mx.random.normal((b, hq, 2 * t, d), key=mx.random.key(3))
    for i in range(0, 2 * t, t):
        kk, vv = c.update_and_fetch(rng[0][..., i : i + t, :], rng[1][..., i : i + t, :])
        mx.eval(base.scaled_dot_product_attention(q[..., i : i + t, :], kk, vv, cache=c, scale=0.125, mask="causal"))
    peaks = []
    for i in range(6):
        k1, v1, q1 = (mx.random.normal((b, n, 1, d), key=mx.random.key(10 + 3 * i + j)) for j, n in enumerate((h, h, hq)))
        mx.eval(k1, v1, q1)
        mx.synchronize()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        kk, vv = c.update_and_fetch(k1, v1)
        mx.eval(base.scaled_dot_product_attention(q1, kk, vv, cache=c, scale=0.125, mask=None))
        mx.synchronize()
        peaks.append(mx.get_peak_memory() - before)
        del kk, vv
    assert c.evictions > 0 and c.parts.plan.planned is not None
    assert max(peaks[2:]) < c.keys.nbytes, (peaks, c.keys.nbytes)


def test_plan_without_apply_is_refused():
    from kvcompress_basic.dispositions import Drop

    @attrs.frozen
    class HalfPlanned(Drop):
        def plan(self, ev):
            return None

    with pytest.raises(ValueError, match="'plan' but not 'apply'"):
        ComponentSpec("disposition", "half_planned", HalfPlanned, "test: plans without applying")
