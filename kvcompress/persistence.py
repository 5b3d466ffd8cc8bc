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


def _header(file_name: str) -> Optional[dict]:
    """The JSON header of a ``.safetensors`` file (tensor names -> entries, ``__metadata__``), or
    None when it cannot be read (mlx's loader then says why)."""
    import json
    import struct

    try:
        with open(file_name, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                return None
            header = json.loads(f.read(n))
        return header if isinstance(header, dict) else None
    except (OSError, ValueError, struct.error):
        return None


def _check_complete(file_name: str) -> None:
    """Raise :class:`CorruptCacheFile` naming the first missing tensor when the file lacks one
    that its layers' structure implies (a layer, or an entry of a layer's state list): mlx-lm's
    loader would put an empty dict there and the cache would fail only when used."""
    header = _header(file_name)
    if header is None:
        return
    meta = header.pop("__metadata__", None) or {}
    n_layers = sum(1 for k in meta if k.startswith("1.") and k[2:].isdigit())  # the cache classes
    children: dict = {}
    for name in header:
        parts = name.split(".")
        for depth in range(len(parts)):
            children.setdefault(".".join(parts[:depth]), set()).add(parts[depth])
    if n_layers:
        children.setdefault("", set())
    for parent, names in sorted(children.items()):
        if not all(x.isdigit() for x in names):
            continue
        want = n_layers if parent == "" and n_layers else max(map(int, names)) + 1
        missing = [i for i in range(want) if str(i) not in names]
        if missing:
            key = f"{parent}.{missing[0]}" if parent else str(missing[0])
            layer = key.split(".")[0]
            what = f"layer {layer} (all its tensors)" if not parent else f"tensor {key!r} of layer {layer}"
            raise CorruptCacheFile(f"{file_name}: the file is damaged or incomplete: missing {what}")


def load_prompt_cache(file_name: str, return_metadata: bool = False, registry=None) -> Any:
    """Read a cache written by :func:`save_prompt_cache` (or mlx-lm's), checking its digest.

    Compressed layers rebuild their method from ``registry`` (default: the process-wide one).
    Raises :class:`CorruptCacheFile` naming the file if it cannot be read back exactly.
    """
    _check_complete(str(file_name))
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
