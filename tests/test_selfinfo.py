"""selfinfo (Selective Context) and the ``predictions`` capability: scores equal the model's own
surprisal, across calls, batch rows with padding and trims; what leaves; refusals."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvcompress
from kvcompress import Predictions
from kvcompress.mlxlm.attention import base_class
from kvcompress_selfinfo import UNKNOWN, SelfInfoScorer, digit_ids, special_ids

from conftest import tiny_llama


def _ids(n, seed=0, vocab=97):
    return mx.array(np.random.default_rng(seed).integers(1, vocab, (1, n)), dtype=mx.int32)


def _surprisal(model, ids):
    """NumPy reference: ``-log p(x_t | x_<t)`` of every token of ``ids`` [1, n] from one
    uncompressed forward (index t; t = 0 has none)."""
    logits = model(ids).astype(mx.float32)
    lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0].astype(np.float64)
    tok = np.array(ids)[0]
    return np.concatenate([[np.nan], -lp[np.arange(len(tok) - 1), tok[1:]]])


def _slots(layer_cache):
    """Host ``(positions [B, H, T], scores [B, H, T])`` from the cache's public state."""
    st = layer_cache.state
    return np.array(st[-3]), np.array(st[-2])


def _check_scores(cache, ref, rows=None):
    for c in cache:
        pos, score = _slots(c)
        for b in range(pos.shape[0]) if rows is None else rows:
            for p, s in zip(pos[b].ravel(), score[b].ravel()):
                if p < 0:
                    continue
                want = UNKNOWN if p == 0 else ref[p]
                assert s == pytest.approx(want, rel=1e-4, abs=1e-4), (b, p)
        assert score.dtype == np.float32


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("chunks", [(24,), (10, 9, 5), (1, 1, 7, 15)])
def test_scores_are_the_models_surprisal_across_calls(kv_heads, chunks, dtype):
    """Every stored slot's score is -log p(token | prefix) of the uncompressed model, whether its
    prediction came from the same call or from the call before (top_k = vocab: exact), in float32
    whatever the model's dtype."""
    model = tiny_llama(kv_heads=kv_heads, n_layers=3, dtype=dtype)
    ids = _ids(sum(chunks))
    ref = _surprisal(model, ids)
    cache = kvcompress.make_prompt_cache(model, "selfinfo", budget=4096, top_k=97)
    at = 0
    for n in chunks:
        mx.eval(model(ids[:, at : at + n], cache=cache))
        at += n
    _check_scores(cache, ref)


def test_top_k_bounds_a_first_token_outside_it():
    """With top_k = 1, a call's first token that is not the previous prediction's argmax gets
    the argmax's information: a lower bound on its own."""
    model = tiny_llama()
    ids = _ids(12, seed=3)
    ref = _surprisal(model, ids)
    logits = model(ids[:, :6])[0, -1].astype(mx.float32)
    lp = np.array(logits - mx.logsumexp(logits))
    assert int(np.argmax(lp)) != int(ids[0, 6])  # the case under test
    cache = kvcompress.make_prompt_cache(model, "selfinfo", budget=4096, top_k=1)
    model(ids[:, :6], cache=cache)
    mx.eval(model(ids[:, 6:], cache=cache))
    pos, score = _slots(cache[0])
    got = score[0, 0][pos[0, 0] == 6][0]
    assert got == pytest.approx(-lp.max(), rel=1e-5) and got <= ref[6] + 1e-5


def _best_span(s, w):
    """NumPy reference of the span selector: ``S_t = max`` over the ``w``-token windows holding
    ``t`` of their summed score."""
    n = len(s)
    return np.array([max(s[j : j + w].sum() for j in range(max(0, t - w + 1), min(t, n - w) + 1)) for t in range(n)])


def test_eviction_keeps_the_most_informative_spans():
    """Over budget, the tokens whose best 16-token window holds the least information (Eq. 3)
    leave, a multiple of ``step`` at a time; sinks and the recent window stay."""
    model = tiny_llama()
    ids = _ids(160, seed=5)
    ref = _surprisal(model, ids)
    cache = kvcompress.make_prompt_cache(model, "selfinfo", budget=96, top_k=97)
    mx.eval(model(ids[:, :128], cache=cache))
    mx.eval(model(ids[:, 128:129], cache=cache))  # the deferred eviction runs
    pos, _ = _slots(cache[0])
    kept = set(int(p) for p in pos[0, 0] if p >= 0)
    assert {0, 1, 2, 3} <= kept and set(range(128 - 32, 129)) <= kept
    gone = sorted(set(range(129)) - kept)
    assert len(kept) <= 96 and len(gone) % 16 == 0
    s = np.where((np.arange(128) < 4) | (np.arange(128) >= 96), 0.0, ref[:128])  # protected add 0
    best = _best_span(s, 16)
    stay = [p for p in range(4, 96) if p in kept]
    assert gone and stay and best[gone].max() <= best[stay].min() + 1e-3


@pytest.mark.parametrize("budget", [64, 512])
def test_span_recent_window_scales_with_the_budget(budget):
    """``recent_ratio`` protects the last ``max(recent, floor(ratio * budget))`` positions, and
    ``reserved`` counts them with the ``step - 1`` rounding slack."""
    from kvcompress_selfinfo import SpanSelector

    sel = SpanSelector(n_sink=4, recent=32, recent_ratio=0.25, step=16)
    r = max(32, budget // 4)
    assert sel.reserved(budget) == 4 + r + 15
    pos = mx.arange(1000).reshape(1, 1, -1)
    prot = np.array(sel.protected(pos, mx.array(1000), budget))[0, 0]
    assert prot.sum() == 4 + r and prot[:4].all() and prot[1000 - r :].all()


@pytest.mark.parametrize("span", [1, 3, 16])
def test_span_scores_match_a_reference_in_any_slot_order(span):
    """``S_t`` for slots stored in any order equals the reference over the position-sorted
    scores (protected and empty slots add nothing)."""
    from kvcompress_selfinfo import SpanSelector

    rng = np.random.default_rng(span)
    n = 40
    scores = rng.random(n).astype(np.float32) * 5
    positions = np.arange(n)
    positions[:3] = -1  # empty slots
    prot = (positions >= 0) & (positions < 2)
    perm = rng.permutation(n)
    sel = SpanSelector(span=span, n_sink=2, recent=0, step=1)
    order, best = sel.span_scores(mx.array(scores[perm])[None, None], mx.array(positions[perm])[None, None],
                                  mx.array(prot[perm] | (positions[perm] < 0))[None, None])
    got = np.empty(n, np.float32)
    got[np.array(order)[0, 0]] = np.array(best)[0, 0]
    srt = np.argsort(positions[perm])
    want = _best_span(np.where(prot | (positions < 0), 0.0, scores)[np.argsort(positions)], span)
    real = np.sort(positions) >= 0  # empty slots tie at -1: their order is arbitrary
    assert np.allclose(got[srt][real], want[real], atol=1e-4)


def test_trim_is_exact():
    """Speculative decoding: a trimmed step leaves the scores and the state of a cache that never
    saw the removed tokens (the kept ones re-observed from the step's own predictions)."""
    model = tiny_llama()
    ids = _ids(30, seed=7)
    a = kvcompress.make_prompt_cache(model, "selfinfo", budget=4096, top_k=8)
    b = kvcompress.make_prompt_cache(model, "selfinfo", budget=4096, top_k=8)
    model(ids[:, :20], cache=a)
    model(ids[:, :20], cache=b)
    model(ids[:, 20:26], cache=a)
    assert all(c.trim(4) == 4 for c in a)
    model(ids[:, 20:22], cache=b)
    for x in (a, b):
        mx.eval(model(ids[:, 22:23], cache=x))
    for ca, cb in zip(a, b):
        for u, v in zip(ca.state[:-1], cb.state[:-1]):
            # equal up to float32 rounding: a 6-token and a 2-token step round their matmuls differently
            assert np.allclose(np.array(u), np.array(v), atol=1e-6, equal_nan=True)


def test_a_call_without_the_model_hook_is_refused_unchanged():
    model = tiny_llama()
    cache = kvcompress.make_prompt_cache(model, "selfinfo", budget=4096)
    model(_ids(5), cache=cache)
    before = [np.array(a) for a in cache[0].state[:-1]]
    with pytest.raises(kvcompress.KVCompressError, match="kvcompress.install"):
        base_class(model).__call__(model, mx.array([[6]]), cache=cache)
    assert all(np.array_equal(x, np.array(y)) for x, y in zip(before, cache[0].state[:-1]))


def test_predictions_from_logits_match_a_reference():
    rng = np.random.default_rng(0)
    logits = mx.array(rng.standard_normal((2, 5, 11)).astype(np.float32))
    tok = mx.array(rng.integers(0, 11, (2, 5)), dtype=mx.int32)
    p = Predictions.from_logits(tok, logits, (5, 3))
    lp = np.array(logits) - np.log(np.exp(np.array(logits)).sum(-1, keepdims=True))
    want = -np.take_along_axis(lp[:, :-1], np.array(tok)[:, 1:, None], -1)[..., 0]
    assert np.isnan(np.array(p.surprisal)[:, 0]).all()
    assert np.allclose(np.array(p.surprisal)[:, 1:], want, atol=1e-5)
    assert np.allclose(np.array(p.last), lp[[0, 1], [4, 2]], atol=1e-5)  # each row's last real token
    t = p.truncated(2)
    assert np.allclose(np.array(t.last), lp[:, 1], atol=1e-5) and t.surprisal.shape == (2, 2)


def test_a_scorer_requiring_predictions_needs_the_hook():
    import attrs
    from typing import ClassVar

    @attrs.frozen
    class Needy:
        requires: ClassVar[frozenset] = frozenset({"predictions"})
        provides: ClassVar[frozenset] = frozenset()

        def observe(self, scores, obs):
            return scores

    spec = kvcompress.ComponentSpec("scorer", "needy_pred", Needy, "test")

    class P:
        @kvcompress.hookimpl
        def kvcompress_scorers(self):
            return [spec]

    reg = kvcompress.Registry(plugins=[("needy_pred_plugin", P())])
    m = kvcompress.build_method({"scorer": "needy_pred", "selector": "lowest", "disposition": "drop",
                                 "budget": "uniform"}, registry=reg)
    with pytest.raises(kvcompress.ConfigError, match="observe_predictions"):
        kvcompress.CompressedKVCache(m, 64)


def test_keep_ids_stay_with_their_units():
    """``keep_ids`` (e.g. a chat template's turn markers) score UNKNOWN wherever they occur, so
    while their units fit the budget they are never evicted; every other token keeps its
    surprisal. Without them some leave."""
    model = tiny_llama()
    ids = _ids(336, seed=7)
    marks = [20, 60, 110, 200]
    ids[0, mx.array(marks)] = 5
    ref = _surprisal(model, ids)
    held = {}
    for keep in ((), (5,)):
        cache = kvcompress.make_prompt_cache(model, "selfinfo", budget=192, top_k=97, keep_ids=keep)
        for a in range(0, 336, 16):
            mx.eval(model(ids[:, a : a + 16], cache=cache))
        pos, score = _slots(cache[0])
        held[keep] = {int(p): float(x) for p, x in zip(pos[0, 0], score[0, 0]) if p >= 0}
    assert not set(marks) <= set(held[()])  # the case under test: unprotected, some leave
    assert set(marks) <= set(held[(5,)]) and all(held[(5,)][m] == UNKNOWN for m in marks)
    fives = set(np.flatnonzero(np.array(ids)[0] == 5).tolist())  # the planted ones and any drawn
    assert all(held[(5,)][p] == UNKNOWN for p in fives if p in held[(5,)])
    others = [p for p in held[(5,)] if p not in fives and 0 < p < 192]  # scored before any eviction
    np.testing.assert_allclose([held[(5,)][p] for p in others], ref[others], rtol=1e-4, atol=1e-4)


def test_floor_ids_score_at_least_the_floor_and_nothing_else_changes():
    """``floor_ids`` / ``floor`` (e.g. the digits of numbers): those tokens score
    ``max(I, floor)``, every other token its surprisal, the first token UNKNOWN."""
    model = tiny_llama()
    ids = _ids(120, seed=9)
    ref = _surprisal(model, ids)
    floor, low = float(np.nanmedian(ref)), (5, 7, 11)
    cache = kvcompress.make_prompt_cache(model, "selfinfo", budget=4096, top_k=97, floor_ids=low, floor=floor)
    for a in range(0, 120, 24):
        mx.eval(model(ids[:, a : a + 24], cache=cache))
    tok = np.array(ids)[0]
    raised = [p for p in range(1, 120) if tok[p] in low and ref[p] < floor]
    assert raised  # the case under test: some floored tokens were less surprising than the floor
    for c in cache:
        pos, score = _slots(c)
        for p, x in zip(pos[0].ravel(), score[0].ravel()):
            if p > 0:
                want = max(ref[p], floor) if tok[p] in low else ref[p]
                assert x == pytest.approx(want, rel=1e-4, abs=1e-4), p
            elif p == 0:
                assert x == UNKNOWN
    with pytest.raises((TypeError, ValueError)):
        SelfInfoScorer(floor=-1.0)


def test_selfinfo_scorer_validates():
    class Tok:
        all_special_ids = [2, 0, 1, 2]

    assert special_ids(Tok()) == (0, 1, 2) and SelfInfoScorer(keep_ids=special_ids(Tok())).keep_ids == (0, 1, 2)

    class Vocab:  # GPT-2 style (Ġ = a leading space), SentencePiece style (▁), multi-digit tokens
        def get_vocab(self):
            return {"7": 12, "\u01201990": 40, "\u258142": 3, "x1": 5, "1.5": 6, "\u0120": 7, "\u0663": 8, "12a": 9}

    assert digit_ids(Vocab()) == (3, 12, 40)
    with pytest.raises((TypeError, ValueError)):
        SelfInfoScorer(top_k=0)
    with pytest.raises(kvcompress.ConfigError, match="keep_ids"):
        kvcompress.build_method("selfinfo", keep_ids=[-1])


def test_predictions_share_one_computation_across_layers():
    """What every layer asks of one call's predictions is computed once: ``once`` runs its
    function once per key (an array in the key matches only itself), ``top(k)`` once per k."""
    rng = np.random.default_rng(1)
    p = Predictions.from_logits(mx.array(rng.integers(0, 11, (1, 3)), dtype=mx.int32),
                                mx.array(rng.standard_normal((1, 3, 11)).astype(np.float32)), (3,))
    calls = []
    a, b = mx.zeros((2,)), mx.zeros((2,))
    for _ in range(30):
        p.once(("k", a, (5,)), lambda: calls.append("a") or 1)
    p.once(("k", b, (5,)), lambda: calls.append("b") or 2)  # equal values, another array: its own
    assert calls == ["a", "b"]
    ids, lp = p.top(4)
    assert p.top(4)[0] is ids and ids.shape == (1, 4)
    assert sorted(np.array(ids)[0].tolist()) == sorted(np.argsort(-np.array(p.last)[0])[:4].tolist())


def test_predictions_from_the_head_in_blocks_equal_the_logits_ones():
    rng = np.random.default_rng(3)
    hidden = mx.array(rng.standard_normal((2, 45, 8)).astype(np.float32))
    w = mx.array(rng.standard_normal((8, 13)).astype(np.float32))
    tok = mx.array(rng.integers(0, 13, (2, 45)), dtype=mx.int32)
    a = Predictions.from_logits(tok, hidden @ w, (45, 30))
    b = Predictions.from_head(tok, hidden, lambda h: h @ w, (45, 30), block=16)
    assert np.allclose(np.array(a.surprisal), np.array(b.surprisal), atol=1e-5, equal_nan=True)
    assert np.allclose(np.array(a.last), np.array(b.last), atol=1e-5)


def test_a_long_calls_predictions_never_hold_its_logits_at_once():
    """A 512-token call over a 4096-word vocabulary: 8 MB of logits; in blocks of 128, a quarter."""
    rng = np.random.default_rng(4)
    hidden = mx.array(rng.standard_normal((1, 512, 32)).astype(np.float32))
    w = mx.array(rng.standard_normal((32, 4096)).astype(np.float32))
    tok = mx.array(rng.integers(0, 4096, (1, 512)), dtype=mx.int32)
    mx.eval(hidden, w, tok)
    peaks = []
    for make in (lambda: Predictions.from_logits(tok, hidden @ w, (512,)),
                 lambda: Predictions.from_head(tok, hidden, lambda h: h @ w, (512,))):
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        p = make()
        mx.eval(p.surprisal, p.last)
        peaks.append(mx.get_peak_memory() - base)
    logits_bytes = 512 * 4096 * 4
    assert peaks[0] >= logits_bytes and peaks[1] < logits_bytes / 2, peaks


class _Halved:
    """A model whose output is its head's logits halved (as soft-capping or a logit scale would
    change them): the hook must score from what the model returned."""


@pytest.mark.parametrize("kind", ["tied", "lm_head", "halved"])
def test_long_calls_score_from_the_head_only_when_the_model_returns_its_output(kind, monkeypatch):
    from mlx_lm.models import llama

    model = tiny_llama(n_layers=2)
    if kind == "lm_head":
        model.args.tie_word_embeddings = False
        model.lm_head = llama.nn.Linear(64, 97, bias=False)
    if kind == "halved":
        cls = type(model)
        model.__class__ = type("Halved", (_Halved, cls), {"__call__": lambda self, *a, **k: cls.__call__(self, *a, **k) * 0.5})
    ids = _ids(40, seed=5)
    ref = _surprisal(model, ids)
    used = []
    real = Predictions.from_head.__func__
    monkeypatch.setattr(Predictions, "from_head", classmethod(lambda cls, *a, **k: used.append(1) or real(cls, *a, **k)))
    cache = kvcompress.make_prompt_cache(model, "selfinfo", budget=4096, top_k=97)
    for at, n in ((0, 24), (24, 16)):  # a long call (head path) and a short one (logits)
        mx.eval(model(ids[:, at : at + n], cache=cache))
    _check_scores(cache, ref)
    assert len(used) == (0 if kind == "halved" else 1)
