"""The model-based workloads: retrieval on the embedded model, streaming perplexity on stories260K.

Tiny sizes (seconds). What is proven: the synthetic episodes are well formed and seeded; the
shipped model loads (with mlx-lm's own loader too) and retrieves with a full cache; the sweeps
cover every registered method and budget, report a failing method instead of dying, and write
JSON/PNG; the perplexity harness scores exactly what a plain forward pass scores when nothing
is evicted.
"""

from __future__ import annotations

import argparse
import json
import math

import attrs
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompress import ComponentSpec, MethodSpec, Registry, hookimpl
from kvcompress.bench import perplexity as ppl_mod
from kvcompress.bench import retrieval as ret
from kvcompress.bench.retrieval_data import (
    BOS,
    VOCAB,
    WordTokenizer,
    mqar_sample,
    passkey_sample,
)

#: Full-cache exact-match accuracy of the shipped model, 32 episodes per task at context 512,
#: measured 1.000 on both tasks (docs/results/retrieval.json); 16 episodes here, with slack.
FULL_ACCURACY_FLOOR = 0.85
TOK = WordTokenizer()


# ------------------------------------------------------------------------------------------
# Synthetic episodes
# ------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), length=st.integers(96, 700), n_pairs=st.integers(1, 8))
def test_mqar_episode_is_well_formed(seed, length, n_pairs):
    s = mqar_sample(np.random.default_rng(seed), length, n_pairs=n_pairs, n_queries=4)
    ctx = TOK.decode(s.context).split()
    assert len(s.context) == length and s.context[0] == BOS
    assert len(s.rounds) == min(4, n_pairs)
    asked = set()
    for q, a in s.rounds:
        key = TOK.decode(q).split()[-1]
        asked.add(key)
        # the fact "key d d ." is in the haystack exactly once, with the answer's digits
        hits = [i for i, t in enumerate(ctx) if t == key]
        assert len(hits) == 1
        assert ctx[hits[0] + 1 : hits[0] + 4] == [*TOK.decode(a).split(), "."]
    assert len(asked) == len(s.rounds)  # distinct questions
    assert all(0.0 <= d <= 1.0 for d in s.depths)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), length=st.integers(64, 700))
def test_passkey_episode_is_well_formed_and_seeded(seed, length):
    s = passkey_sample(np.random.default_rng(seed), length)
    assert s == passkey_sample(np.random.default_rng(seed), length)  # seeded
    text = TOK.decode(s.context)
    digits = TOK.decode(s.rounds[0][1])
    assert len(s.context) == length
    assert text.count("pass key is") == 1 and f"pass key is {digits} ." in text
    mask = s.answer_mask()
    assert sum(mask) == 5 and all(mask[-5:]) and len(mask) == len(s.tokens())


def test_tokenizer_round_trip_and_unknown_symbol():
    text = "the sky is blue . k 4 2 . ? k"
    ids = TOK.encode(text)
    assert ids[0] == BOS and TOK.decode(ids[1:]) == text
    assert TOK.vocab_size == len(VOCAB) < 100 and len(set(VOCAB)) == len(VOCAB)
    with pytest.raises(ValueError, match="not in the retrieval vocabulary"):
        TOK.encode("the sky is purple")


# ------------------------------------------------------------------------------------------
# The shipped model
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def retrieval_model():
    return ret.load_retrieval_model()


def test_shipped_model_is_small_and_loads_with_mlx_lm():
    import mlx_lm

    files = list(ret.ASSET_DIR.iterdir())
    assert sum(f.stat().st_size for f in files if f.is_file()) < 3_000_000
    model, tok = mlx_lm.load(str(ret.ASSET_DIR))  # the HF WordLevel tokenizer.json works too
    text = "the sky is blue . k 4 2 ."
    assert list(tok.encode(text)) == TOK.encode(text)
    assert model.args.vocab_size == len(VOCAB)


def test_shipped_model_retrieves_with_full_cache(retrieval_model):
    model, _ = retrieval_model
    settings = dict(tasks=("passkey", "mqar"), samples=16, ratios=(8,), prefill_chunks=(0,),
                    methods=("h2o",))
    payload = ret.run_retrieval(settings, model=model, progress=False)
    full = {r["task"]: r["accuracy"] for r in payload["results"] if r["method"] == "full"}
    assert full["passkey"] >= FULL_ACCURACY_FLOOR and full["mqar"] >= FULL_ACCURACY_FLOOR, full
    # a recency-only cache at 8x cannot see facts that are 400 tokens back
    rot = {r["task"]: r["accuracy"] for r in payload["results"] if r["method"] == "rotating"}
    assert max(rot.values()) < 0.5, rot


# ------------------------------------------------------------------------------------------
# The retrieval sweep
# ------------------------------------------------------------------------------------------


@attrs.frozen
class _BoomScorer:
    """A scorer that fails as soon as it is used."""

    requires = frozenset()
    provides = frozenset()

    def observe(self, scores, obs):
        raise RuntimeError("boom")


class _BoomPlugin:
    @hookimpl
    def kvcompress_scorers(self):
        return [ComponentSpec("scorer", "boom", _BoomScorer, "always raises")]

    @hookimpl
    def kvcompress_methods(self):
        return [MethodSpec(name="boom", scorer="boom", selector="lowest", disposition="drop",
                           budget="uniform", summary="test: fails at runtime", params={"n_sink": 2})]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, retrieval_model):
    out = tmp_path_factory.mktemp("results")
    reg = Registry(plugins=[("boom_plugin", _BoomPlugin())])
    settings = dict(tasks=("passkey", "mqar"), context=256, samples=4, ratios=(2, 8),
                    prefill_chunks=(0, 32), n_pairs=4, n_queries=2)
    with pytest.warns(RuntimeWarning, match="boom"):
        payload = ret.run_retrieval(settings, model=retrieval_model[0], registry=reg, progress=False)
    return reg, settings, payload, out


def test_retrieval_sweep_covers_every_method_and_budget(sweep):
    reg, s, payload, _ = sweep
    got = {(r["task"], r["prefill_chunk"], r["method"], r["ratio"]) for r in payload["results"]}
    for task in s["tasks"]:
        for chunk in s["prefill_chunks"]:
            assert (task, chunk, "full", 1) in got
            for name in [*reg.methods, "rotating"]:
                for ratio in s["ratios"]:
                    assert (task, chunk, name, ratio) in got, (task, chunk, name, ratio)
    assert set(payload["settings"]["methods"]) == set(reg.methods)


def test_retrieval_values_are_sane_and_errors_reported(sweep):
    _, s, payload, _ = sweep
    for r in payload["results"]:
        if r["method"] == "boom":
            assert "RuntimeError: boom" in r["error"] and "accuracy" not in r
            continue
        if "error" in r:
            # a method may refuse a budget below what it protects (sinks + window), with a
            # message saying so; at 2x (budget 128) every registered method must run
            assert r["error"].startswith("ConfigError") and "budget" in r["error"], r
            assert r["ratio"] != 2, r
            continue
        assert 0.0 <= r["accuracy"] <= 1.0
        n_rounds = 1 if r["task"] == "passkey" else s["n_queries"]
        assert len(r["accuracy_by_round"]) == n_rounds
        assert r["n_questions"] == s["samples"] * n_rounds
        if r["method"] == "full":
            assert r["bytes_ratio"] == pytest.approx(1.0)
            continue
        # the cache really was held at its budget, and stores less than the full cache
        assert r["kept"] <= r["budget"], r
        assert r["bytes_ratio"] > 1.0, r
        if r["kind"] == "method":
            assert r["score_source"] == "queries", r


def test_retrieval_run_writes_json_png_and_table(sweep, tmp_path, retrieval_model, capsys, monkeypatch):
    parser = argparse.ArgumentParser()
    ret.add_arguments(parser)
    args = parser.parse_args(["--tasks", "passkey", "--context", "128", "--samples", "2",
                              "--ratios", "4", "--prefill-chunks", "0", "--methods", "h2o",
                              "--out", str(tmp_path)])
    assert args.ratios == (4,) and args.methods == ("h2o",)
    payload = ret.run(args)
    data = json.loads((tmp_path / "retrieval.json").read_text())
    assert (tmp_path / "retrieval.png").stat().st_size > 1000
    assert {"machine", "settings", "results"} <= set(data)
    labels = {"full", "rotating", "h2o"}
    assert {r["label"] for r in data["results"]} == labels
    assert len(data["results"]) == len(payload["results"]) == len(labels)
    assert "Retrieval exact-match accuracy" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------
# Streaming perplexity
# ------------------------------------------------------------------------------------------


class _Chars:
    """A byte-level stand-in tokenizer for the window recipe."""

    bos_token_id = 1

    def encode(self, text):
        return [1, *(b + 3 for b in text.encode())]


def test_prepare_windows_follows_the_recipe():
    text = "  ab c\n\n\n\nde  \n\nf"
    w = ppl_mod.prepare_windows(_Chars(), text * 5, window=6)
    flat = [t - 3 for t in w[:, 1:].reshape(-1)]
    joined = "\n".join(p.strip() for p in (text * 5).split("\n\n") if p.strip()).encode()
    assert (w[:, 0] == 1).all() and w.shape[1] == 6
    assert bytes(flat) == joined[: len(flat)] and len(joined) - len(flat) < 5  # only full windows


def test_perplexity_missing_defaults_give_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCOMPRESS_MODELS_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--model"):
        ppl_mod.run_perplexity({"text": str(tmp_path / "x.txt")}, progress=False)


@pytest.mark.model
def test_full_cache_nll_equals_one_forward_pass(stories_model, stories_text):
    model, tok = stories_model
    w = ppl_mod.prepare_windows(tok, stories_text, window=96, n=2)
    from mlx_lm.models.cache import make_prompt_cache

    got = ppl_mod.window_nll(model, w, make_prompt_cache(model), prefill=32)
    logits = model(mx.array(w))[:, :-1].astype(mx.float32)  # position t predicts x_{t+1}
    ref = np.array(mx.logsumexp(logits, -1)
                   - mx.take_along_axis(logits, mx.array(w[:, 1:])[..., None], -1)[..., 0])
    assert got.shape == (2, 96 - 1 - 32)
    np.testing.assert_allclose(got, ref[:, 32:], atol=2e-4)


@pytest.mark.model
def test_perplexity_sweep_covers_methods_and_gaps_are_sane(stories_model, stories_text, tmp_path):
    model, tok = stories_model
    text = tmp_path / "t.txt"
    text.write_text(stories_text[:20000])
    s = dict(text=str(text), windows=2, window=96, prefill=32, budgets=(16, 96), batch=2,
             methods=("h2o", "cam"), extra=(("h2o", {"recent_ratio": 0.0}),))
    payload = ppl_mod.run_perplexity(s, model=model, tokenizer=tok, progress=False)
    by = {(r["label"], r["budget"]): r for r in payload["results"]}
    assert by[("full", None)]["gap"] == 0.0 and by[("full", None)]["nll_gap"] == 0.0
    assert {m for m, _ in by} == {"full", "rotating", "h2o", "cam", "h2o:recent_ratio=0.0"}
    for m in ("h2o", "cam", "rotating", "h2o:recent_ratio=0.0"):
        for b in (16, 96):
            r = by[(m, b)]
            assert "error" not in r and math.isfinite(r["ppl"]) and r["ppl"] > 1.0
            assert r["kept"] <= b
            if b == 16:  # 95 tokens per window kept in 16 slots: the cache is really smaller
                assert r["bytes_ratio"] > 3.0, r
        # budget 96 >= window: nothing is evicted, so the cache is the full cache
        assert abs(by[(m, 96)]["nll_gap"]) < 1e-4, by[(m, 96)]
        # the standard error of the paired per-window gaps (2 windows)
        w = np.array(by[(m, 16)]["nll_by_window"]) - np.array(by[("full", None)]["nll_by_window"])
        assert by[(m, 16)]["nll_gap_se"] == pytest.approx(abs(w[0] - w[1]) / 2, rel=1e-5)
    # at 6x compression every method loses something on real text
    assert all(by[(m, 16)]["nll_gap"] > 0 for m in ("h2o", "cam", "rotating"))
    # the variant really ran with its own parameters: no recent window changes the numbers
    assert by[("h2o:recent_ratio=0.0", 16)]["nll"] != by[("h2o", 16)]["nll"]
    assert payload["settings"]["scored_tokens"] == 2 * (96 - 1 - 32)
