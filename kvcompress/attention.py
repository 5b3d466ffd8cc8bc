"""Let compressed caches see the real queries: a thin wrapper around mlx-lm's attention.

mlx-lm models call ``scaled_dot_product_attention(queries, keys, values, cache=..., scale=...,
mask=...)`` imported from ``mlx_lm.models.base`` into each model module. :func:`install`
replaces that name in the modules of a loaded model's layers with a wrapper that computes
attention exactly as before and then hands the step's queries to the cache
(:meth:`CompressedKVCache.observe`). For any other cache it is a pass-through.
"""

from __future__ import annotations

import sys

import mlx.nn as nn

__all__ = ["install", "is_installed"]

_MARK = "__kvcompress_wrapped__"


def _wrap(original):
    from .cache import CompressedKVCache

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None, **kw):
        if not isinstance(cache, CompressedKVCache):
            return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks, **kw)
        out = cache.attend(original, queries, keys, values, scale, mask, sinks)
        cache.observe(queries, scale, mask)
        return out

    setattr(scaled_dot_product_attention, _MARK, original)
    scaled_dot_product_attention.__doc__ = original.__doc__
    return scaled_dot_product_attention


def _modules_of(model: nn.Module) -> set[str]:
    names = {type(model).__module__}
    for _, child in model.named_modules():
        names.add(type(child).__module__)
    return {n for n in names if n.startswith("mlx_lm.models.") or n in sys.modules}


def install(model: nn.Module) -> list[str]:
    """Wrap ``scaled_dot_product_attention`` in every module the model's layers come from.

    Idempotent; returns the module names that use the wrapper. Models that do not use
    mlx-lm's function are left alone (their caches fall back to the key-as-query proxy).
    """
    wrapped = []
    for name in sorted(_modules_of(model)):
        mod = sys.modules.get(name)
        fn = getattr(mod, "scaled_dot_product_attention", None) if mod else None
        if fn is None or not callable(fn):
            continue
        if not hasattr(fn, _MARK):
            setattr(mod, "scaled_dot_product_attention", _wrap(fn))
        wrapped.append(name)
    return wrapped


def is_installed(model: nn.Module) -> bool:
    """Whether some module of ``model`` routes attention through the wrapper."""
    for name in _modules_of(model):
        fn = getattr(sys.modules.get(name), "scaled_dot_product_attention", None)
        if fn is not None and hasattr(fn, _MARK):
            return True
    return False
