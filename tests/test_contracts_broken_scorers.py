"""Deliberately broken scorers (and a hook-name typo), each caught by the contract it breaks:
the failure must name that contract, so no check of ``kvcompress.testing`` passes vacuously."""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import attrs
import mlx.core as mx
import pytest

from _contract_helpers import spec
from kvcompress import rows_field
from kvcompress.testing import ContractFailure, check_scorer


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
