"""The caches the workloads compare, and how big they are.

Every workload runs registered methods (``kvcompress.make_prompt_cache``) against two mlx-lm
references: ``full`` (the model's default cache, ``KVCache`` per layer) and ``rotating``
(``RotatingKVCache(budget, keep)``: attention sinks + the most recent tokens, StreamingLLM's
policy). On request (their names in ``methods``) the workloads that take them (scaling,
perplexity, retrieval) also run mlx-lm's own quantized cache: ``quantized2`` / ``quantized4`` /
``quantized8`` = ``QuantizedKVCache(group_size, bits)`` per layer (every token kept, keys and
values quantized per token in groups of ``group_size`` = 64 channels, mlx-lm's default, or 32
when 64 does not divide the head; no budget). Sizes: :func:`cache_bytes` (everything a cache
holds) and :func:`live_kv_bytes` (only the live data, not spare capacity).
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

__all__ = [
    "BASELINES",
    "QUANTIZED",
    "REFERENCES",
    "quantized_cache",
    "method_names",
    "entries",
    "label",
    "make_cache",
    "cache_bytes",
    "live_kv_bytes",
    "stored_tokens",
]

BASELINES = ("full", "rotating")
#: mlx-lm's ``QuantizedKVCache`` by bits (opt-in: name them in ``methods``; they have no budget)
QUANTIZED = {"quantized2": 2, "quantized4": 4, "quantized8": 8}
#: every cache kind that is not a registered method
REFERENCES = BASELINES + tuple(QUANTIZED)


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
    names = method_names(methods, registry, allow=REFERENCES)
    out = [("baseline", b, {}, b) for b in BASELINES]
    out += [("baseline" if n in QUANTIZED else "method", n, {}, n) for n in names if n not in BASELINES]
    out += [("method", n, dict(p), label(n, dict(p))) for n, p in (extra or ())
            if n in registry.methods and (not methods or n in names)]
    return out


def make_cache(model, name: str, budget: int, *, keep: int = 4, seed: Optional[int] = None,
               params: Optional[dict] = None, registry=None, tokenizer=None) -> list:
    """Per-layer caches: ``"full"``, ``"rotating"`` (``RotatingKVCache(budget, keep)``),
    ``"quantized<bits>"`` (:func:`quantized_cache`; ``budget`` ignored) or the registered method
    ``name`` at ``budget`` (with ``seed`` and ``params`` when given; ``tokenizer`` resolves
    symbolic token ids, :meth:`kvcompress.Method.with_tokenizer`)."""
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache as mlx_prompt_cache

    from kvcompress import make_prompt_cache

    if name == "full":
        return mlx_prompt_cache(model)
    if name == "rotating":
        return [RotatingKVCache(max_size=budget, keep=keep) for _ in model.layers]
    if name in QUANTIZED:
        return quantized_cache(model, QUANTIZED[name])
    extra = dict(params or {})
    if seed is not None:
        extra["seed"] = seed
    policy = extra.pop("budget", None)  # a budget component (``pyramid``), sized by the sweep
    if isinstance(policy, str):
        policy = {"name": policy}
    if policy is not None and not isinstance(policy, dict):
        raise ValueError(f"{name}: budget={policy!r} in a variant must name a budget component; the sweep sets "
                         "the size")
    size = budget if policy is None else {**policy, "budget": budget}
    return make_prompt_cache(model, name, registry=registry, budget=size, tokenizer=tokenizer, **extra)


def _head_dim(model) -> Optional[int]:
    attn = getattr(model.layers[0], "self_attn", None)
    d = getattr(attn, "head_dim", None)
    if d is None:
        args = getattr(model, "args", None)
        d = getattr(args, "head_dim", None) or (
            args.hidden_size // args.num_attention_heads if args is not None else None)
    return None if d is None else int(d)


def quantized_cache(model, bits: int) -> list:
    """mlx-lm's ``QuantizedKVCache(group_size, bits)`` per layer, as ``kv_bits`` builds it
    (``group_size`` 64, mlx-lm's default, or 32 when 64 does not divide the head size).

    A head smaller than MLX's smallest group (32; stories260K has 8) cannot be quantized by
    mlx-lm at all: then each layer gets :class:`PaddedQuantizedKVCache`, which stores exactly
    what ``QuantizedKVCache`` would store for the head edge-padded to 32 channels (one group
    per token and head, whose min/max are the real channels', so the real channels round as in
    a group of ``head_dim``) and attends over its dequantized keys and values.
    """
    from mlx_lm.models.cache import QuantizedKVCache

    d = _head_dim(model)
    group = 64 if d is None or d % 64 == 0 else 32
    if d is not None and d % group:
        return [PaddedQuantizedKVCache(d, bits=bits) for _ in model.layers]
    return [QuantizedKVCache(group_size=group, bits=bits) for _ in model.layers]


class PaddedQuantizedKVCache:
    """``QuantizedKVCache`` storage for a head size MLX's groups do not divide (see
    :func:`quantized_cache`): keys and values are padded to ``group`` channels by repeating the
    last one, stored by an inner ``QuantizedKVCache``, and returned dequantized (cut to the
    head size) so that the model's plain attention reads them. ``nbytes`` is the inner cache's."""

    def __init__(self, head_dim: int, bits: int, group: int = 32):
        from mlx_lm.models.cache import QuantizedKVCache

        self.head_dim, self.group = head_dim, group
        self.inner = QuantizedKVCache(group_size=group, bits=bits)

    def _pad(self, x: mx.array) -> mx.array:
        pad = -x.shape[-1] % self.group
        return x if not pad else mx.concatenate([x, mx.repeat(x[..., -1:], pad, axis=-1)], axis=-1)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        qk, qv = self.inner.update_and_fetch(self._pad(keys), self._pad(values))
        g, b = self.group, self.inner.bits
        k = mx.dequantize(*qk, group_size=g, bits=b)[..., : keys.shape[-1]]
        v = mx.dequantize(*qv, group_size=g, bits=b)[..., : values.shape[-1]]
        return k, v

    @property
    def offset(self) -> int:
        return self.inner.offset

    @property
    def state(self):
        return self.inner.state

    def size(self) -> int:
        return self.inner.offset

    def empty(self) -> bool:
        return self.inner.empty()

    def make_mask(self, *args, **kwargs):
        return self.inner.make_mask(*args, **kwargs)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return self.inner.trim(n)

    @property
    def keys(self):
        return self.inner.keys

    @property
    def nbytes(self) -> int:
        return 0 if self.inner.keys is None else self.inner.nbytes


def cache_bytes(cache: list) -> int:
    """``sum(c.nbytes)`` over the layers: buffers, positions, scores, quantized blocks."""
    return int(sum(0 if getattr(c, "keys", 0) is None else c.nbytes for c in cache))


def live_kv_bytes(cache) -> int:
    """Bytes of live cache data, not spare capacity.

    A kvcompress cache's ``state`` holds exactly what it keeps (stored keys/values sliced to
    its size, positions, scores, quantized blocks). mlx-lm's caches may return their whole
    preallocated buffer, so only their first ``size()`` slots of keys and values are counted.
    """
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import QuantizedKVCache

    from kvcompress import CompressedKVCache

    total = 0
    for c in cache:
        if isinstance(c, PaddedQuantizedKVCache):
            c = c.inner
        if isinstance(c, QuantizedKVCache):  # (codes, scales, biases) of keys and of values
            for a in (*c.keys, *c.values) if c.keys is not None else ():
                total += int(a.nbytes) * min(c.offset, a.shape[2]) // a.shape[2]
            continue
        if isinstance(c, CompressedKVCache):  # (a low-bit store saves its codes, scales and biases)
            total += sum(int(a.nbytes) for _, a in tree_flatten(c.state) if isinstance(a, mx.array))
            continue
        k, v = [a for a in c.state if isinstance(a, mx.array)][:2]
        n = min(int(c.size()), k.shape[2])
        total += (int(k.nbytes) + int(v.nbytes)) * n // k.shape[2]
    return total


def stored_tokens(layer_cache) -> int:
    """Tokens one layer's cache holds."""
    from mlx_lm.models.cache import QuantizedKVCache

    if isinstance(layer_cache, QuantizedKVCache):  # its size() is the base class's 0
        return int(layer_cache.offset)
    return int(layer_cache.size() if hasattr(layer_cache, "size") else layer_cache.offset)
