"""The uniform budget: every layer keeps the same number of tokens."""

from __future__ import annotations

from typing import ClassVar

import attrs
from attrs.validators import ge, instance_of

__all__ = ["UniformBudget"]


@attrs.frozen
class UniformBudget:
    """``budget`` tokens (sinks included) in every layer: ``C_l = C``."""

    budget: int = attrs.field(default=512, validator=[instance_of(int), ge(1)])

    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset()

    def layer_budgets(self, info) -> list[int]:
        return [self.budget] * info.n_layers
