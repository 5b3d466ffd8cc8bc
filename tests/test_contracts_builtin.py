"""kvcompress.testing on the built-in components and methods, and the checker's own interface.

* ``test_builtin_contract`` is parametrized by the opt-in pytest plugin's hook
  (``kvcompress.testing.pytest_generate_tests``) over every component and method the registry holds
  from the ``kvcompress`` distribution; each case runs the unit contracts of its kind and a
  generation run on a tiny random Llama (budget rule, sinks, exactness, determinism, float16,
  save/load).
* Property tests of the built-in selectors' contracts for any parameters; case ids, dispatch and
  the errors for unknown names, bad compositions and bad parameters.

Broken components: ``test_contracts_broken_scorers.py`` and ``test_contracts_broken_eviction.py``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcompress
from kvcompress.components import KINDS
from kvcompress.testing import (
    ContractCase,
    ContractFailure,
    check_method,
    check_scorer,
    check_selector,
    contract_cases,
    pytest_generate_tests,  # noqa: F401 -- the opt-in pytest plugin's hook, used by this module only
)

kvcompress_contracts = {"dist": "kvcompress"}  # what `contract_case` is parametrized over

RUN_CHECKS = {"budget held", "positions", "protected kept", "float32 scores", "real queries", "deterministic",
              "save/load", "float16", "exact without eviction", "batched", "config round trip"}
UNIT_CHECKS = {
    "scorer": {"observe shape", "float32 scores", "deterministic", "batch rows independent", "empty slots"},
    "selector": {"protected mask", "select output", "protected never evicted", "empty slots", "row counts"},
    "disposition": {"dispose output", "protected slots untouched", "empty slots", "batch rows independent"},
    "budget": {"one budget per layer", "positive int budgets"},
}


def test_builtin_contract(contract_case):
    report = contract_case.check()
    prefix = "" if contract_case.kind == "method" else "run: "
    assert {prefix + c for c in RUN_CHECKS} <= set(report.passed), report
    if contract_case.kind != "method":
        assert {"record and protocol", "frozen", "config round trip"} <= set(report.passed)
        assert UNIT_CHECKS[contract_case.kind] <= set(report.passed), report
        comp = kvcompress.get_registry().component(contract_case.kind, contract_case.name).cls()
        init = getattr(comp, "init_state", None)
        if init is not None and init(kvcompress.LayerInfo()) is not None:  # a state is checked, not skipped
            assert "state round trip" in report.passed, report
    sel = kvcompress.build_method(contract_case.name).selector if contract_case.kind == "method" else None
    if sel is not None and getattr(sel, "n_sink", 0):
        assert f"sinks kept (n_sink={sel.n_sink})" in report.passed


def test_cases_cover_the_builtin_registry():
    reg = kvcompress.get_registry()
    ids = {c.id for c in contract_cases(dist="kvcompress")}
    want = {f"{k}:{n}" for k in KINDS for n, p in reg.components[k].items() if p.dist == "kvcompress"}
    want |= {f"method:{n}" for n, p in reg.methods.items() if p.dist == "kvcompress"}
    assert ids == want and len(ids) >= 4 + 2
    assert {c.kind for c in contract_cases(dist="kvcompress")} == set(KINDS) | {"method"}
    assert [c.id for c in contract_cases(kinds=["budget"], names=["uniform"])] == ["budget:uniform"]
    assert contract_cases(dist="no-such-dist") == []


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n_sink=st.integers(0, 8), recent=st.integers(0, 12), recent_ratio=st.sampled_from([0.0, 0.25, 0.5, 0.75]))
def test_lowest_selector_contract_holds_for_any_protection(n_sink, recent, recent_ratio):
    report = check_selector("lowest", run=False, n_sink=n_sink, recent=recent, recent_ratio=recent_ratio)
    assert report.details["unit_params"] == {"n_sink": n_sink, "recent": recent, "recent_ratio": recent_ratio}
    assert "protected never evicted" in report.passed


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunk=st.integers(1, 12), n_sink=st.integers(0, 6), recent=st.integers(0, 12))
def test_chunk_selector_contract_holds_for_any_chunking(chunk, n_sink, recent):
    """Whole chunks, exactly ``evict_count(n_evict)`` slots, none protected, for any sizes."""
    report = check_selector("chunk", run=False, chunk=chunk, n_sink=n_sink, recent=recent)
    assert {"select output", "protected never evicted"} <= set(report.passed)


def test_snapkv_window_state_meets_the_state_contract():
    """With decode re-scoring the SnapKV scorer keeps its query window in its state (per row)."""
    report = check_scorer("snapkv", run=False, interval=2)
    assert {"state round trip", "state not mutated", "batch rows independent"} <= set(report.passed)


def test_component_parameters_are_validated_before_checking():
    with pytest.raises(ContractFailure, match="contract 'parameters' broken: .*'n_sink' must be >= 0"):
        check_selector("lowest", run=False, n_sink=-1)


def test_unknown_names_and_bad_compositions_fail_clearly():
    with pytest.raises(ContractFailure, match="not registered: unknown scorer 'nope'"):
        check_scorer("nope")
    with pytest.raises(ContractFailure, match="contract 'composition' broken: CompositionError"):
        check_method({"scorer": "recency", "selector": "lowest", "disposition": "gated_merge",
                      "budget": "uniform"})
    with pytest.raises(ContractFailure, match="contract 'composition' broken: ConfigError: unknown parameter"):
        check_method("h2o", nonsense=1)


def test_case_ids_and_dispatch():
    case = ContractCase("budget", "uniform", "kvcompress")
    assert str(case) == case.id == "budget:uniform"
    report = case.check(run=False)
    assert "one budget per layer" in report.passed and not any(c.startswith("run: ") for c in report.passed)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(2, 40), n_sink=st.integers(0, 6), recent=st.integers(0, 8),
       k=st.integers(1, 3), ties=st.booleans())
def test_lowest_selection_matches_its_definition(seed, t, n_sink, recent, k, ties):
    """The lowest selector (its decode path compiled: protection and choice as few kernels) picks
    the ``k`` unprotected slots of smallest (score, position) -- checked against NumPy, with
    tied scores and shuffled slots."""
    from kvcompress import Selection
    from kvcompress_basic.selectors import LowestScoreSelector

    rng = np.random.default_rng(seed)
    b, h = 2, 3
    scores = rng.integers(0, 3, (b, h, t)).astype(np.float32) if ties else rng.standard_normal((b, h, t)).astype(np.float32)
    pos = np.stack([[rng.permutation(t) for _ in range(h)] for _ in range(b)]).astype(np.int32)
    offset = t
    sel_c = LowestScoreSelector(n_sink=n_sink, recent=recent)
    prot = sel_c.protected(mx.array(pos), mx.array(offset, dtype=mx.int32), 10**6)
    want_prot = (pos < n_sink) | (pos >= offset - recent) if recent else (pos < n_sink)
    assert np.array_equal(np.array(prot), want_prot)
    free = (~want_prot).sum(-1).min()
    if free < k:
        return
    got = np.array(sel_c.select(Selection(
        scores=mx.array(scores), positions=mx.array(pos), protected=prot, n_evict=k, budget=10**6,
        offset=mx.array(offset, dtype=mx.int32), offsets=(offset,) * b, layer=kvcompress.LayerInfo())))
    for bi in range(b):
        for hi in range(h):
            cand = [(scores[bi, hi, j], pos[bi, hi, j], j) for j in range(t) if not want_prot[bi, hi, j]]
            assert sorted(got[bi, hi].tolist()) == sorted(j for _, _, j in sorted(cand)[:k])
