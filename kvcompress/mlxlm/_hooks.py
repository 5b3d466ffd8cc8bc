"""Stateless subclasses that hook a model's (or one of its modules') call, and the layer
input/output hook built on them.

:func:`kvcompress.mlxlm.attention.install_model_hook` gives a model such a subclass; budgets that
require ``layer_io`` (SqueezeAttention) also need each layer's input and attention output in a
prompt's first forward: :func:`install_layer_io` gives the model's blocks and attention modules
subclasses that pass those to the cache the block was called with, and nothing else. Both are
public through :mod:`kvcompress.mlxlm.attention`.
"""

from __future__ import annotations

import mlx.nn as nn

from ..engine import Engine
from ..errors import ConfigError

__all__ = ["subclass", "base_class", "install_layer_io"]

_BASE = "_kvcompress_io_base"
_MADE: dict = {}


def _cache_in(args, kwargs):
    for a in (*args, *kwargs.values()):
        if isinstance(a, Engine):
            return a
    return None


def _block_call(base, block, args, kwargs):
    cache = _cache_in(args, kwargs)
    if cache is None or not cache.wants_layer_io():
        return base.__call__(block, *args, **kwargs)
    cache.hold_layer_input(args[0] if args else next(iter(kwargs.values())))
    try:
        return base.__call__(block, *args, **kwargs)
    finally:
        cache.hold_layer_input(None)


def _attn_call(base, attn, args, kwargs):
    out = base.__call__(attn, *args, **kwargs)
    cache = _cache_in(args, kwargs)
    x = None if cache is None else cache.take_layer_input()
    if x is not None:
        cache.observe_layer_io(x, out)
    return out


def subclass(base: type, hook) -> type:
    """The stateless subclass of ``base`` whose ``__call__`` is ``hook(base, self, args, kwargs)``
    (one per ``(base, hook)``)."""
    key = (base, hook)
    if key not in _MADE:
        def __call__(self, *args, **kwargs):
            return hook(base, self, args, kwargs)

        _MADE[key] = type(
            base.__name__, (base,),
            {"__call__": __call__, _BASE: base, "__module__": base.__module__, "__doc__": base.__doc__},
        )
    return _MADE[key]


def base_class(obj) -> type:
    """The model's (or module's) own class, looking through the subclasses installed here."""
    return getattr(type(obj), _BASE, type(obj))


def install_layer_io(model: nn.Module, layers: list) -> None:
    """Route the input and attention output of the given model ``layers`` (indices) to their
    caches during a prompt's first forward. Needs Llama-like blocks (``input_layernorm`` and
    ``self_attn``, ``h = x + self_attn(input_layernorm(x), mask, cache)``)."""
    blocks = list(getattr(model, "layers", []))
    for i in layers:
        blk = blocks[i]
        if not (hasattr(blk, "input_layernorm") and isinstance(getattr(blk, "self_attn", None), nn.Module)):
            raise ConfigError(
                "this budget measures cos(x, x + self_attn(input_layernorm(x))) and needs Llama-like "
                f"blocks with input_layernorm and self_attn; layer {i} is "
                f"{type(blk).__module__}.{type(blk).__name__}"
            )
        for obj, hook in ((blk, _block_call), (blk.self_attn, _attn_call)):
            obj.__class__ = subclass(base_class(obj), hook)
