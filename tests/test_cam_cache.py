"""CaM at cache level: every mode through random-weight mlx-lm Llamas (batch, GQA), drop ==
H2O bit for bit, and the trained stories260K model (skipped when absent)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvcompress
from kvcompress import CompressedKVCache, KVCacheBuilder, KVCacheConfig, make_prompt_cache

from conftest import tiny_llama


# ------------------------------------------------------------------------------------------
# Cache level
# ------------------------------------------------------------------------------------------

MODELS = {"gqa": dict(heads=4, kv_heads=2), "mha": dict(heads=4, kv_heads=4)}


@pytest.fixture(scope="module")
def models():
    return {k: tiny_llama(n_layers=2, seed=1, **v) for k, v in MODELS.items()}


def run(model, caches, batch=1, n_prompt=40, n_decode=12, chunk=None, seed=0):
    """Prefill (in ``chunk``-token steps) then greedy decode; returns the decode logits."""
    rng = np.random.default_rng(seed)
    prompt = mx.array(rng.integers(3, 90, (batch, n_prompt)), dtype=mx.int32)
    chunk = chunk or n_prompt
    for i in range(0, n_prompt, chunk):
        logits = model(prompt[:, i : i + chunk], cache=caches)
    out = []
    for _ in range(n_decode):
        tok = mx.argmax(logits[:, -1:], axis=-1)
        logits = model(tok, cache=caches)
        mx.eval(logits)
        out.append(logits)
        for c in caches:
            assert c.size() == c.budget  # decode attends exactly the budget
    return out


def merges(c) -> float:
    """Merges per KV head (diagnostics: the mean over KV heads; a list per row for a batch)."""
    m = c.diagnostics["merges"]
    return sum(m) if isinstance(m, list) else m


def state_arrays(caches):
    """keys, values, positions, scores of every layer (the last four arrays of ``state``)."""
    return [a for c in caches for a in c.state[-5:-1]]


MODES = [
    dict(merge="sim_weighted"),
    dict(merge="mean"),
    dict(merge="drop"),
    dict(merge="sim_weighted", merge_keys=True),
    dict(merge="mean", merge_keys=True),
    dict(merge="sim_weighted", target="window", merge_window=4),
    dict(merge="sim_weighted", merge_gate=False),
]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(f"{v}" for v in m.values()))
@pytest.mark.parametrize("arch, batch", [("gqa", 2), ("mha", 1)])
def test_all_modes_prefill_then_decode(models, mode, arch, batch):
    model = models[arch]
    budget, n_sink = 16, 4
    caches = make_prompt_cache(model, "cam", budget=budget, n_sink=n_sink, **mode)
    logits = run(model, caches, batch=batch, chunk=9)
    assert all(lg.shape == (batch, 1, 97) and mx.isfinite(lg).all().item() for lg in logits)
    h_kv = MODELS[arch]["kv_heads"]
    for c in caches:
        k, v = c.keys_and_values()
        assert k.shape == v.shape == (batch, h_kv, budget, 16)
        pos = np.array(c.state[-3])
        assert (np.sort(pos, -1)[..., :n_sink] == np.arange(n_sink)).all()  # sinks retained
        assert (np.diff(np.sort(pos, -1), axis=-1) > 0).all()  # no position stored twice
        assert c.offset == 40 + 12 and c.evictions == 52 - budget
        assert c.diagnostics["compression_tokens"] == pytest.approx(52 / budget)
        disp = c.method.disposition
        assert disp.merge == mode["merge"] and disp.merge_gate == mode.get("merge_gate", True)
        counted = c.component_state("disposition").merges
        if mode["merge"] == "drop":
            assert merges(c) == 0 and counted is None  # nothing is ever merged
        else:
            assert counted.shape == (batch, h_kv)  # per row and KV head, in the cache's state
            if batch == 1:  # diagnostics: the mean over KV heads (a scalar for one sequence)
                assert c.diagnostics["merges"] == pytest.approx(float(np.array(counted).mean()))
            assert 0 <= np.array(counted).min() and np.array(counted).max() <= c.evictions
            if mode.get("merge_gate") is False:
                assert merges(c) > 0


def test_chunk_larger_than_budget_keeps_budget_minus_one_plus_chunk(models):
    model = models["gqa"]
    caches = make_prompt_cache(model, "cam", budget=16)
    rng = np.random.default_rng(0)
    model(mx.array(rng.integers(3, 90, (1, 20))), cache=caches)
    model(mx.array(rng.integers(3, 90, (1, 7))), cache=caches)
    assert all(c.size() == 16 - 1 + 7 for c in caches)


@pytest.mark.parametrize(
    "mode", [dict(merge="sim_weighted"), dict(merge="mean", merge_keys=True), dict(merge="mean", target="window")],
    ids=["sim_weighted", "mean-keys", "window"],
)
def test_runs_are_deterministic_and_seeded(models, mode):
    model = models["gqa"]
    results = []
    for global_seed in (1, 2):
        mx.random.seed(global_seed)  # no unseeded RNG: the global generator changes nothing
        caches = make_prompt_cache(model, "cam", budget=12, seed=5, **mode)
        results.append((run(model, caches, batch=2), state_arrays(caches), [merges(c) for c in caches]))
    (l1, s1, m1), (l2, s2, m2) = results
    assert m1 == m2 and sum(m1) > 0
    assert all(mx.array_equal(a, b).item() for a, b in zip(l1 + s1, l2 + s2))
    if mode.get("target") == "window":
        return  # on this random model the few window merges have p = 1: the seed cannot show
    other = make_prompt_cache(model, "cam", budget=12, seed=6, **mode)
    run(model, other, batch=2)
    assert any(not mx.array_equal(a, b).item() for a, b in zip(state_arrays(other), s1))


def test_byte_accounting(models):
    model = models["gqa"]
    caches = {m: make_prompt_cache(model, m, budget=16) for m in ("cam", "h2o")}
    run(model, caches["cam"], n_decode=3)
    run(model, caches["h2o"], n_decode=3)
    before = [c.nbytes for c in caches["cam"]]
    run(model, caches["cam"], n_prompt=1, n_decode=30)  # 30 more decode steps
    for c, nb in zip(caches["cam"], before):
        b, h, buf, d = c.keys.shape
        per_slot_kv = (c.keys.itemsize + c.values.itemsize) * d  # bytes of one K+V row
        counter = b * h * 4  # the merge counter: int32 per row and KV head
        # + int32 pos, f32 score, f32 key norm (kept between decode merges) per slot
        assert c.nbytes == b * h * (buf * per_slot_kv + c.size() * (4 + 4 + 4)) + counter
        assert buf <= c.budget + c.step
        assert c.nbytes == nb  # bounded: no growth while decoding at budget
        d = c.diagnostics
        assert d["nbytes"] == c.nbytes
        assert d["compression_tokens"] == pytest.approx(c.offset / 16) and d["compression_tokens"] > 1
        # mlx-lm's KVCache holds the tokens seen in 256-token steps
        full = -(-c.offset // 256) * 256 * h * per_slot_kv * b
        assert d["compression_bytes"] == pytest.approx(full / c.nbytes)
    # Merging costs its counter and one float32 key norm per slot beyond dropping at the same budget.
    assert before == [c.nbytes + c.keys.shape[0] * c.keys.shape[1] * (4 + 4 * c.size()) for c in caches["h2o"]]


def test_kvcachebuilder_for_model_design_note_diagnostics(models):
    model = models["gqa"]
    cfg = KVCacheConfig(method="cam", head_dim=16, cam_budget=16, cam_n_sink=4, cam_merge="sim_weighted",
                        cam_merge_gate=True, cam_merge_keys=False, seed=0)
    caches = KVCacheBuilder.for_model(model, cfg)
    assert len(caches) == len(model.layers) and all(type(c) is CompressedKVCache for c in caches)
    run(model, caches, batch=1)
    c = caches[0]
    assert (c.method.disposition.merge, c.method.disposition.merge_gate, c.tokens_kept) == ("sim_weighted", True, 16)
    d = c.diagnostics
    assert (d["method"], d["layer"], d["budget"], d["tokens_kept"], d["offset"]) == ("cam", 0, 16, 16, 52)
    assert d["compression_tokens"] == pytest.approx(52 / 16) and d["evictions"] == 52 - 16
    assert d["score_source"] == "queries" and d["merges"] >= 0


# ------------------------------------------------------------------------------------------
# drop == H2O at the cache level
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("arch, batch, chunk", [("gqa", 2, 9), ("mha", 1, None)])
def test_cam_drop_is_bit_identical_to_h2o(models, gate, arch, batch, chunk):
    model = models[arch]
    cam = make_prompt_cache(model, "cam", budget=12, merge="drop", merge_gate=gate)
    h2o = make_prompt_cache(model, "h2o", budget=12)
    l_cam = run(model, cam, batch=batch, chunk=chunk)
    l_h2o = run(model, h2o, batch=batch, chunk=chunk)
    assert all(mx.array_equal(a, b).item() for a, b in zip(l_cam, l_h2o))
    for a, b in zip(state_arrays(cam), state_arrays(h2o)):  # keys, values, positions, scores
        assert a.dtype == b.dtype and mx.array_equal(a, b).item()
    assert sum(merges(c) for c in cam) == 0 and all(c.evictions > 0 for c in cam)


def _stories_run(model, tokenizer, text, method, **params):
    from mlx_lm.generate import generate_step

    caches = make_prompt_cache(model, method, budget=32, **params)
    prompt = mx.array(tokenizer.encode(text[:900]))
    out = [(int(t), lp) for (t, lp), _ in zip(generate_step(prompt, model, prompt_cache=caches, max_tokens=8), range(8))]
    return caches, out


@pytest.mark.model
def test_real_model_drop_equals_h2o_and_sim_weighted_merges(stories_model, stories_text):
    model, tokenizer = stories_model
    h2o, out_h2o = _stories_run(model, tokenizer, stories_text, "h2o")
    drop, out_drop = _stories_run(model, tokenizer, stories_text, "cam", merge="drop")
    assert [t for t, _ in out_h2o] == [t for t, _ in out_drop]
    assert all(mx.array_equal(a, b).item() for (_, a), (_, b) in zip(out_h2o, out_drop))
    assert all(mx.array_equal(a, b).item() for a, b in zip(state_arrays(h2o), state_arrays(drop)))

    cam, _ = _stories_run(model, tokenizer, stories_text, "cam")
    h_kv = kvcompress.model_info(model).n_kv_heads
    for c in cam:
        assert c.score_source == "queries" and c.method.disposition.merge == "sim_weighted"
        assert c.method.disposition.merge_gate
        counted = np.array(c.component_state("disposition").merges)  # [1, KV heads]
        assert counted.shape == (1, h_kv) and 0 < counted.sum() <= c.evictions * h_kv
        assert c.diagnostics["merges"] == pytest.approx(counted.mean())
    # Merging changed the kept values relative to dropping, but not the kept positions' count.
    assert any(not mx.array_equal(a.state[-4], b.state[-4]).item() for a, b in zip(cam, drop))
    assert all(a.size() == b.size() == 32 for a, b in zip(cam, drop))




def test_one_step_compression_is_no_worse_than_h2o_on_stories(stories_model, stories_text):
    """Regression: a 448-token prompt compressed to 64 slots in one step, then 63 decode steps
    (the bench's ``--prefill 448 --budgets 64``), on the first 4 validation windows. With the
    pairwise blend steps summed, ``cam`` was 0.09 nats/token worse than ``h2o`` here (targets
    absorbing many losers moved past them); the convex blend is ~0.003 better."""
    from kvcompress.bench import perplexity as ppl_mod

    model, tok = stories_model
    windows = ppl_mod.prepare_windows(tok, stories_text[:20000], window=512, n=4)
    nll = {}
    for name in ("h2o", "cam"):
        cache = kvcompress.make_prompt_cache(model, name, budget=64)
        nll[name] = float(ppl_mod.window_nll(model, windows, cache, prefill=448).mean())
    assert nll["cam"] <= nll["h2o"] + 0.002, nll
