"""The recency score: a slot's score is its token position (StreamingLLM, Xiao et al., ICLR 2024)."""

from __future__ import annotations

from typing import ClassVar

import attrs
import mlx.core as mx

__all__ = ["RecencyScorer"]


@attrs.frozen
class RecencyScorer:
    """``s_j = p_j``, the token position of slot ``j`` (float32, exact below 2**24).

    With the ``lowest`` selector (sinks protected) the slot that leaves is always the oldest
    non-sink token, so a cache of budget ``C`` holds exactly the ``n_sink`` first tokens and
    the ``C - n_sink`` most recent ones: StreamingLLM's ``StartRecentKVCache`` rule. The score
    needs no queries; it is refreshed from the slot positions after every step.
    """

    requires: ClassVar[frozenset] = frozenset({"positions"})
    provides: ClassVar[frozenset] = frozenset({"recency", "head_groups"})

    def observe(self, scores, obs):
        return obs.positions.astype(mx.float32)
