"""PyramidKV's per-layer budget (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression
based on Pyramidal Information Funneling").

With ``C`` the uniform per-layer budget, ``w`` the observation window and ``L`` layers, the
prefix part (budget minus window) falls linearly with depth between::

    p_min = (C - w) / beta,        p_max = 2 (C - w) - p_min
    p_l   = p_max - l (p_max - p_min) / (L - 1),        l = 0 .. L-1
    C_l   = w + round(p_l)

so the mean of ``p_l`` is exactly ``C - w`` and the total equals the uniform budget ``L C``.
Rounding keeps the total exact: every ``p_l`` is floored, then the leftover tokens go one each to
the lowest layers (the schedule stays non-increasing; each ``C_l`` is within one token of the
real value). ``p_min`` is raised (and ``p_max`` lowered to keep the total) so every layer can
still evict past the selector's protected tokens: ``n_sink`` sinks and a recent window of
``max(w, floor(recent_ratio * C_l))`` tokens (the ``lowest`` selector's rule).
"""

from __future__ import annotations

import math
from typing import ClassVar

import attrs
from attrs.validators import ge, instance_of, lt

from kvcompress import ConfigError

__all__ = ["PyramidBudget", "pyramid_budgets", "smallest_budget"]


def smallest_budget(window: int, n_sink: int = 0, recent_ratio: float = 0.0) -> int:
    """The smallest layer budget ``b`` with ``n_sink + max(window, floor(recent_ratio * b)) < b``."""
    b = window + n_sink + 1
    while n_sink + max(window, int(recent_ratio * b)) >= b:
        b += 1
    return b


def pyramid_budgets(
    n_layers: int, budget: int, window: int, beta: float, n_sink: int = 0, recent_ratio: float = 0.0
) -> list[int]:
    """Per-layer budgets ``C_l`` (see the module docstring); ``sum(C_l) == n_layers * budget``."""
    prefix = budget - window
    floor_min = smallest_budget(window, n_sink, recent_ratio) - window
    if prefix < floor_min:
        raise ConfigError(
            f"pyramid budget {budget} leaves {prefix} prefix tokens after the window w={window}; "
            f"with n_sink={n_sink} and recent_ratio={recent_ratio} every layer needs at least "
            f"{floor_min} (use budget >= {window + floor_min})"
        )
    if n_layers == 1:
        return [budget]
    lo = prefix / beta
    if lo < floor_min:
        lo = float(floor_min)
    hi = 2 * prefix - lo
    real = [hi - layer * (hi - lo) / (n_layers - 1) for layer in range(n_layers)]
    base = [math.floor(p + 1e-9) for p in real]
    extra = n_layers * prefix - sum(base)
    kept = [b + (1 if layer < extra else 0) for layer, b in enumerate(base)]
    return [window + k for k in kept]


@attrs.frozen
class PyramidBudget:
    """Linearly decreasing per-layer budgets with the uniform total (PyramidKV).

    ``budget`` is the *average* per-layer budget C (window included), ``recent`` the window w
    (the same parameter name as the SnapKV scorer's window and the ``lowest`` selector's
    protected window), ``beta`` the pyramid's steepness (reference default 20), ``n_sink`` the
    selector's sinks and ``recent_ratio`` its proportional recent window (both only used to
    keep the smallest budget evictable).
    """

    budget: int = attrs.field(default=1024, validator=[instance_of(int), ge(1)])
    recent: int = attrs.field(default=0, validator=[instance_of(int), ge(0)])
    beta: float = attrs.field(default=20.0, converter=float, validator=ge(1.0))
    n_sink: int = attrs.field(default=4, validator=[instance_of(int), ge(0)])
    recent_ratio: float = attrs.field(default=0.0, converter=float, validator=[ge(0.0), lt(1.0)])

    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset({"layer_budgets"})

    def layer_budgets(self, info) -> list[int]:
        return pyramid_budgets(info.n_layers, self.budget, self.recent, self.beta, self.n_sink, self.recent_ratio)
