"""The caches the workloads compare, and how big they are.

Every workload runs registered methods (``kvcompress.make_prompt_cache``) against two mlx-lm
references: ``full`` (the model's default cache, ``KVCache`` per layer) and ``rotating``
(``RotatingKVCache(budget, keep)``: attention sinks + the most recent tokens, StreamingLLM's
policy). Sizes: :func:`cache_bytes` (everything a cache holds) and :func:`live_kv_bytes` (only
the live data, not spare capacity).
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

__all__ = [
    "BASELINES",
    "method_names",
    "entries",
    "label",
    "make_cache",
    "cache_bytes",
    "live_kv_bytes",
    "stored_tokens",
]

BASELINES = ("full", "rotating")


def method_names(methods: Optional[Sequence[str]], registry, allow: Sequence[str] = ()) -> list[str]:
    """``methods`` (None or empty: every registered method, so a newly installed plugin is
    benchmarked without touching the workloads); unknown names are a ValueError."""
    names = list(methods) if methods else sorted(registry.methods)
    unknown = [n for n in names if n not in registry.methods and n not in allow]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; registered: {sorted(registry.methods)}")
    return names


def label(name: str, params: dict) -> str:
    """``name`` or ``name:k=v,...`` for a variant with parameters."""
    return name + (":" + ",".join(f"{k}={v}" for k, v in params.items()) if params else "")


def entries(methods: Optional[Sequence[str]], registry, extra: Sequence = ()) -> list[tuple]:
    """``(kind, method, params, label)`` for the baselines, the methods and the extra variants.

    ``methods`` None = every registered method; extra variants of unregistered methods are
    skipped.
    """
    names = method_names(methods, registry, allow=BASELINES)
    out = [("baseline", b, {}, b) for b in BASELINES]
    out += [("method", n, {}, n) for n in names if n not in BASELINES]
    out += [("method", n, dict(p), label(n, dict(p))) for n, p in (extra or ())
            if n in registry.methods and (not methods or n in names)]
    return out


def make_cache(model, name: str, budget: int, *, keep: int = 4, seed: Optional[int] = None,
               params: Optional[dict] = None, registry=None) -> list:
    """Per-layer caches: ``"full"``, ``"rotating"`` (``RotatingKVCache(budget, keep)``) or the
    registered method ``name`` at ``budget`` (with ``seed`` and ``params`` when given)."""
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache as mlx_prompt_cache

    from kvcompress import make_prompt_cache

    if name == "full":
        return mlx_prompt_cache(model)
    if name == "rotating":
        return [RotatingKVCache(max_size=budget, keep=keep) for _ in model.layers]
    extra = dict(params or {})
    if seed is not None:
        extra["seed"] = seed
    return make_prompt_cache(model, name, registry=registry, budget=budget, **extra)


def cache_bytes(cache: list) -> int:
    """``sum(c.nbytes)`` over the layers: buffers, positions, scores, quantized blocks."""
    return int(sum(c.nbytes for c in cache))


def live_kv_bytes(cache) -> int:
    """Bytes of live cache data, not spare capacity.

    A kvcompress cache's ``state`` holds exactly what it keeps (stored keys/values sliced to
    its size, positions, scores, quantized blocks). mlx-lm's caches may return their whole
    preallocated buffer, so only their first ``size()`` slots of keys and values are counted.
    """
    from kvcompress import CompressedKVCache

    total = 0
    for c in cache:
        arrays = [a for a in c.state if isinstance(a, mx.array)]
        if isinstance(c, CompressedKVCache):
            total += sum(int(a.nbytes) for a in arrays)
        else:
            k, v = arrays[:2]
            n = min(int(c.size()), k.shape[2])
            total += (int(k.nbytes) + int(v.nbytes)) * n // k.shape[2]
    return total


def stored_tokens(layer_cache) -> int:
    """Tokens one layer's cache holds."""
    return int(layer_cache.size() if hasattr(layer_cache, "size") else layer_cache.offset)
