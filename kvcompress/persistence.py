"""Save and load prompt caches that contain compressed layers.

The file format is mlx-lm's (``save_prompt_cache``); mlx-lm's loader only knows its own cache
classes, so :func:`load_prompt_cache` rebuilds :class:`CompressedKVCache` layers itself and
delegates every other class to mlx-lm.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
from mlx.utils import tree_unflatten
from mlx_lm.models import cache as _mlx_cache

from .cache import CompressedKVCache

__all__ = ["save_prompt_cache", "load_prompt_cache"]

_CLASSES = {"CompressedKVCache": CompressedKVCache}


def save_prompt_cache(file_name: str, cache: list, metadata: Optional[dict] = None) -> None:
    """Write ``cache`` (any mix of mlx-lm and kvcompress layers) to a ``.safetensors`` file."""
    _mlx_cache.save_prompt_cache(file_name, cache, metadata or {})


def load_prompt_cache(file_name: str, return_metadata: bool = False, registry=None) -> Any:
    """Read a cache written by :func:`save_prompt_cache` (or mlx-lm's).

    Compressed layers rebuild their method from ``registry`` (default: the process-wide one).
    """
    arrays, cache_metadata = mx.load(file_name, return_metadata=True)
    metadata, classes, scalars = tree_unflatten(list(cache_metadata.items()))
    for pos, kind in scalars[1:]:
        a = arrays[pos]
        if kind == "scalar":
            arrays[pos] = a.item()
        elif kind == "string":
            arrays[pos] = "".join(chr(i) for i in a.tolist())
        elif kind == "none":
            arrays[pos] = None
        else:
            raise ValueError(f"unknown scalar type {kind!r} in {file_name}")
    states = tree_unflatten(list(arrays.items()))
    cache = []
    for cls_name, state in zip(classes, states):
        cls = _CLASSES.get(cls_name) or getattr(_mlx_cache, cls_name, None)
        if cls is None:
            raise ValueError(f"{file_name}: unknown cache class {cls_name!r}")
        if cls is CompressedKVCache:
            cache.append(cls.from_state(state, registry=registry))
        else:
            cache.append(cls.from_state(state))
    return (cache, metadata) if return_metadata else cache
