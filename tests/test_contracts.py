"""kvcompress.testing: every built-in component and method meets its kind's contract, and each
contract catches the bug it is written for.

* ``test_builtin_contract`` is parametrized by the opt-in pytest plugin's hook
  (``kvcompress.testing.pytest_generate_tests``) over every component and method the registry holds
  from the ``kvcompress`` distribution; each case runs the unit contracts of its kind and a
  generation run on a tiny random Llama (budget rule, sinks, exactness, determinism, float16,
  save/load).
* The ``test_catches_*`` tests feed deliberately broken components through the same checks and
  assert the failure names the broken contract, so no check passes vacuously.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcompress
from kvcompress import ComponentSpec
from kvcompress.components import KINDS
from kvcompress.testing import (
    ContractCase,
    ContractFailure,
    check_budget,
    check_disposition,
    check_method,
    check_scorer,
    check_selector,
    contract_cases,
    pytest_generate_tests,  # noqa: F401 -- the opt-in pytest plugin's hook, used by this module only
)

kvcompress_contracts = {"dist": "kvcompress"}  # what `contract_case` is parametrized over

RUN_CHECKS = {"budget held", "positions", "protected kept", "float32 scores", "real queries", "deterministic",
              "save/load", "float16", "exact without eviction", "config round trip"}


def test_builtin_contract(contract_case):
    report = contract_case.check()
    prefix = "" if contract_case.kind == "method" else "run: "
    assert {prefix + c for c in RUN_CHECKS} <= set(report.passed), report
    if contract_case.kind != "method":
        assert {"record and protocol", "frozen", "config round trip"} <= set(report.passed)
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


def test_component_parameters_are_validated_before_checking():
    with pytest.raises(ContractFailure, match="contract 'parameters' broken: .*'n_sink' must be >= 0"):
        check_selector("lowest", run=False, n_sink=-1)


# ------------------------------------------------------------------------------------------------
# Broken components: each must be caught by the contract it breaks
# ------------------------------------------------------------------------------------------------

def spec(kind, name, cls):
    return ComponentSpec(kind, name, cls, f"deliberately broken {kind} for the contract tests")


def mass(obs):
    return obs.attention_mass()


@attrs.frozen
class HalfPrecisionScorer:
    requires: ClassVar[frozenset] = frozenset({"queries"})
    provides: ClassVar[frozenset] = frozenset()

    def observe(self, scores, obs):
        return (scores + mass(obs)).astype(mx.float16)


@attrs.frozen
class UndeclaredQueries:
    """Reads the queries but does not say so."""

    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset()

    def observe(self, scores, obs):
        return scores + mass(obs)


@attrs.frozen
class BatchMixer:
    """Normalises over the whole batch: row b's score depends on the other rows."""

    requires: ClassVar[frozenset] = frozenset({"queries"})
    provides: ClassVar[frozenset] = frozenset()

    def observe(self, scores, obs):
        m = mass(obs)
        return scores + m / m.sum()


@attrs.frozen
class Float16Overflow:
    """exp of the raw logits in the input dtype: overflows in float16."""

    requires: ClassVar[frozenset] = frozenset({"queries"})
    provides: ClassVar[frozenset] = frozenset()

    def observe(self, scores, obs):
        big = mx.exp(obs.keys.sum(-1) * 30)
        return (scores + big.astype(mx.float32) * 0 + big.astype(mx.float32)).astype(mx.float32)


@attrs.mutable
class MutableScorer:
    weight: float = 1.0
    requires: ClassVar[frozenset] = frozenset({"queries"})
    provides: ClassVar[frozenset] = frozenset()

    def observe(self, scores, obs):
        return scores + self.weight * mass(obs)


@attrs.frozen
class NotJsonScorer:
    table: frozenset = frozenset({1, 2})
    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset()

    def observe(self, scores, obs):
        return obs.positions.astype(mx.float32)


@attrs.frozen
class RandomEveryStep:
    """Seeded from a step counter kept in ``obs.shared``: state the cache never saves."""

    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset()

    def observe(self, scores, obs):
        n = obs.shared.setdefault(("random_every_step", obs.layer), [0])
        n[0] += 1
        row = mx.random.uniform(shape=scores.shape[1:], key=mx.random.key(n[0]))
        return mx.broadcast_to(row, scores.shape)


@pytest.mark.parametrize(
    "cls, broken",
    [
        (HalfPrecisionScorer, "float32 scores"),
        (UndeclaredQueries, "declared requirements"),
        (BatchMixer, "batch rows independent"),
        (Float16Overflow, "finite scores"),
        (MutableScorer, "frozen"),
        (NotJsonScorer, "serialisable parameters"),
    ],
)
def test_catches_broken_scorer(cls, broken):
    with pytest.raises(ContractFailure, match=f"contract '{broken}' broken"):
        check_scorer(spec("scorer", "broken", cls))


def test_catches_state_outside_the_cache():
    """Unit contracts pass, but a reloaded cache continues differently: caught by save/load."""
    s = spec("scorer", "hidden_state", RandomEveryStep)
    report = check_scorer(s, run=False)
    assert "deterministic" in report.passed
    with pytest.raises(ContractFailure, match="contract 'save/load' broken: decode step"):
        check_scorer(s)


@attrs.frozen
class IgnoresProtection:
    n_sink: int = 4
    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset()

    def reserved(self, budget):
        return self.n_sink

    def protected(self, positions, offset, budget):
        return positions < self.n_sink

    def select(self, sel):
        return mx.argpartition(sel.scores, kth=sel.n_evict - 1, axis=-1)[..., : sel.n_evict]


@attrs.frozen
class EvictsOneSlotTwice(IgnoresProtection):
    def select(self, sel):
        one = mx.argmin(mx.where(sel.protected, mx.inf, sel.scores), axis=-1, keepdims=True)
        return mx.repeat(one, sel.n_evict, axis=-1)


@attrs.frozen
class TooManyReserved(IgnoresProtection):
    def reserved(self, budget):
        return budget


@pytest.mark.parametrize(
    "cls, broken",
    [(IgnoresProtection, "protected never evicted"), (EvictsOneSlotTwice, "select output"),
     (TooManyReserved, "reserved")],
)
def test_catches_broken_selector(cls, broken):
    with pytest.raises(ContractFailure, match=f"contract '{broken}' broken"):
        check_selector(spec("selector", "broken", cls))


@attrs.frozen
class MergeIntoSink:
    """Folds every evicted value into slot 0 -- which may be a protected sink."""

    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset()

    def dispose(self, ev):
        lost = mx.take_along_axis(ev.values, ev.evict[..., None], axis=2).mean(axis=2, keepdims=True)
        values = mx.concatenate([ev.values[:, :, :1] + lost, ev.values[:, :, 1:]], axis=2)
        return ev.keys, values, ev.scores, mx.array(0, mx.int32)


@attrs.frozen
class UnseededNoise:
    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset()

    def dispose(self, ev):
        noise = mx.random.uniform(shape=ev.scores.shape)
        return ev.keys, ev.values, ev.scores + 0.01 * mx.where(ev.protected, 0.0, noise), None


@attrs.frozen
class CountsTooMany:
    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset()

    def dispose(self, ev):
        return ev.keys, ev.values, ev.scores, mx.array(ev.evict.size + 1, mx.int32)


@attrs.frozen
class SkewedView:
    """Attends keys scaled by 1.01 even when nothing was evicted: not KVCache's computation."""

    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset()

    def dispose(self, ev):
        return ev.keys, ev.values, ev.scores, None

    def view_keys(self, state, keys, positions, offset):
        return keys * 1.01


@pytest.mark.parametrize(
    "cls, broken",
    [(MergeIntoSink, "protected slots untouched"), (UnseededNoise, "deterministic"),
     (CountsTooMany, "merge count"), (SkewedView, "exact without eviction")],
)
def test_catches_broken_disposition(cls, broken):
    with pytest.raises(ContractFailure, match=f"contract '{broken}' broken"):
        check_disposition(spec("disposition", "broken", cls))


@attrs.frozen
class OffByOneBudget:
    budget: int = 64
    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset()

    def layer_budgets(self, info):
        return [self.budget] * (info.n_layers - 1)


@attrs.frozen
class FloatBudget(OffByOneBudget):
    def layer_budgets(self, info):
        return [self.budget / 2] * info.n_layers


@pytest.mark.parametrize("cls, broken", [(OffByOneBudget, "one budget per layer"),
                                         (FloatBudget, "positive int budgets")])
def test_catches_broken_budget(cls, broken):
    with pytest.raises(ContractFailure, match=f"contract '{broken}' broken"):
        check_budget(spec("budget", "broken", cls))


def test_catches_a_cache_that_outgrows_its_budget(monkeypatch):
    """The per-step budget rule is checked on the real cache, not assumed."""
    monkeypatch.setattr(kvcompress.CompressedKVCache, "_n_evict", lambda self, S: 0)
    with pytest.raises(ContractFailure, match="contract 'budget held' broken"):
        check_method("h2o")


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


@attrs.frozen
class ForgetsSinks(IgnoresProtection):
    """Says it keeps n_sink sinks but protects nothing, and evicts the oldest tokens first."""

    def reserved(self, budget):
        return 0

    def protected(self, positions, offset, budget):
        return positions < 0

    def select(self, sel):
        return mx.argpartition(sel.positions, kth=sel.n_evict - 1, axis=-1)[..., : sel.n_evict]


def test_catches_a_selector_that_drops_its_sinks():
    with pytest.raises(ContractFailure, match="contract 'sinks kept' broken: layer 0: the first 4 positions"):
        check_selector(spec("selector", "forgets_sinks", ForgetsSinks))
