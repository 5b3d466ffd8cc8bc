"""Where a cache list meets the model it is used with: refuse a list made for another model, and
give the model what the list's methods need before the call.

mlx-lm models ``zip`` their layers with the cache list, so a list saved for a 5-layer model runs
silently on a 3-layer model (two layers never updated) or a 7-layer one (two layers never run),
whatever the caches are. :func:`check_fit` compares a list holding kvcompress caches with the
model: the number of entries (``len(model.make_cache())``), the place of every compressed layer
(the block it was built for, and that block's default cache is a plain ``KVCache``), the number
of compressed layers in the whole model and its KV heads. It runs in the model hook
(:func:`kvcompress.mlxlm.attention.install_model_hook`) before every call of a hooked model,
before any cache changes, and in :func:`kvcompress.load_prompt_cache` given ``model=``.

:func:`prepare_call` also routes layer input/output to caches whose budget needs it
(SqueezeAttention) and that are about to see their prompt, so a loaded empty cache re-splits its
budgets exactly as one fresh from :func:`kvcompress.make_prompt_cache`.
"""

from __future__ import annotations

from typing import Optional

import attrs
from mlx_lm.models.cache import KVCache

from ..engine import Engine
from .._model import default_cache, model_info
from ..errors import KVCompressError
from ._hooks import install_layer_io
from .distributed import topology

__all__ = ["CacheMismatch", "check_fit", "prepare_call", "model_facts"]

_FACTS = "_kvcompress_fit_facts"


class CacheMismatch(KVCompressError):
    """A cache list used with a model it was not made for."""


@attrs.frozen
class ModelFacts:
    """What a fitting cache list must agree with (read once per model and layer count)."""

    n_layers_local: int  # len(model.layers): the key under which the facts were read
    n_entries: int  # entries of the model's own cache list
    slots: frozenset  # indices of its plain KVCache layers (the ones kvcompress compresses)
    n_compressed: int  # compressed layers in the whole model (every pipeline rank)
    n_kv_heads: Optional[int]  # KV heads of a layer in the whole model


def model_facts(model) -> ModelFacts:
    """The model's cache-list facts, read once and kept on the model (re-read if its layer count
    changes, e.g. after sharding)."""
    n_local = len(getattr(model, "layers", ()) or ())
    facts = getattr(model, _FACTS, None)
    if isinstance(facts, ModelFacts) and facts.n_layers_local == n_local:
        return facts
    default = default_cache(model)
    slots = frozenset(i for i, c in enumerate(default) if type(c) is KVCache)
    topo = topology(model)
    kv = topo.kv_heads or model_info(model).n_kv_heads
    facts = ModelFacts(n_local, len(default), slots, topo.n_layers or len(slots), kv)
    object.__setattr__(model, _FACTS, facts)  # a plain attribute (not a parameter of the module)
    return facts


def _engines(cache_list) -> list:
    return [(i, c) for i, c in enumerate(cache_list) if isinstance(c, Engine)]


def check_fit(model, cache_list, where: str = "the cache list") -> None:
    """Raise :class:`CacheMismatch` unless ``cache_list`` (holding kvcompress caches) fits
    ``model``; a list without kvcompress caches is not checked (mlx-lm's own business)."""
    engines = _engines(cache_list)
    if not engines:
        return
    facts = model_facts(model)
    first = engines[0][1].info
    made_for = (f"made for a model with {first.n_layers} compressed layer(s)"
                if first.block is not None else "built by hand")
    if len(cache_list) != facts.n_entries:
        raise CacheMismatch(
            f"{where} holds {len(cache_list)} layer cache(s) ({made_for}), but {type(model).__name__} "
            f"runs {facts.n_entries} layer(s): use the cache with the model it was made for (mlx-lm "
            "models zip their layers with the cache list, so any other model would skip layers silently)"
        )
    for i, c in engines:
        info = c.info
        if info.block is None:
            continue  # a hand-built cache: only the list length is known
        if info.block != i or i not in facts.slots or info.n_layers != facts.n_compressed:
            raise CacheMismatch(
                f"{where}: entry {i} is a compressed cache made for block {info.block} of a model with "
                f"{info.n_layers} compressed layer(s); {type(model).__name__} has {facts.n_compressed} "
                f"full-attention layer(s) at blocks {sorted(facts.slots)}: use the cache with the model it "
                "was made for"
            )
        if info.n_kv_heads and facts.n_kv_heads and info.n_kv_heads != facts.n_kv_heads:
            raise CacheMismatch(
                f"{where}: layer {info.layer} was made for {info.n_kv_heads} KV heads; "
                f"{type(model).__name__} has {facts.n_kv_heads}: use the cache with the model it was made for"
            )


def prepare_call(model, cache_list) -> None:
    """Before a hooked model's call: check the list (:func:`check_fit`) and route layer I/O to
    the caches whose budget needs it for the prompt they are about to see."""
    check_fit(model, cache_list)
    blocks = [c.info.block for _, c in _engines(cache_list) if c.wants_layer_io() and c.info.block is not None]
    if blocks:
        install_layer_io(model, blocks)
