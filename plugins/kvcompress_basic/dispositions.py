"""The drop disposition: evicted slots are simply forgotten."""

from __future__ import annotations

from typing import ClassVar

import attrs

__all__ = ["Drop"]


@attrs.frozen
class Drop:
    """Evicted keys and values are discarded; survivors are untouched."""

    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset({"head_groups"})

    def dispose(self, ev):
        return ev.keys, ev.values, ev.scores
