"""The server's prompt cache with a second tier on disk (``kvcompress serve --prompt-cache-dir``).

:class:`PersistentPromptCache` is :class:`~kvcompress.mlxlm.prompt_cache.CompressedPromptCache`
(the in-memory tier, unchanged) plus a folder (:class:`~.cache_dir.CacheDir`):

* **what is written** -- every entry the memory tier keeps (the caches a conversation may
  continue from: a finished request's prompt and answer, the prompt before its answer, a system
  prompt), each once, as a kvcompress prompt-cache file (mlx-lm's format plus its digest) with
  metadata saying what it is for: this module's format, the :mod:`.identity` of model, method and
  code, the tokens it holds, the entry's type.
* **when** -- on the generation thread (MLX arrays are used by the thread that made them) but
  only when it has nothing else to do: ``write_pending`` runs while no request waits and none is
  generating, one file at a time; an entry that leaves memory before it was written is written
  then; whatever is left is written at shutdown (``close``).
* **reading** -- on a miss in memory (memory reuses fewer tokens than a file would), the longest
  file whose tokens the prompt starts with (or equals: then its last token is trimmed, as in
  memory) is loaded, its metadata checked against this server's identity and the prompt, and the
  request resumes from it: only the rest of the prompt is prefilled and
  ``usage.prompt_tokens_details.cached_tokens`` counts the tokens the file held.
* **a file that cannot be used** -- damaged, truncated, not a cache file, or written for another
  model, method, budget or prompt -- is skipped with one log line (a warning, once per file) and
  the request is served from the next best entry or prefilled; a damaged file is removed.
"""

from __future__ import annotations

import collections
import json
import logging
import struct
from pathlib import Path
from typing import Any, Callable, List, Optional

import numpy as np
from mlx_lm.models.cache import trim_prompt_cache

from ..mlxlm.prompt_cache import CompressedPromptCache, can_trim
from .cache_dir import CacheDir, format_size
from .identity import FORMAT, Identity

__all__ = ["PersistentPromptCache", "META_FORMAT", "META_IDENTITY", "META_TOKENS", "META_TYPE"]

log = logging.getLogger("kvcompress.serve")

META_FORMAT, META_IDENTITY = "kvcompress_serve_format", "kvcompress_serve_identity"
META_TOKENS, META_TYPE = "kvcompress_serve_tokens", "kvcompress_serve_cache_type"
_INT64 = (-(2**63), 2**63 - 1)


def _tokens_json(tokens) -> str:
    return json.dumps([int(t) for t in tokens], separators=(",", ":"))


def _raw_metadata(path: Path) -> Optional[dict]:
    """The ``__metadata__`` of a ``.safetensors`` header read as-is (None if unreadable): a cheap
    first look that rejects a foreign file without loading its tensors."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                return None
            (n,) = struct.unpack("<Q", head)
            if n > 256 * 2**20:
                return None
            meta = json.loads(f.read(n)).get("__metadata__")
        return meta if isinstance(meta, dict) else None
    except (OSError, ValueError, AttributeError):
        return None


class PersistentPromptCache(CompressedPromptCache):
    """The in-memory prompt cache over a cache folder (see the module docstring).

    ``identify(model_key)`` gives the :class:`~.identity.Identity` of the caches built for
    mlx-lm's model key (None: unknown, nothing is read or written for it).
    """

    def __init__(self, max_size: int, folder: CacheDir, identify: Callable[[Any], Optional[Identity]],
                 max_bytes: int = 1 << 63):
        super().__init__(max_size, max_bytes)
        self.folder, self._identify = folder, identify
        #: entries not yet written: key -> (cache, cache type, identity, bytes), oldest first
        self._pending: collections.OrderedDict = collections.OrderedDict()
        #: entries in memory that have a file: key -> file name
        self._names: dict = {}
        self._skipped: set = set()
        self._warned: set = set()
        self.hits = self.hit_tokens = self.written = self.write_failures = self.skipped = 0

    # -- the memory tier's two hooks -----------------------------------------------------------
    def fetch_nearest_cache(self, model: Any, tokens: List[int]):
        cache, rest = super().fetch_nearest_cache(model, tokens)
        have = len(tokens) - len(rest)
        if have >= len(tokens) - 1 or not self._storable(tokens):
            return cache, rest
        identity = self._identify(model)
        if identity is None:
            return cache, rest
        for n, path in self.folder.candidates(identity.digest, tokens, more_than=have):
            loaded = self._load(path, identity, tokens[:n])
            if loaded is None:
                continue
            if n == len(tokens):  # at least one token must be processed, as in memory
                if not can_trim(loaded, 1):
                    continue
                trim_prompt_cache(loaded, 1)
                n -= 1
                if n <= have:
                    break
            self.folder.touch(path.name)
            self.hits += 1
            self.hit_tokens += n
            log.info("prompt cache: %d of %d prompt tokens resumed from %s", n, len(tokens), path.name)
            return loaded, tokens[n:]
        return cache, rest

    def insert_cache(self, model: Any, tokens: List[int], prompt_cache: List[Any], *, cache_type: str = "assistant"):
        key = (model, tuple(tokens))
        identity = self._identify(model) if self._storable(tokens) else None
        if identity is not None:
            self._names.pop(key, None)
            self._pending[key] = (prompt_cache, cache_type, identity, sum(c.nbytes for c in prompt_cache))
            self._pending.move_to_end(key)
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)

    def _pop(self, key) -> None:
        super()._pop(key)
        self._names.pop(key, None)
        pending = self._pending.pop(key, None)
        if pending is not None:  # leaving memory before it was written: write it now
            self._write(key, *pending)

    def _touch(self, model: Any, tokens) -> None:
        super()._touch(model, tokens)
        name = self._names.get((model, tuple(tokens)))
        if name is not None:
            self.folder.touch(name)  # reused from memory: recently used on disk too

    # -- writing -------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return len(self._pending)

    def write_pending(self, busy: Callable[[], bool] = lambda: False) -> int:
        """Write entries not yet on disk, oldest first, one at a time while ``busy()`` is false;
        returns how many were written. Call on the generation thread."""
        done = 0
        while self._pending and not busy():
            key, pending = self._pending.popitem(last=False)
            done += self._write(key, *pending)
        return done

    def close(self) -> None:
        """Write every pending entry (at shutdown, on the generation thread)."""
        self.write_pending()

    @staticmethod
    def _storable(tokens) -> bool:
        return all(isinstance(t, int) and _INT64[0] <= t <= _INT64[1] for t in tokens)

    def _write(self, key, cache, cache_type: str, identity: Identity, nbytes: int) -> bool:
        from ..persistence import save_prompt_cache

        model, tokens = key
        name = self.folder.name_for(identity.digest, np.asarray(tokens, dtype="<i8"))
        if self.folder.touch(name):  # already there (written before, or by another server)
            if key in self._entries:
                self._names[key] = name
            return False
        meta = {META_FORMAT: FORMAT, META_IDENTITY: identity.text, META_TOKENS: _tokens_json(tokens),
                META_TYPE: cache_type}
        estimate = int(nbytes * 1.05) + 65536 + 12 * len(tokens) + len(identity.text)
        try:
            with self.folder.writing(name, estimate) as tmp:
                save_prompt_cache(str(tmp), cache, meta)
        except Exception as exc:  # a full disk, a cache too large for the folder, an unwritable layer
            self.write_failures += 1
            why = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            level = logging.WARNING if type(exc).__name__ not in self._warned else logging.DEBUG
            self._warned.add(type(exc).__name__)
            log.log(level, "prompt-cache-dir: a cache of %d tokens was not written (%s)", len(tokens), why)
            return False
        self.written += 1
        if key in self._entries:
            self._names[key] = name
        return True

    # -- reading -------------------------------------------------------------------------------
    def _skip(self, path: Path, why: str, remove: bool) -> None:
        """Log ``path`` as not used (once per file version); remove it if it is damaged."""
        try:
            st = path.stat()
            mark = (path.name, st.st_size, st.st_mtime_ns)
        except OSError:
            mark = (path.name, None, None)
        if mark not in self._skipped:
            self._skipped.add(mark)
            self.skipped += 1
            log.warning("prompt-cache-dir: skipped %s (%s)%s; the prompt is computed instead", path.name, why,
                        "; removed it" if remove else "")
        if remove:
            self.folder.remove(path.name)

    def _check(self, meta: dict, identity: Identity, tokens) -> Optional[str]:
        """Why ``meta`` does not describe a cache of ``tokens`` under ``identity`` (None: it does)."""
        if meta.get(META_FORMAT) != FORMAT:
            return f"not a kvcompress serve cache file of format {FORMAT}"
        if meta.get(META_IDENTITY) != identity.text:
            return "written for another model, method, budget or kvcompress version"
        if meta.get(META_TOKENS) != _tokens_json(tokens):
            return "its tokens are not the prompt's"
        return None

    def _load(self, path: Path, identity: Identity, tokens) -> Optional[list]:
        from ..persistence import CorruptCacheFile, load_prompt_cache

        try:
            st = path.stat()
        except OSError:
            return None  # evicted meanwhile
        if (path.name, st.st_size, st.st_mtime_ns) in self._skipped:
            return None
        raw = _raw_metadata(path)
        if raw is None:
            self._skip(path, "not a readable safetensors file: damaged or truncated", remove=True)
            return None
        if META_FORMAT in raw and (why := self._check(raw, identity, tokens)) is not None:
            self._skip(path, why, remove=False)
            return None
        try:
            cache, meta = load_prompt_cache(str(path), return_metadata=True)
        except Exception as exc:
            if not path.exists():
                return None  # evicted by another server meanwhile
            if not isinstance(exc, CorruptCacheFile):
                log.debug("prompt-cache-dir: %s could not be loaded", path.name, exc_info=True)
            self._skip(path, f"damaged: {' '.join(str(exc).split())[:200]}", remove=True)
            return None
        why = self._check(meta, identity, tokens)
        if why is not None:
            self._skip(path, why, remove=False)
            return None
        return cache

    # -- reporting -----------------------------------------------------------------------------
    def disk_stats(self) -> dict:
        f = self.folder
        return {"path": str(f.path), "files": f.files, "bytes": f.bytes, "limit_bytes": f.max_bytes,
                "evicted": f.evicted, "hits": self.hits, "hit_tokens": self.hit_tokens, "written": self.written,
                "pending": len(self._pending), "write_failures": self.write_failures, "skipped": self.skipped}

    def describe(self) -> str:
        f = self.folder
        return f"{f.path} ({f.files} files, {format_size(f.bytes)} of {format_size(f.max_bytes)})"
