"""The caches of one prompt: a group the layers share for cross-layer decisions.

:func:`~kvcompress.make_prompt_cache` gives every compressed layer of one prompt the same
:class:`PromptGroup`. It holds references to its member caches (by layer) and a scratch dict for
decisions made across layers within one step (ChunkKV's layer-wise index reuse). A deep copy of
the cache list copies the group once, so the copies share a new group. A cache written to a file
records its group's id; layers read back in order rejoin one group (:func:`join`), so a load --
by kvcompress or by mlx-lm's own loader -- restores the sharing.
"""

from __future__ import annotations

import threading
import uuid
import weakref
from typing import Optional

import attrs

__all__ = ["PromptGroup", "join", "new_group"]


@attrs.define(eq=False)
class PromptGroup:
    """Shared by the compressed layers of one prompt (or one batch of prompts)."""

    id: str = attrs.field(factory=lambda: uuid.uuid4().hex)
    members: dict = attrs.field(factory=dict, repr=False)  # layer index -> cache
    scratch: dict = attrs.field(factory=dict, repr=False)  # per-step cross-layer data, never saved

    def add(self, layer: int, cache) -> None:
        self.members[layer] = cache

    def caches(self) -> list:
        """Member caches ordered by layer."""
        return [self.members[k] for k in sorted(self.members) if self.members[k] is not None]

    def __deepcopy__(self, memo):
        import copy

        new = PromptGroup(id=uuid.uuid4().hex)
        memo[id(self)] = new
        new.members = {k: copy.deepcopy(v, memo) for k, v in self.members.items()}
        return new

    def __getstate__(self):  # pickling (e.g. multiprocessing) keeps only the id
        return {"id": self.id}

    def __setstate__(self, state):
        self.id, self.members, self.scratch = state["id"], {}, {}


_LOCK = threading.Lock()
_OPEN: "weakref.WeakValueDictionary[str, PromptGroup]" = weakref.WeakValueDictionary()


def new_group() -> PromptGroup:
    return PromptGroup()


def join(key: str, layer: int, group_id: Optional[str] = None) -> PromptGroup:
    """The group for layer ``layer`` of the caches being rebuilt under ``key``.

    Layers are rebuilt one after the other (load, batch merge, row extraction): a layer joins the
    open group of ``key`` unless that group already has this layer, which starts a new group
    (so reading the same file twice gives two independent groups).
    """
    with _LOCK:
        group = _OPEN.get(key)
        if group is None or layer in group.members:
            group = PromptGroup(id=group_id or uuid.uuid4().hex)
            _OPEN[key] = group
        group.members.setdefault(layer, None)  # reserve the layer; the cache adds itself
        return group
