"""The server's prompt cache, made exact for compressed entries.

mlx-lm's ``LRUPromptCache`` serves a new prompt from the cached entry nearest to it: an exact
match, a shorter entry the prompt extends (only the rest is prefilled), or a longer entry trimmed
back to the common prefix. A full cache can be trimmed to any of its prefixes, so mlx-lm keeps
one entry per sequence (a new entry drops the shorter ones it extends) and ``--prompt-cache-size``
counts sequences.

A compressed cache can drop only the tokens of its last step exactly (older ones already shaped
its evictions), so :class:`CompressedPromptCache` asks each layer ``can_trim(n)`` for the actual
``n`` and otherwise falls back to the nearest shorter entry. To serve what one full entry serves,
a compressed sequence keeps the entries the server saves on its way -- the prompt before its
answer (the same prompt again then prefills one token), the system prompt, the user turn -- as
well as the final one (a continuing conversation resumes it). The size limit keeps mlx-lm's
meaning: at most ``max_size`` *sequences* (entries no other entry extends) and, besides them, at
most ``max_size`` shorter entries that they extend; the least recently used (saved or reused)
go first. ``max_bytes`` bounds every entry's bytes together.

Entries leave through :meth:`CompressedPromptCache._pop` only, and a miss is decided in
:meth:`CompressedPromptCache.fetch_nearest_cache` only: the two places a second tier (a prompt
cache on disk) would hook into.
"""

from __future__ import annotations

import collections
import copy
from typing import Any, List, Optional

from mlx_lm.models.cache import LRUPromptCache, PromptTrie, trim_prompt_cache

__all__ = ["CompressedPromptCache", "can_trim"]

_TYPES = ("assistant", "user", "system")


def can_trim(cache: list, n: int) -> bool:
    """Whether every layer can drop its last ``n`` tokens exactly."""
    for c in cache:
        check = getattr(type(c), "can_trim", None)
        if check is not None:
            if not c.can_trim(n):
                return False
        elif not c.is_trimmable():
            return False
    return True


def _serves_prefixes(cache: list) -> bool:
    """Whether a cache can be trimmed back to any of its prefixes (plain mlx-lm caches)."""
    return all(getattr(type(c), "can_trim", None) is None and c.is_trimmable() for c in cache)


class CompressedPromptCache:
    """mlx-lm's prompt-cache interface (``fetch_nearest_cache``, ``insert_cache``, ``trim_to``,
    ``len``, ``nbytes``, ``stats_by_type``) over mlx-lm's ``PromptTrie``, exact for compressed
    entries (see the module docstring)."""

    CacheEntry = LRUPromptCache.CacheEntry

    def __init__(self, max_size: int = 10, max_bytes: int = 1 << 63):
        self.max_size, self.max_bytes = max_size, max_bytes
        self._trie = PromptTrie()
        #: (model, tokens) -> (entry, its trie node), least recently used first
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self._n_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._n_bytes

    def stats_by_type(self) -> dict:
        out = {t: {"n_sequences": 0, "n_bytes": 0} for t in _TYPES}
        for entry, _ in self._entries.values():
            s = out.setdefault(entry.cache_type, {"n_sequences": 0, "n_bytes": 0})
            s["n_sequences"] += 1
            s["n_bytes"] += entry.nbytes
        return out

    def sequences(self) -> int:
        """Entries no other entry extends (what ``max_size`` counts)."""
        return sum(1 for _, node in self._entries.values() if self._is_leaf(node))

    @staticmethod
    def _is_leaf(node: dict) -> bool:
        return all(k == "__value__" for k in node)

    def _touch(self, model: Any, tokens) -> None:
        key = (model, tuple(tokens))
        if key in self._entries:
            self._entries.move_to_end(key)

    def fetch_nearest_cache(self, model: Any, tokens: List[int]):
        """``(a copy of the nearest usable cache or None, the tokens still to process)``."""
        result = self._trie.search(model, tokens)
        short_length = len(result.shorter) if result.shorter is not None else 0
        longer, common = result.longer, result.common_prefix
        if result.exact is not None:  # at least one token must be processed: trim it back
            longer, common = result.exact, len(tokens)
        if longer is not None and common > short_length:
            entry = self._trie.get(result.model, longer)
            prefix = min(len(tokens) - 1, common)
            n = len(longer) - prefix
            if can_trim(entry.prompt_cache, n):
                cache = copy.deepcopy(entry.prompt_cache)
                if n:
                    trim_prompt_cache(cache, n)
                self._touch(model, longer)
                return cache, tokens[prefix:]
        if short_length > 0:
            entry = self._trie.get(result.model, result.shorter)
            self._touch(model, result.shorter)
            return copy.deepcopy(entry.prompt_cache), tokens[short_length:]
        return None, tokens

    def insert_cache(self, model: Any, tokens: List[int], prompt_cache: List[Any], *, cache_type: str = "assistant"):
        """Keep ``prompt_cache`` as the cache of ``tokens``, then apply the limits."""
        key = (model, tuple(tokens))
        entry = self.CacheEntry(prompt_cache, sum(c.nbytes for c in prompt_cache), cache_type)
        prev = self._trie.add(model, list(tokens), entry)
        if prev is not None:
            self._n_bytes -= prev.nbytes
        self._entries[key] = (entry, self._node(model, tokens))
        self._entries.move_to_end(key)
        self._n_bytes += entry.nbytes
        if _serves_prefixes(prompt_cache):  # a full cache serves its prefixes by trimming: drop them
            for i in range(len(tokens)):
                if (model, tuple(tokens[:i])) in self._entries:
                    self._pop((model, tuple(tokens[:i])))
        self.trim_to(n_sequences=self.max_size, n_bytes=self.max_bytes)

    def trim_to(self, *, n_sequences: Optional[int] = None, n_bytes: Optional[int] = None) -> None:
        """Drop least recently used entries until at most ``n_sequences`` sequences and as many
        shorter entries remain, holding at most ``n_bytes`` together."""
        n_sequences = max(0, n_sequences) if n_sequences is not None else 1 << 63
        n_bytes = max(0, n_bytes) if n_bytes is not None else 1 << 63
        while self._entries:
            leaves, inner = [], []
            for key, (_, node) in self._entries.items():
                (leaves if self._is_leaf(node) else inner).append(key)
            if len(leaves) > n_sequences:
                self._pop(leaves[0])
            elif len(inner) > n_sequences:
                self._pop(inner[0])
            elif self._n_bytes > n_bytes:
                self._pop(next(iter(self._entries)))
            else:
                return

    def _node(self, model: Any, tokens) -> dict:
        node = self._trie._trie[model]
        for t in tokens:
            node = node[t]
        return node

    def _pop(self, key) -> None:
        model, tokens = key
        entry, _ = self._entries.pop(key)
        self._trie.pop(model, list(tokens))
        self._n_bytes -= entry.nbytes
