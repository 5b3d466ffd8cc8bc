"""H2O heavy-hitter score: cumulative attention mass (Zhang et al., NeurIPS 2023)."""

from __future__ import annotations

from typing import ClassVar

import attrs

__all__ = ["H2OScorer"]


@attrs.frozen
class H2OScorer:
    """``s_j <- s_j + sum_i softmax_j(q_i . k_j / sqrt(d))`` over every query that attends slot ``j``.

    Accumulated in float32 per KV head from the real post-RoPE queries (mean over the query
    heads of a GQA group), as H2O's ``_update_hh_score`` does per head. It reads the step's full
    mass (``step_mass``), which the cache computes together with a compressing chunk's attention.
    """

    requires: ClassVar[frozenset] = frozenset({"queries", "step_mass"})
    provides: ClassVar[frozenset] = frozenset({"attention_mass", "head_groups"})

    def observe(self, scores, obs):
        return scores + obs.attention_mass()
