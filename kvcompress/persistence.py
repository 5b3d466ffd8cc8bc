"""Save and load prompt caches that contain compressed layers (mlx-lm's file format).

Files are written and read by mlx-lm's own ``save_prompt_cache`` / ``load_prompt_cache`` (the
kvcompress classes are registered with mlx-lm, so its loader reads them too). kvcompress adds a
digest of every array and string the caches hold to the file's metadata; :func:`load_prompt_cache`
checks it, so a file damaged anywhere -- header or tensor data -- is reported, never loaded.
"""

from __future__ import annotations

import contextvars
import hashlib
from typing import Any, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import cache as _mlx_cache

from .errors import KVCompressError

__all__ = ["save_prompt_cache", "load_prompt_cache", "CorruptCacheFile"]

DIGEST_KEY = "kvcompress_digest"
#: the registry ``from_state`` builds methods from during a :func:`load_prompt_cache` call
LOAD_REGISTRY: contextvars.ContextVar = contextvars.ContextVar("kvcompress_load_registry", default=None)


class CorruptCacheFile(KVCompressError):
    """A prompt-cache file that cannot be read back exactly."""


def _digest(cache: list) -> str:
    h = hashlib.blake2b(digest_size=16)
    for _, x in tree_flatten([c.state for c in cache]):
        if isinstance(x, mx.array):
            a = x.view(mx.uint16) if x.dtype == mx.bfloat16 else x
            h.update(f"{x.dtype}{x.shape}".encode())
            h.update(np.ascontiguousarray(np.array(a)).tobytes())
        elif isinstance(x, str):
            h.update(x.encode())
    return h.hexdigest()


def save_prompt_cache(file_name: str, cache: list, metadata: Optional[dict] = None) -> None:
    """Write ``cache`` (any mix of mlx-lm and kvcompress layers) to a ``.safetensors`` file."""
    meta = dict(metadata or {})
    meta[DIGEST_KEY] = _digest(cache)
    _mlx_cache.save_prompt_cache(file_name, cache, meta)


def load_prompt_cache(file_name: str, return_metadata: bool = False, registry=None) -> Any:
    """Read a cache written by :func:`save_prompt_cache` (or mlx-lm's), checking its digest.

    Compressed layers rebuild their method from ``registry`` (default: the process-wide one).
    Raises :class:`CorruptCacheFile` naming the file if it cannot be read back exactly.
    """
    token = LOAD_REGISTRY.set(registry)
    try:
        cache, meta = _mlx_cache.load_prompt_cache(str(file_name), return_metadata=True)
    except KVCompressError:
        raise
    except FileNotFoundError:
        raise CorruptCacheFile(f"prompt-cache file {str(file_name)!r} does not exist") from None
    except Exception as exc:  # safetensors header, JSON or structure errors
        raise CorruptCacheFile(
            f"{file_name}: not a readable prompt-cache file ({type(exc).__name__}: {exc})"
        ) from None
    finally:
        LOAD_REGISTRY.reset(token)
    meta = dict(meta)
    want = meta.pop(DIGEST_KEY, None)
    if want is not None and _digest(cache) != want:
        raise CorruptCacheFile(f"{file_name}: the cache data does not match its digest; the file is damaged")
    return (cache, meta) if return_metadata else cache
