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

from typing import Any, ClassVar, Optional

import attrs
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcompress
from kvcompress import ComponentSpec, rows_field
from kvcompress.components import KINDS
from kvcompress.ops import lowest_k
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
    """Seeded from a step counter kept in the prompt group's scratch dict: state the cache never
    saves (a component's state belongs in ``init_state``)."""

    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset()

    def observe(self, scores, obs):
        scratch = obs.group.scratch if obs.group is not None else {}
        n = scratch.setdefault(("random_every_step", obs.layer.layer), [0])
        n[0] += 1  # a pseudo-random score per position, different at every step
        return mx.sin(obs.positions.astype(mx.float32) * 12.9898 + n[0] * 78.233)


@attrs.define
class StepCount:
    steps: Optional[mx.array] = rows_field()


@attrs.frozen
class InPlaceCounter:
    """Counts steps per row in its state, but bumps the counter array in place: the cache keeps
    the state it handed over to undo a step (trim), and that one changes too."""

    requires: ClassVar[frozenset] = frozenset({"queries"})
    provides: ClassVar[frozenset] = frozenset()

    def init_state(self, layer):
        return StepCount()

    def observe(self, scores, obs):
        if obs.state.steps is None:
            obs.state = StepCount(steps=mx.zeros((scores.shape[0],), mx.int32))
        else:
            obs.state.steps[...] = obs.state.steps + 1
        return scores + mass(obs)


@attrs.define
class Opaque:
    handle: Any = None


@attrs.frozen
class UnsaveableState:
    """Keeps a Python object in its state: it cannot go into ``cache.state``."""

    requires: ClassVar[frozenset] = frozenset({"queries"})
    provides: ClassVar[frozenset] = frozenset()

    def init_state(self, layer):
        return Opaque(handle=object())

    def observe(self, scores, obs):
        return scores + mass(obs)


@attrs.frozen
class LooksAtOtherRowsPadding:
    """Uses the batch's step size where it means the row's: every row scores as if all of the
    step's tokens were real (right padding counted)."""

    requires: ClassVar[frozenset] = frozenset({"queries"})
    provides: ClassVar[frozenset] = frozenset()

    def observe(self, scores, obs):
        from kvcompress.ops import attention_mass

        return scores + attention_mass(obs.queries, obs.keys, obs.scale, obs.positions, obs.query_positions)


@pytest.mark.parametrize(
    "cls, broken",
    [
        (HalfPrecisionScorer, "float32 scores"),
        (UndeclaredQueries, "declared requirements"),
        (BatchMixer, "batch rows independent"),
        (Float16Overflow, "finite scores"),
        (MutableScorer, "frozen"),
        (NotJsonScorer, "serialisable parameters"),
        (InPlaceCounter, "state not mutated"),
        (UnsaveableState, "state round trip"),
        (LooksAtOtherRowsPadding, "batch rows independent"),
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


@attrs.frozen
class UnorderedRowCounts(IgnoresProtection):
    """Evicts the right slots when rows free the same count, but hands rows that free fewer an
    arbitrary subset of its choice instead of its choice in priority order."""

    def select(self, sel):
        key = mx.where(sel.protected, mx.inf, sel.scores)
        idx = lowest_k(key, sel.positions, sel.n_evict, ordered=True)
        return idx[..., ::-1] if sel.row_counts is not None else idx  # least evictable first


@attrs.frozen
class SelectsEmptySlots(IgnoresProtection):
    """Protects its sinks by position but ignores the cache's protected mask: an empty slot
    (position -1, lowest 'score' of all) is chosen."""

    def select(self, sel):
        sinks = (sel.positions >= 0) & (sel.positions < self.n_sink)
        return lowest_k(mx.where(sinks, mx.inf, sel.positions.astype(mx.float32)), sel.positions, sel.n_evict)


@attrs.frozen
class IntBudgetOnly(IgnoresProtection):
    """Reads the budget as one int: with rows of different budgets (a [B, 1, 1] array) every
    row gets row 0's recent window."""

    def protected(self, positions, offset, budget):
        b = int(budget.reshape(-1)[0].item()) if isinstance(budget, mx.array) else budget
        return (positions < self.n_sink) | (positions >= offset - b // 4)

    def reserved(self, budget):
        return self.n_sink + budget // 4


@pytest.mark.parametrize(
    "cls, broken",
    [(IgnoresProtection, "protected never evicted"), (EvictsOneSlotTwice, "select output"),
     (TooManyReserved, "reserved"), (UnorderedRowCounts, "row counts"), (SelectsEmptySlots, "empty slots"),
     (IntBudgetOnly, "protected mask")],
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
        return ev.keys, values, ev.scores


@attrs.frozen
class MergeIntoEmpty:
    """Parks every evicted value in the row's empty slots (position -1): nothing may go there."""

    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset()

    def dispose(self, ev):
        lost = mx.take_along_axis(ev.values, ev.evict[..., None], axis=2).mean(axis=2, keepdims=True)
        return ev.keys, mx.where((ev.positions < 0)[..., None], lost, ev.values), ev.scores


@attrs.frozen
class UnseededNoise:
    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset()

    def dispose(self, ev):
        noise = mx.random.uniform(shape=ev.scores.shape)
        return ev.keys, ev.values, ev.scores + 0.01 * mx.where(ev.protected, 0.0, noise)


@attrs.frozen
class OldFourTuple:
    """The v1 protocol: a merge count as a fourth value."""

    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset()

    def dispose(self, ev):
        return ev.keys, ev.values, ev.scores, mx.array(0, mx.int32)


@attrs.frozen
class IgnoresReal:
    """Zeroes the values of every listed slot, including the entries ``ev.real`` says stay (a
    row that frees fewer slots than the others loses a survivor)."""

    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset()

    def dispose(self, ev):
        idx = ev.evict[..., None]
        zero = mx.zeros(ev.evict.shape + (ev.values.shape[-1],), ev.values.dtype)
        gone = mx.put_along_axis(ev.values, mx.broadcast_to(idx, zero.shape), zero, axis=2)
        return ev.keys, gone, ev.scores


@attrs.define
class BatchWideCount:
    evicted: Optional[mx.array] = None  # per row, but not declared with rows_field


@attrs.frozen
class UndeclaredRows:
    """Counts evictions per row in an array not declared as a rows field: a batch row's state
    then is the whole batch's."""

    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset()

    def init_state(self, layer):
        return BatchWideCount()

    def dispose(self, ev):
        n = mx.array(list(ev.counts), dtype=mx.int32)
        prev = ev.state.evicted
        ev.state = BatchWideCount(evicted=n if prev is None else prev + n)
        return ev.keys, ev.values, ev.scores


@attrs.frozen
class SkewedView:
    """Attends keys scaled by 1.01 even when nothing was evicted: not KVCache's computation."""

    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset()

    def dispose(self, ev):
        return ev.keys, ev.values, ev.scores

    def view_keys(self, state, keys, positions, offset):
        return keys * 1.01


@pytest.mark.parametrize(
    "cls, broken",
    [(MergeIntoSink, "protected slots untouched"), (MergeIntoEmpty, "empty slots"),
     (UnseededNoise, "deterministic"), (OldFourTuple, "dispose output"), (IgnoresReal, "batch rows independent"),
     (UndeclaredRows, "batch rows independent"), (SkewedView, "exact without eviction")],
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
    from kvcompress._engine import _Engine

    monkeypatch.setattr(_Engine, "_evict", lambda self, need: None)  # never frees a slot
    with pytest.raises(ContractFailure, match="contract 'budget held' broken"):
        check_method("h2o")


def test_catches_a_cache_whose_batch_rows_diverge(monkeypatch):
    """Batched generation is compared with each row's solo run, not assumed."""
    from kvcompress import BatchCompressedKVCache

    monkeypatch.setattr(BatchCompressedKVCache, "_seen", lambda self: self._rows_off)  # counts right padding
    with pytest.raises(ContractFailure, match="contract 'batched' broken: row 1"):
        check_method("streaming_llm_shift")


@attrs.frozen
class InitSate:
    """A typo of a hook name would be silently ignored; the record refuses it."""

    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset()

    def init_sate(self, layer):
        return None

    def observe(self, scores, obs):
        return scores


def test_near_miss_hook_names_are_refused_when_registering():
    with pytest.raises(ValueError, match="'init_sate' looks like 'init_state'"):
        spec("scorer", "typo", InitSate)


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
        key = mx.where(sel.protected, mx.inf, sel.positions.astype(mx.float32))  # empty slots stay
        return lowest_k(key, sel.positions, sel.n_evict)


def test_catches_a_selector_that_drops_its_sinks():
    with pytest.raises(ContractFailure, match="contract 'sinks kept' broken: layer 0: the first 4 positions"):
        check_selector(spec("selector", "forgets_sinks", ForgetsSinks))


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
