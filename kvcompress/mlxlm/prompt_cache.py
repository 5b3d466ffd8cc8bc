"""mlx-lm's LRU prompt cache, made exact for compressed entries.

``mlx_lm.models.cache.LRUPromptCache`` serves a new prompt from the cached entry nearest to it:
an exact match, a shorter entry the prompt extends (its cache is reused and only the rest is
prefilled), or a longer entry trimmed back to the common prefix. It decides with
``is_trimmable()``, which cannot say *how many* tokens a cache can drop. A compressed cache can
drop only the tokens of its last step exactly (older ones already shaped its evictions), so
:class:`CompressedPromptCache` asks each layer ``can_trim(n)`` for the actual ``n`` and, when a
longer entry cannot be trimmed exactly, falls back to the nearest shorter entry (or a fresh
prefill). It also keeps shorter entries that mlx-lm would drop because a longer trimmable entry
could serve them. Everything else -- the trie, LRU order, byte accounting -- is mlx-lm's.
"""

from __future__ import annotations

import copy
from typing import Any, List

from mlx_lm.models.cache import LRUPromptCache, trim_prompt_cache

__all__ = ["CompressedPromptCache", "can_trim"]


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


class CompressedPromptCache(LRUPromptCache):
    """``LRUPromptCache`` that trims a compressed entry only when the trim is exact."""

    def fetch_nearest_cache(self, model: Any, tokens: List[int]):
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
                return cache, tokens[prefix:]
        if short_length > 0:
            entry = self._trie.get(result.model, result.shorter)
            return copy.deepcopy(entry.prompt_cache), tokens[short_length:]
        return None, tokens

    def insert_cache(self, model: Any, tokens: List[int], prompt_cache: List[Any], *, cache_type: str = "assistant"):
        if _serves_prefixes(prompt_cache):
            return super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        entry = LRUPromptCache.CacheEntry(prompt_cache, sum(c.nbytes for c in prompt_cache), cache_type)
        self._n_bytes += entry.nbytes
        self._n_bytes_by_type[cache_type] += entry.nbytes
        prev = self._trie.add(model, tokens, entry)
        if prev is not None:
            self._n_bytes -= prev.nbytes
            self._n_bytes_by_type[prev.cache_type] -= prev.nbytes
            self._lru.remove(model, tokens)
        self._lru.push(model, tokens, cache_type)
        self.trim_to(n_sequences=self.max_size, n_bytes=self.max_bytes)
