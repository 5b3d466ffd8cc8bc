"""``kvcompress tune``: the search space, the search's order and bounds, the files it writes.

A fake workload (losses from a table, a fake clock) checks the order, the bounds, memory and
the combined candidate in milliseconds; a tiny real run on stories260K checks that the winner's
TOML loads with ``make_prompt_cache`` and scores what the ranking reported; a CLI run on the
embedded retrieval model checks the three files.
"""

from __future__ import annotations

import math
import tomllib

import numpy as np
import pytest

import kvcompress
from kvcompress import ConfigError, MethodSpec, hookimpl
from kvcompress.cli import main
from kvcompress.config import load_config, structure_component
from kvcompress.registry import Registry, get_registry
from kvcompress.tune import SEARCH_SPACE, Candidate, Measurement, TextWorkload, method_space, paired_gap, run_search
from kvcompress.tune.report import to_toml, write_toml
from kvcompress.tune.search import MEMORY_SLACK
from kvcompress.tune.space import combined, one_parameter_changes

TOKEN_BYTES = 100.0


class FakeWorkload:
    """Losses from ``loss(config)`` (one per item, item i adds 0.01 * i), a fake clock that
    advances ``step`` seconds per measurement, bytes from ``nbytes(config)``."""

    kind = "perplexity"

    def __init__(self, loss, nbytes=None, step=1.0, n=4, fail=()):
        self.loss, self.nbytes, self.step, self.fail = loss, nbytes, step, set(fail)
        self.items = {"search": list(range(n)), "heldout": list(range(n)), "warmup": [0]}
        self.now, self.model, self.measured = 0.0, None, []

    def clock(self):
        return self.now

    def ratio(self, gap):
        return math.exp(gap)

    def measure(self, make_cache, split):
        config = make_cache()
        self.now += self.step
        if config is not None and config["method"] in self.fail:
            raise ConfigError(f"{config['method']} cannot be built at this budget")
        self.measured.append((None if config is None else Candidate(config["method"], {
            k: v for k, v in config["params"].items() if k != "budget"}).label, split))
        base = 1.0 if config is None else self.loss(config)
        shift = 0.05 if split == "heldout" else 0.0
        losses = np.array([base + shift + 0.01 * i for i in range(len(self.items[split]))])
        kept = 50.0 if config is None else 10.0  # the full cache holds 50 tokens, candidates 10 (the budget)
        nbytes = kept * TOKEN_BYTES if config is None or self.nbytes is None else self.nbytes(config)
        return Measurement(losses, nbytes, kept, self.step)


def _factory(config):
    return lambda: config


def _run(workload, budget=10, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("log", lambda line: None)
    return run_search(workload, budget, cache_factory=_factory, clock=workload.clock, **kw)


def _by_label(result):
    return {r["label"]: r for r in result["candidates"]}


def _method_loss(table, default=1.5):
    def loss(config):
        p = {k: v for k, v in config["params"].items() if k != "budget"}
        return table.get(config["method"], default) + sum(table.get((k, v), 0.0) for k, v in p.items())

    return loss


# ------------------------------------------------------------------------------------------
# the search space
# ------------------------------------------------------------------------------------------


def _entries():
    return [(kind, comp, param, values) for kind, comps in SEARCH_SPACE.items()
            for comp, params in comps.items() for param, values in params.items()]


@pytest.mark.parametrize("kind,comp,param,values", _entries(), ids=lambda x: str(x))
def test_search_space_entry_names_a_real_parameter_with_valid_values(kind, comp, param, values):
    reg = get_registry()
    if comp not in reg.components[kind]:
        pytest.skip(f"{kind} {comp!r} is not registered here (its plugin is not installed)")
    spec = reg.component(kind, comp)
    assert param in spec.params(), f"{kind} {comp!r} has no parameter {param!r}: {sorted(spec.params())}"
    assert len(values) >= 2 and len(set(values)) == len(values)
    for v in values:
        structure_component(spec, {param: v})  # a ConfigError names the bad value


#: components the space lists for plugins that may not be installed (AdaKV's selector)
OPTIONAL_COMPONENTS = {("selector", "adaptive")}


def test_search_space_components_are_registered():
    reg = get_registry()
    missing = {(k, c) for k, comps in SEARCH_SPACE.items() for c in comps if c not in reg.components[k]}
    assert missing <= OPTIONAL_COMPONENTS


def test_every_registered_method_is_searched():
    reg = get_registry()
    w = FakeWorkload(_method_loss({}))
    res = _run(w, candidates=10_000, max_seconds=1e9)
    defaults = {r["method"] for r in res["candidates"] if r["stage"] == "defaults"}
    available = {n for n in reg.methods if not reg.unavailable(n)}
    assert defaults == available
    for name in available:  # every method with a searchable component gets its one-parameter changes
        want = {c.label for c in one_parameter_changes(reg.method(name))}
        got = {r["label"] for r in res["candidates"] if r["method"] == name and r["stage"] == "one"}
        assert got == want
    assert {"interval", "kernel", "recent"} <= set(method_space(reg.method("snapkv")))
    assert "beta" in method_space(reg.method("pyramidkv")) and "chunk" in method_space(reg.method("chunkkv"))


class _ThirdParty:
    @hookimpl
    def kvcompress_methods(self):
        return [MethodSpec(name="my_h2o", scorer="h2o", selector="lowest", disposition="drop", budget="uniform",
                           summary="a third-party method from registered parts",
                           params={"budget": 64, "n_sink": 2})]


def test_a_third_party_method_is_searched_with_no_edit():
    reg = Registry(plugins=[("third_party", _ThirdParty())])
    spec = reg.method("my_h2o")
    # varied over n_sink (listed among its defaults), not recent_ratio (not listed)
    assert set(method_space(spec)) == {"n_sink"}
    assert {c.label for c in one_parameter_changes(spec)} == {f"my_h2o:n_sink={v}"
                                                              for v in SEARCH_SPACE["selector"]["lowest"]["n_sink"]}
    res = _run(FakeWorkload(_method_loss({"my_h2o": 0.5})), registry=reg, methods=["my_h2o", "h2o"],
               candidates=100, max_seconds=1e9)
    assert res["winner"]["method"] == "my_h2o"
    assert any(r["label"] == "my_h2o:n_sink=0" for r in res["candidates"])


# ------------------------------------------------------------------------------------------
# the order, the bounds, memory
# ------------------------------------------------------------------------------------------


def test_defaults_first_then_best_methods_changes_then_combined():
    table = {"h2o": 1.2, "snapkv": 1.1, ("interval", 1): -0.05, ("kernel", 3): -0.02, ("recent", 16): 0.3,
             ("n_sink", 8): -0.01}
    res = _run(FakeWorkload(_method_loss(table)), methods=["h2o", "snapkv"], candidates=1000, max_seconds=1e9)
    stages = [r["stage"] for r in res["candidates"]]
    assert stages[:2] == ["defaults", "defaults"]
    assert stages.index("combined") > max(i for i, s in enumerate(stages) if s == "one")
    ones = [r["method"] for r in res["candidates"] if r["stage"] == "one"]
    assert ones[:4] == ["snapkv", "h2o", "snapkv", "h2o"]  # round-robin, the better method first
    assert ones[-1] == "snapkv"  # snapkv has more changes to try
    comb = [r for r in res["candidates"] if r["stage"] == "combined"]
    assert [c["label"] for c in comb] == ["snapkv:interval=1,kernel=3,n_sink=8"]  # each change that helped
    assert res["winner"]["label"] == comb[0]["label"]
    assert comb[0]["gap"] == pytest.approx(0.1 - 0.05 - 0.02 - 0.01, abs=1e-9)


def test_combined_needs_two_helping_parameters():
    tried = [(Candidate("m", {"a": 1}, "one"), 0.5), (Candidate("m", {"a": 2}, "one"), 0.4),
             (Candidate("m", {"b": 1}, "one"), 0.9), (Candidate("x", {"c": 1}, "one"), 0.1)]
    assert combined("m", 0.8, tried) is None  # only a helped (b did not; c is another method)
    tried.append((Candidate("m", {"b": 2}, "one"), 0.7))
    assert combined("m", 0.8, tried).params == {"a": 2, "b": 2}


def test_candidates_bound_lists_what_is_left_out():
    w = FakeWorkload(_method_loss({}))
    res = _run(w, methods=["h2o", "snapkv", "cam"], candidates=5, max_seconds=1e9)
    measured = [r for r in res["candidates"] if "skipped" not in r]
    assert len(measured) == 5 and res["stopped"] == "--candidates 5 reached"
    assert res["left_out"] and all(x["why"] == "--candidates 5 reached" for x in res["left_out"])
    planned = {c.label for m in ("h2o", "snapkv", "cam") for c in one_parameter_changes(get_registry().method(m))}
    assert planned | {"h2o", "snapkv", "cam"} == {r["label"] for r in res["candidates"]} | {
        x["label"] for x in res["left_out"]}


def test_candidates_bound_keeps_slots_for_combined_candidates():
    table = {"h2o": 1.2, "snapkv": 1.1, ("interval", 1): -0.05, ("kernel", 3): -0.02}
    res = _run(FakeWorkload(_method_loss(table)), methods=["h2o", "snapkv"], candidates=13, max_seconds=1e9)
    done = [r for r in res["candidates"] if "skipped" not in r]
    # 2 defaults + 9 round-robin changes (up to snapkv:kernel=3), 2 slots kept back: snapkv's
    # combined candidate takes one, h2o forms none, so the next waiting change takes the other
    assert len(done) == 13 and [r["stage"] for r in done].count("combined") == 1
    assert done[11]["label"] == "snapkv:interval=1,kernel=3" and done[12]["stage"] == "one"
    assert res["winner"]["label"] == "snapkv:interval=1,kernel=3" and res["left_out"]


def test_max_minutes_keeps_time_for_combined_candidates():
    table = {"h2o": 1.2, "snapkv": 1.1, ("interval", 1): -0.05, ("kernel", 1): -0.02}
    w = FakeWorkload(_method_loss(table), step=10.0)
    res = _run(w, methods=["h2o", "snapkv"], candidates=1000, max_seconds=200.0, finalists=2)
    stages = [r["stage"] for r in res["candidates"] if "skipped" not in r]
    assert "combined" in stages and res["stopped"].startswith("--max-minutes") and w.now <= 200.0


def test_max_minutes_bounds_the_whole_run_held_out_included():
    w = FakeWorkload(_method_loss({}), step=10.0)
    res = _run(w, methods=["h2o", "snapkv"], candidates=1000, max_seconds=120.0, finalists=2)
    assert res["stopped"].startswith("--max-minutes") and res["left_out"]
    assert w.now <= 120.0 + 1e-9  # warm-up, full, candidates, held-out: all inside the bound
    assert len([r for r in res["candidates"] if "skipped" not in r]) >= 2


def test_time_estimates_before_and_after_the_defaults():
    lines = []
    w = FakeWorkload(_method_loss({}), step=2.0)
    res = _run(w, methods=["h2o", "snapkv"], candidates=1000, max_seconds=1e9, log=lines.append)
    est = res["estimates"]
    assert est["full_pass_seconds"] == 2.0 and est["before_seconds"] > 0 and est["after_defaults_seconds"] > 0
    assert "full-cache pass 2.0 s" in lines[1] and "defaults done" in lines[2]
    assert w.measured[:2] == [(None, "warmup"), (None, "search")]  # the estimate comes before any candidate


def test_over_budget_gets_no_grid_and_cannot_win_unless_allowed():
    table = {"h2o": 1.3, "snapkv": 1.02}
    big = MEMORY_SLACK * 10 * TOKEN_BYTES * 1.5

    def nbytes(config):
        return big if config["method"] == "snapkv" else 10 * TOKEN_BYTES

    res = _run(FakeWorkload(_method_loss(table), nbytes), methods=["h2o", "snapkv"], candidates=1000,
               max_seconds=1e9)
    by = _by_label(res)
    assert by["snapkv"]["over"] and not by["h2o"]["over"]
    assert by["snapkv"]["bytes_vs_budget"] == pytest.approx(MEMORY_SLACK * 1.5)
    assert not any(r["method"] == "snapkv" and r["stage"] != "defaults" for r in res["candidates"])
    assert res["winner"]["method"] == "h2o"
    allowed = _run(FakeWorkload(_method_loss(table), nbytes), methods=["h2o", "snapkv"], candidates=1000,
                   max_seconds=1e9, allow_over=True)
    assert allowed["winner"]["label"] == "snapkv"


def test_a_candidate_the_budget_cannot_build_is_skipped_with_its_error():
    lines = []
    res = _run(FakeWorkload(_method_loss({}), fail={"snapkv"}), methods=["h2o", "snapkv"], candidates=1000,
               max_seconds=1e9, log=lines.append)
    assert "cannot be built" in _by_label(res)["snapkv"]["skipped"]
    assert res["winner"]["method"] == "h2o"


def test_every_candidate_skipped_is_said_so_not_blamed_on_memory():
    with pytest.raises(ValueError) as exc:
        _run(FakeWorkload(_method_loss({}), fail={"h2o", "snapkv"}), methods=["h2o", "snapkv"], candidates=1000,
             max_seconds=1e9)
    msg = str(exc.value)
    assert msg.startswith("no candidate to rank: ") and "memory budget" not in msg
    assert "2 skipped because budget 10 cannot build them (first: h2o: ConfigError: h2o cannot be built" in msg
    assert "raise --budget" in msg


def test_every_candidate_left_out_by_max_minutes_says_raise_it():
    w = FakeWorkload(_method_loss({}), step=10.0)
    with pytest.raises(ValueError) as exc:
        _run(w, methods=["h2o", "snapkv"], candidates=1000, max_seconds=15.0)
    msg = str(exc.value)
    assert "memory budget" not in msg and "skipped" not in msg
    assert "2 left out (--max-minutes 0.25 reached; the full-cache pass alone took 10.0 s: raise --max-minutes)" in msg


def test_every_candidate_over_budget_still_names_the_memory_budget():
    with pytest.raises(ValueError, match=r"^no candidate to rank: 2 measured over the memory budget \(2 x 10 "
                       r"full-precision tokens: raise --budget or pass --allow-over-budget\)$"):
        _run(FakeWorkload(_method_loss({}), lambda c: 1e9), methods=["h2o", "snapkv"], candidates=1000,
             max_seconds=1e9)


def test_paired_standard_error():
    gap, se = paired_gap(np.array([2.0, 3.0, 5.0]), np.array([1.0, 1.0, 1.0]))
    assert gap == pytest.approx(7 / 3)
    assert se == pytest.approx(np.std([1.0, 2.0, 4.0], ddof=1) / math.sqrt(3))
    assert paired_gap(np.array([1.5, 2.5]), np.array([1.0, 2.0])) == (pytest.approx(0.5), pytest.approx(0.0))
    assert paired_gap(np.array([2.0]), np.array([1.0]))[1] is None


def test_toml_round_trip(tmp_path):
    config = {"method": "cam", "params": {"budget": 64, "recent_ratio": 0.25, "merge": "mean",
                                          "merge_gate": False, "n_sink": 0}}
    text = to_toml(config, "a comment\nsecond line")
    assert text.startswith("# a comment\n# second line\n") and tomllib.loads(text) == config
    path = write_toml(tmp_path / "c.toml", config)
    m = kvcompress.build_method(load_config(path))
    assert (m.selector.recent_ratio, m.disposition.merge, m.disposition.merge_gate, m.budget.budget) == (
        0.25, "mean", False, 64)


# ------------------------------------------------------------------------------------------
# real runs
# ------------------------------------------------------------------------------------------


def test_tiny_run_on_stories260k(stories_model, stories_text, tmp_path):
    model, tokenizer = stories_model
    w = TextWorkload(model, tokenizer, stories_text[:20_000], window=64, prefill=16, windows=3, heldout=3,
                     batch=3)
    res = run_search(w, 16, methods=["h2o", "tova", "streaming_llm"], candidates=3, finalists=3,
                     max_seconds=600, progress=False, log=lambda line: None)
    done = [r for r in res["candidates"] if r.get("gap") is not None]
    assert len(done) == 3 and {r["label"] for r in done} == {"h2o", "tova", "streaming_llm"}
    assert res["left_out"] and res["stopped"] == "--candidates 3 reached"
    winner = res["winner"]
    path = write_toml(tmp_path / "tune.toml", res["config"])
    assert load_config(path).method == winner["method"]
    # the winner's file scores what the ranking reported, on the same search windows
    cache_nll = w.measure(lambda: kvcompress.make_prompt_cache(model, config=path), "search")
    reported = next(r for r in done if r["label"] == winner["label"])
    assert paired_gap(cache_nll.losses, np.array(res["full"]["losses"]))[0] == pytest.approx(reported["gap"],
                                                                                            abs=1e-5)
    assert reported["gap"] < max(r["gap"] for r in done)  # beats the worst candidate tried
    assert winner["gap"] == min(f["gap"] for f in res["finalists"])


@pytest.fixture
def no_reexec(monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_NO_BLAS_REEXEC", "1")


def test_cli_on_the_embedded_model_writes_three_files(no_reexec, tmp_path, capsys):
    out = tmp_path / "res"
    rc = main(["tune", "--budget", "64", "--windows", "1", "--held-out", "1", "--candidates", "3",
               "--finalists", "2", "--methods", "h2o,streaming_llm,tova", "--out", str(out), "--no-progress",
               "--plain"])
    assert rc == 0
    text = capsys.readouterr()
    for name in ("tune.toml", "tune.json", "tune.png"):
        assert (out / name).is_file() and f"wrote {out / name}" in text.out
    assert "winner: " in text.out and "full-cache pass" in text.err
    assert main(["config", "validate", str(out / "tune.toml")]) == 0


@pytest.mark.parametrize("argv,says", [
    ([], "--budget"),
    (["--budget", "0"], "--budget must be >= 1"),
    (["--budget", "x"], "invalid int value"),
    (["--budget", "8", "--candidates", "0"], "--candidates must be >= 1"),
    (["--budget", "8", "--max-minutes", "0"], "--max-minutes must be > 0"),
    (["--budget", "8", "--data", "x.txt"], "--data needs --model"),
    (["--budget", "8", "--methods", "nope"], "--methods: unknown ['nope']"),
    (["--budget", "600"], "--budget must be below"),
    (["--budget", "8", "--model", "/nonexistent/model"], "no mlx-lm model folder"),
    (["--budget", "8", "--model", "/nonexistent/model", "--data", "/nonexistent.txt"], "--data: no file"),
    (["--budget", "8", "--model", "m", "--window", "64", "--prefill", "63"], "--prefill must be in"),
])
def test_bad_flags_are_one_line_exit_2(no_reexec, argv, says, capsys):
    try:
        rc = main(["tune", *argv])
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("kvcompress tune: error: ") and says in err, err
