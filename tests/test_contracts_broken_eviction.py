"""Deliberately broken selectors, dispositions and budgets, and caches patched to break the run
checks (budget rule, batched rows): each must be caught by the contract it breaks, so no check
of ``kvcompress.testing`` passes vacuously."""

from __future__ import annotations

from typing import ClassVar, Optional

import attrs
import mlx.core as mx
import pytest

from _contract_helpers import spec
import kvcompress
from kvcompress import CompositionError
from kvcompress import Registry
from kvcompress.ops import lowest_k
from kvcompress.testing import ContractFailure, check_budget, check_disposition, check_method, check_selector


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
    from kvcompress.engine import Rows

    monkeypatch.setattr(Rows, "need", lambda self, valid, g: [0] * len(valid))  # never frees a slot
    with pytest.raises(ContractFailure, match="contract 'budget held' broken"):
        check_method("h2o")


def test_catches_a_cache_whose_batch_rows_diverge(monkeypatch):
    """Batched generation is compared with each row's solo run, not assumed."""
    from kvcompress.engine import Rows

    monkeypatch.setattr(Rows, "seen", lambda self: self.offset)  # counts a batch's right padding
    with pytest.raises(ContractFailure, match="contract 'batched' broken: row 1"):
        check_method("streaming_llm_shift")


@attrs.frozen
class OldEvictCount(IgnoresProtection):
    """Rounds evictions up to 4 slots with the hook's old one-argument form."""

    def evict_count(self, n_evict):
        return 4 * -(-n_evict // 4)


def test_refuses_an_evict_count_without_the_budget():
    """``evict_count(n_evict, budget)``: a selector still defining ``evict_count(n_evict)`` is
    refused with the signature to write -- by its contract check, and when a method is built
    from it -- not by a TypeError at its first eviction."""
    with pytest.raises(ContractFailure, match=r"evict_count must take \(n_evict, budget\)"):
        check_selector(spec("selector", "old_count", OldEvictCount))

    class Plugin:
        @kvcompress.hookimpl
        def kvcompress_selectors(self):
            return [spec("selector", "old_count", OldEvictCount)]

    reg = Registry(plugins=[("old_count", Plugin())])
    with pytest.raises(CompositionError, match=r"'old_count' \(OldEvictCount\): evict_count must take"):
        kvcompress.build_method(scorer="h2o", selector="old_count", disposition="drop", budget="uniform", registry=reg)
    assert kvcompress.build_method(scorer="h2o", selector="lowest", disposition="drop", budget="uniform", registry=reg)
