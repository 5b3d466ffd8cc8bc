"""What kvcompress reads from an mlx-lm model before building or checking its caches: its shape
facts (:func:`model_info`) and its own cache list (:func:`default_cache`).

Public as :func:`kvcompress.model_info` and :mod:`kvcompress.factory`'s; kept here, below both the
factory and :mod:`kvcompress.mlxlm.fit` (which checks a cache list against the model), so neither
imports the other.
"""

from __future__ import annotations

from typing import Optional

import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from .contexts import ModelInfo
from .errors import ConfigError

__all__ = ["model_info", "default_cache"]


def _attention_modules(model: nn.Module) -> list:
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ConfigError(f"{type(model).__name__} has no .layers; is it an mlx-lm model?")
    return [getattr(layer, "self_attn", getattr(layer, "attention", None)) for layer in layers]


def model_info(model: nn.Module, n_layers: Optional[int] = None) -> ModelInfo:
    """The shape facts a budget may use, read from the model's attention modules."""
    attn = next((a for a in _attention_modules(model) if a is not None), None)
    n_kv = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None)
    head_dim = getattr(attn, "head_dim", None)
    return ModelInfo(
        n_layers=n_layers if n_layers is not None else len(model.layers),
        n_kv_heads=n_kv,
        head_dim=head_dim,
        model_type=str(getattr(model, "model_type", "")),
    )


def default_cache(model: nn.Module) -> list:
    """The model's own cache list (its class's ``make_cache``, else one ``KVCache`` per layer).

    Reads the *class* method, so a ``model.make_cache`` attribute that returns compressed caches
    (see :func:`kvcompress.attach`) does not recurse.
    """
    make = getattr(type(model), "make_cache", None)
    return make(model) if make is not None else [KVCache() for _ in model.layers]
