"""The long-context workload's runs: bench longctx, bench longppl, tune --workload longctx.

On a tiny random Llama with a byte-level tokenizer (seconds): batched replies equal solo ones,
a budget that holds the whole conversation answers exactly as the full cache, a conversation
feeds every reply before the next question, the sweeps record every cache, protocol and ratio
(a failing method is recorded, not fatal), chunked long-text NLL equals a plain forward pass
when nothing leaves, and tune searches on the workload. On SmolLM2-135M-Instruct (skipped with
the reason when absent): the full cache finds a short needle and a roomy compressed cache
answers exactly as it.
"""

from __future__ import annotations

import argparse
import json
import math

import mlx.core as mx
import numpy as np
import pytest

from _longctx_helpers import TEXT, ByteTokenizer, text_source
from conftest import data_dir, models_dir, tiny_llama
from kvcompress.bench import longctx as lc
from kvcompress.bench import longctx_ppl as lp
from kvcompress.bench._longctx_run import ask_each, ask_in_turns, eos_ids, generate_rows, prefill
from kvcompress.bench.longctx_tasks import build_episode
from kvcompress.bench.longctx_text import ChatFormat, TextSource


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return text_source(tmp_path_factory)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(n_layers=2, hidden=64, heads=4, kv_heads=2, vocab=258, seed=3)


# ------------------------------------------------------------------------------------------
# Runs on a tiny random model
# ------------------------------------------------------------------------------------------


def _episodes(source, n=2, length=600, tasks=("niah_single", "qa")):
    tok = ByteTokenizer(chatml=True)
    fmt = ChatFormat.for_tokenizer(tok)
    return tok, fmt, [build_episode(tok, fmt, source, length, tasks, (5, e)) for e in range(n)]


@pytest.mark.parametrize("method", ["h2o", "snapkv", "kvzip"])
def test_batched_replies_equal_solo_replies(tiny, source, method):
    import copy

    import kvcompress

    tok, fmt, eps = _episodes(source, 1)
    cache = kvcompress.make_prompt_cache(tiny, method, budget=150)
    prefill(tiny, cache, eps[0].prefix_ids, 128)
    rows = [(copy.deepcopy(cache), fmt.encode(tok, fmt.first_question(q.text, q.answer_prefix)), 6)
            for q in eps[0].questions]
    batched = [ids for ids, _ in generate_rows(tiny, rows, stop=eos_ids(tok), batch=8)]
    solo = [generate_rows(tiny, [(copy.deepcopy(cache), r[1], 6)], stop=eos_ids(tok), batch=1)[0][0] for r in rows]
    assert batched == solo and all(len(x) == 6 for x in batched)


@pytest.mark.parametrize("method", ["h2o", "streaming_llm", "cam"])
def test_a_budget_above_the_conversation_answers_as_the_full_cache(tiny, source, method):
    """Nothing evicted: every protocol's replies equal mlx-lm's KVCache's, token for token."""
    import kvcompress
    from mlx_lm.models.cache import make_prompt_cache

    tok, fmt, eps = _episodes(source, 2)
    s = {**lc.DEFAULTS, "chunk": 128, "batch": 4}
    stop = eos_ids(tok)
    full = lc.measure(tiny, tok, fmt, eps, lambda: make_prompt_cache(tiny), s, stop, None)
    roomy = lc.measure(tiny, tok, fmt, eps, lambda: kvcompress.make_prompt_cache(tiny, method, budget=4096),
                        s, stop, None)
    assert roomy["answers"] == full["answers"]
    assert set(full["answers"]) == {"blind", "turns"}


def test_question_aware_reads_context_and_question_once_per_question(tiny, source):
    """--question-aware: one whole-prompt prefill per question (the progress counts them), the
    conversation starting from the first question's own cache; a roomy compressed cache still
    answers as the full cache."""
    import kvcompress
    from mlx_lm.models.cache import make_prompt_cache

    tok, fmt, eps = _episodes(source, 2)
    s = {**lc.DEFAULTS, "question_aware": True, "batch": 4}
    seen = []
    full = lc.measure(tiny, tok, fmt, eps, lambda: make_prompt_cache(tiny), s, eos_ids(tok), seen.append)
    assert sum(seen) == sum(ep.n_tokens * len(ep.questions) + 2 * lc.ask_units(ep) for ep in eps)
    roomy = lc.measure(tiny, tok, fmt, eps, lambda: kvcompress.make_prompt_cache(tiny, "snapkv", budget=4096), s,
                       eos_ids(tok))
    assert roomy["answers"] == full["answers"] and len(full["answers"]["turns"][0]) == len(eps[0].questions)
    # the conversation's first reply is the aware request's reply to the question asked first
    first = [full["answers"]["blind"][e][o[0]] for e, o in enumerate(full["orders"])]
    assert first == [full["answers"]["turns"][e][o[0]] for e, o in enumerate(full["orders"])]


def test_turns_feed_each_reply_before_the_next_question(tiny, source):
    """A conversation's cache holds the context, every question and every reply token: its
    offset is their sum (nothing lost between turns)."""
    from mlx_lm.models.cache import make_prompt_cache

    tok, fmt, eps = _episodes(source, 1)
    ep, stop = eps[0], eos_ids(tok)
    cache = make_prompt_cache(tiny)
    prefill(tiny, cache, ep.prefix_ids, 128)
    order = list(range(len(ep.questions)))
    out = ask_in_turns(tiny, tok, fmt, [ep], [cache], [order], batch=2, stop=[])
    n_q = len(fmt.encode(tok, fmt.first_question(ep.questions[0].text, ep.questions[0].answer_prefix)))
    n_q += sum(len(fmt.encode(tok, fmt.later_question(q.text, q.answer_prefix))) for q in ep.questions[1:])
    n_reply = sum(q.max_tokens for q in ep.questions)  # no stop token: every reply runs to its cap
    assert out["caches"][0][0].offset == ep.n_tokens + n_q + n_reply
    blind = ask_each(tiny, tok, fmt, ep, cache, batch=4, stop=stop)  # the context cache is untouched by copies
    assert len(blind["answers"]) == len(ep.questions)


def test_sweep_records_every_cache_protocol_and_ratio(tiny, source, tmp_path):
    pytest.importorskip("matplotlib")
    from kvcompress.bench._longctx_report import plot_longctx, results_table
    from kvcompress.bench._report import write_json

    tok = ByteTokenizer(chatml=True)
    s = {"lengths": (600,), "ratios": (2, 4), "episodes": 1, "chunk": 128, "methods": ("h2o", "snapkv"),
         "min_full": 0.0, "text_dir": str(tmp_path / "t")}
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "doc.txt").write_text(TEXT)
    p = lc.run_longctx(s, model=tiny, tokenizer=tok, progress=False)
    labels = {(r["label"], r["ratio"], r["protocol"]) for r in p["results"]}
    assert labels == {("full", 1, "blind"), ("full", 1, "turns")} | {
        (m, x, pr) for m in ("rotating", "h2o", "snapkv") for x in (2, 4) for pr in ("blind", "turns")}
    for r in p["results"]:
        assert "error" not in r, r
        assert 0.0 <= r["accuracy"] <= 1.0 and r["full_accuracy"] == p["results"][0 if r["protocol"] == "blind" else 1][
            "accuracy"]
        assert r["bytes_ratio"] > 0 and set(r["by_task"]) == {"niah_single", "qa"}
        if r["label"] != "full":
            assert r["bytes_ratio"] > 1.2 * (r["ratio"] / 2)  # compresses, measured
    assert all(len(r["accuracy_by_turn"]) == 6 for r in p["results"] if r["protocol"] == "turns")
    cols, rows = results_table(p)
    assert len(rows) == 2 * 4 and cols[3:5] == ["2x", "4x"]
    json.loads(json.dumps(write_json(tmp_path / "o.json", p).read_text()))
    assert plot_longctx(p, tmp_path / "o.png").stat().st_size > 0


def test_a_failing_method_is_recorded_and_the_sweep_goes_on(tiny, source, monkeypatch):
    real = lc.make_cache

    def broken(model, name, budget, **kw):
        if name == "h2o":
            raise RuntimeError("boom")
        return real(model, name, budget, **kw)

    monkeypatch.setattr(lc, "make_cache", broken)
    s = {"lengths": (600,), "ratios": (4,), "episodes": 1, "chunk": 128, "methods": ("h2o", "tova")}
    with pytest.warns(RuntimeWarning, match="boom"):
        p = lc.run_longctx({**s, "text_dir": source.where}, model=tiny, tokenizer=ByteTokenizer(True), progress=False)
    errs = [r for r in p["results"] if "error" in r]
    assert {r["label"] for r in errs} == {"h2o"} and any(r["label"] == "tova" for r in p["results"])


@pytest.mark.parametrize("key, value, says", [
    ("lengths", (32,), "lengths must be"), ("ratios", (0,), "ratios must be"), ("tasks", ("nope",), "tasks must be"),
    ("protocols", ("x",), "protocols must be"), ("min_full", 2.0, "min_full"), ("episodes", 0, "episodes"),
])
def test_bad_settings_are_refused_before_anything_runs(key, value, says):
    with pytest.raises(ValueError, match=says):
        lc.check_settings({**lc.DEFAULTS, key: value})


# ------------------------------------------------------------------------------------------
# Long-text perplexity
# ------------------------------------------------------------------------------------------


def test_chunked_nll_is_the_plain_forward_nll_when_nothing_leaves(tiny, source):
    from mlx_lm.models.cache import make_prompt_cache

    tok = ByteTokenizer()
    w, names = lp.long_windows(tok, source, 300, 2)
    assert w.shape == (2, 300) and len(names) == 2
    got = lp.chunked_nll(tiny, w, make_prompt_cache(tiny), 40, 64)
    x = mx.array(w)
    logits = tiny(x).astype(mx.float32)[:, :-1]  # position t predicts x_{t+1}
    ref = mx.logsumexp(logits, axis=-1) - mx.take_along_axis(logits, x[:, 1:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(got, np.array(ref)[:, 300 - 1 - 40:], rtol=1e-4, atol=1e-4)


def test_longppl_sweep_on_the_tiny_model(tiny, source):
    p = lp.run_longppl({"window": 400, "windows": 2, "decode": 16, "chunk": 128, "ratios": (2, 4),
                        "methods": ("h2o",), "text_dir": source.where}, model=tiny, tokenizer=ByteTokenizer(),
                       progress=False)
    by = {(r["label"], r["ratio"]): r for r in p["results"]}
    assert set(by) == {("full", 1), ("rotating", 2), ("rotating", 4), ("h2o", 2), ("h2o", 4)}
    assert by[("full", 1)]["ppl_ratio"] == 1.0 and p["settings"]["scored_tokens"] == 32
    assert all(math.isfinite(r["ppl"]) and r["bytes_ratio"] >= 1.0 for r in p["results"])
    cols, rows = lp.results_table(p)
    assert len(rows) == 3


# ------------------------------------------------------------------------------------------
# The real model (SmolLM2-135M-Instruct) and long text
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    path = models_dir() / "smollm2-135m-instruct"
    if not (path / "config.json").is_file():
        pytest.skip(f"SmolLM2-135M-Instruct not found at {path}; set KVCOMPRESS_MODELS_DIR to run this test")
    if not (data_dir() / "longtext").is_dir():
        pytest.skip(f"long text not found at {data_dir() / 'longtext'}; set KVCOMPRESS_DATA_DIR to run this test")
    return lc.load_chat_model(str(path))


@pytest.mark.model
@pytest.mark.slow
def test_real_model_full_cache_finds_a_short_needle_and_a_roomy_budget_matches_it(smollm2):
    """Full cache: the single needle at 768 tokens, 2 episodes, both found (a task the workload
    keeps); a kvcompress cache whose budget holds the whole conversation answers exactly as it."""
    import kvcompress
    from mlx_lm.models.cache import make_prompt_cache

    model, tok = smollm2
    fmt = ChatFormat.for_tokenizer(tok)
    src = TextSource.from_dir(data_dir() / "longtext")
    eps = [build_episode(tok, fmt, src, 768, ("niah_single",), (0, 768, e)) for e in range(2)]
    s = {**lc.DEFAULTS, "protocols": ("blind",)}
    full = lc.measure(model, tok, fmt, eps, lambda: make_prompt_cache(model), s, eos_ids(tok), None)
    exact, _ = lc.scores(eps, full["answers"]["blind"])
    assert exact.mean() == 1.0, full["answers"]
    roomy = lc.measure(model, tok, fmt, eps, lambda: kvcompress.make_prompt_cache(model, "snapkv", budget=2048),
                        s, eos_ids(tok), None)
    assert roomy["answers"] == full["answers"]


def test_variants_run_next_to_the_defaults_and_bad_ones_are_refused(tiny, source):
    from kvcompress import get_registry
    from kvcompress.bench._variants import cache_entries, variant

    assert variant("snapkv:kernel=11,recent=8,pooling=avg") == ("snapkv", {"kernel": 11, "recent": 8, "pooling": "avg"})
    # the method tables print Python's words: they read back as what they say
    assert variant("cam:merge_gate=False,merge_keys=true,seed=None") == (
        "cam", {"merge_gate": False, "merge_keys": True, "seed": None})
    # a JSON list's (or a quoted string's) commas do not split the parameters
    assert variant("selfinfo:keep_ids=[0, 1,2],top_k=8") == ("selfinfo", {"keep_ids": [0, 1, 2], "top_k": 8})
    assert variant('snapkv:pooling="a,b"') == ("snapkv", {"pooling": "a,b"})
    for bad in ("snapkv", "snapkv:", ":kernel=3", "snapkv:kernel", "selfinfo:keep_ids=[1,2"):
        with pytest.raises(argparse.ArgumentTypeError, match="METHOD:NAME=VALUE"):
            variant(bad)
    reg = get_registry()
    got = cache_entries(("h2o",), reg, [("snapkv", {"kernel": 11})])  # a variant of a method not listed runs too
    assert [e[3] for e in got] == ["rotating", "h2o", "snapkv:kernel=11"]
    with pytest.raises(ValueError, match="--variant nope: unknown method"):
        cache_entries(None, reg, [("nope", {"x": 1})])
    with pytest.raises(ValueError, match="--variant snapkv:no_such=1"):
        cache_entries(None, reg, [("snapkv", {"no_such": 1})])
    # budget= swaps the budget component; the sweep still sets the size (an int there is refused)
    with pytest.raises(ValueError, match="budget= names a budget component .*pyramid"):
        cache_entries(None, reg, [("h2o", {"budget": 64})])
    from kvcompress.bench._caches import make_cache

    pyramid = [c.budget for c in make_cache(tiny, "h2o", 96, params={"budget": "pyramid", "beta": 2.0})]
    assert len(set(pyramid)) > 1 and pyramid == sorted(pyramid, reverse=True)
    assert abs(sum(pyramid) - 96 * len(pyramid)) <= len(pyramid)
    p = lc.run_longctx({"lengths": (600,), "episodes": 1, "chunk": 128, "methods": ("h2o",), "protocols": ("blind",),
                        "extra": [("h2o", {"n_sink": 8})], "text_dir": source.where}, model=tiny,
                       tokenizer=ByteTokenizer(True), progress=False)
    assert [r["label"] for r in p["results"]] == ["full", "rotating", "h2o", "h2o:n_sink=8"]
    assert p["results"][-1]["params"] == {"n_sink": 8}


def test_gate_averages_only_tasks_the_full_cache_passes(source):
    """Records from made-up replies: the full cache answers every needle and no fact, so only the
    needles are averaged (facts reported per task); turns are scored in the order asked."""
    from kvcompress.bench._longctx_report import measured_record

    _, _, eps = _episodes(source, 2)
    right = [[" " + " ".join(q.refs) + "." for q in ep.questions] for ep in eps]
    full_replies = [[a if q.task == "niah_single" else " no idea" for a, q in zip(r, ep.questions)]
                    for r, ep in zip(right, eps)]
    orders = [list(range(len(ep.questions)))[::-1] for ep in eps]
    full = {"answers": {"blind": full_replies, "turns": full_replies}, "kv_bytes": 400.0, "kept": 10.0,
            "seconds": {"read": 1.0}, "orders": orders}
    gate = {"niah_single": True, "qa": False}
    rec = measured_record({"label": "full"}, eps, full, None, gate, "blind")
    assert rec["accuracy"] == 1.0 and rec["n_questions"] == 2 and rec["accuracy_se"] == 0.0
    assert rec["by_task"]["qa"] == {"accuracy": 0.0, "partial": pytest.approx(rec["by_task"]["qa"]["partial"]),
                                    "n": 10, "gated_in": False}
    half = [[a if e == 0 else " 0" for a in r] for e, r in enumerate(right)]  # episode 0 right, episode 1 wrong
    meas = {**full, "answers": {"blind": half, "turns": half}, "kv_bytes": 100.0}
    rec = measured_record({"label": "x"}, eps, meas, rec, gate, "turns")
    assert rec["accuracy"] == 0.5 and rec["relative"] == 0.5 and rec["bytes_ratio"] == 4.0
    assert rec["accuracy_se"] == pytest.approx(math.sqrt(0.5) / math.sqrt(2))  # std(ddof=1) of [1, 0] / sqrt(2)
    # the needle is asked last (reversed order): only the last turn is gated in
    assert rec["accuracy_by_turn"][:-1] == [None] * 5 and rec["accuracy_by_turn"][-1] == 0.5
    assert rec["later_accuracy"] == 0.5
    # paired over episodes: one right (1 of 1), one wrong (0 of 1) -> draws give 0, 1/2 or 1
    assert rec["relative_ci"] == [0.0, 1.0] and rec["later_relative"] == 0.5
    assert rec["later_relative_ci"] == [0.0, 1.0]


def test_relative_interval_is_a_seeded_paired_episode_bootstrap():
    from kvcompress.bench._longctx_report import relative_interval

    assert relative_interval([3, 3, 3], [4, 4, 4]) == pytest.approx([0.75, 0.75])  # same ratio in every episode
    assert relative_interval([1], [2]) is None and relative_interval([0, 0], [0, 0]) is None
    c, f = np.array([5, 4, 6, 2, 5, 6, 3, 4]), np.array([6, 5, 6, 5, 6, 6, 4, 5])
    lo, hi = relative_interval(c, f)
    assert lo < c.sum() / f.sum() < hi <= 1.0 and relative_interval(c, f) == [lo, hi]
    # pairing: a full cache that fails where the method fails narrows the interval
    lo2, hi2 = relative_interval(c, np.minimum(f, c + 1))
    assert hi2 - lo2 < hi - lo
    more = relative_interval(np.concatenate([c] * 4), np.concatenate([f] * 4))  # 4x the episodes: narrower
    assert more[1] - more[0] < hi - lo


@pytest.mark.parametrize("mod", ["longctx", "longppl"])
def test_results_record_the_commit_the_run_started_at(tiny, source, monkeypatch, mod):
    """A long run outlives edits to the checkout: the JSON names the commit (and load) at the
    start, not whatever the checkout holds when the run ends."""
    calls = []

    def fake_machine():
        calls.append(1)
        return {"git_commit": f"commit-{len(calls)}", "load_average": [float(len(calls))]}

    m = lc if mod == "longctx" else lp
    monkeypatch.setattr(m, "machine_info", fake_machine)
    if mod == "longctx":
        p = lc.run_longctx({"lengths": (600,), "episodes": 1, "chunk": 128, "methods": ("h2o",),
                            "protocols": ("blind",), "text_dir": source.where}, model=tiny,
                           tokenizer=ByteTokenizer(True), progress=False)
    else:
        p = lp.run_longppl({"window": 300, "windows": 1, "decode": 8, "chunk": 128, "methods": ("h2o",),
                            "text_dir": source.where}, model=tiny, tokenizer=ByteTokenizer(), progress=False)
    assert p["machine"]["git_commit"] == "commit-1" and p["machine"]["load_average_end"] == [float(len(calls))]
