"""The single-sequence compressed KV cache, obeying mlx-lm's cache protocol.

Guarantees (each one tested):

* ``offset`` is the number of tokens seen, so RoPE positions stay right after eviction; the
  stored length is :meth:`size`.
* Eviction is deferred: a step's tokens are all attended by that step; compression happens at
  the *next* ``update_and_fetch``, with the scores the previous steps' real queries left. Before
  appending ``S`` tokens the cache keeps at most ``budget - 1`` old ones, so a decode step
  attends exactly ``budget`` tokens and a chunk of ``S`` tokens attends ``budget - 1 + S``
  (the rule of mlx-lm's ``RotatingKVCache``).
* Masks are exact for any step after any eviction: every slot remembers its position.
* ``trim(n)`` within the last step is exact (speculative decoding's rejected draft tokens
  leave without a trace); anything older raises before changing the cache.
* ``merge`` builds the batched cache (:class:`~kvcompress.BatchCompressedKVCache`) that
  ``mlx_lm.batch_generate`` and ``BatchGenerator`` use.
"""

from __future__ import annotations

import contextvars
import json
from typing import Optional

from mlx_lm.models.base import create_causal_mask

from .engine import Engine
from .contexts import LayerInfo
from .errors import ConfigError

__all__ = ["CompressedKVCache"]

#: the registry ``from_state`` builds methods from during a :func:`kvcompress.load_prompt_cache` call
LOAD_REGISTRY: contextvars.ContextVar = contextvars.ContextVar("kvcompress_load_registry", default=None)


class CompressedKVCache(Engine):
    """A bounded KV cache for one attention layer of one sequence, driven by a
    :class:`~kvcompress.Method`.

    Args:
        method: the composition (scorer, selector, disposition, budget).
        budget: tokens kept for this layer (the decode attention span).
        layer: the layer index (seeds draws, labels diagnostics); ``info`` gives the full
            identity (global layer, head offset) under model parallelism.
        group: the :class:`~kvcompress.group.PromptGroup` of the prompt's caches.
    """

    #: the batched class :meth:`merge` builds (:mod:`kvcompress.batch_cache` sets it when imported,
    #: and importing kvcompress imports it)
    batch_class: Optional[type] = None

    @property
    def offset(self) -> int:
        """Tokens seen (the RoPE position of the next token)."""
        off = self.rows_offset
        return off[0] if off else 0

    @property
    def budget(self) -> int:
        return self.default_budget if not self.rows_budget else self.rows_budget[0]

    @budget.setter
    def budget(self, value: int) -> None:
        self.set_budget(value)

    @property
    def layer(self) -> int:
        return self.info.layer

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        """The mask for the next step of ``N`` tokens (the cache applies its exact slot mask in
        attention; this one is for models that inspect it)."""
        if window_size is not None:
            raise ConfigError(
                "kvcompress caches do not support sliding-window attention layers; compress only "
                "the model's full-attention layers"
            )
        if N == 1:
            return None
        if not return_array:
            return "causal"
        # The layout after this step's eviction. (Models that apply one array mask to every layer
        # are refused per-layer budgets when the caches are built.)
        return create_causal_mask(N, self.held_after(N))

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        """mlx-lm's ``kv_bits`` quantizes a full cache; it cannot wrap a compressed one. The
        method's own storage (``kv_bits`` of :func:`kvcompress.make_prompt_cache`) holds the kept
        slots in low bits instead."""
        raise ConfigError(
            f"mlx-lm's kv_bits={bits} cannot be combined with a kvcompress cache (it would quantize a "
            f"full cache, not the tokens the budget keeps); drop it from the generate call and pass "
            f"kv_bits to kvcompress.make_prompt_cache(model, method, budget=..., kv_bits={bits}, "
            f"kv_group_size={group_size}) (or --kv-bits on kvcompress generate/serve) to store the kept "
            "slots in low bits"
        )

    @classmethod
    def merge(cls, caches):
        """The batched cache holding ``caches`` as rows (mlx-lm's batching entry point)."""
        return cls.batch_class.merge(caches)

    @classmethod
    def from_state(cls, state, meta_state=None, registry=None):
        """Rebuild a cache saved with ``save_prompt_cache`` (kvcompress's or mlx-lm's loader)."""
        return _rebuild(cls, state, registry)

    def __repr__(self) -> str:
        return (
            f"CompressedKVCache(method={self.method.name!r}, layer={self.info.layer}, "
            f"budget={self.budget}, offset={self.offset}, kept={self.tokens_kept})"
        )


def _rebuild(cls, state, registry=None):
    """A cache of ``cls`` from a saved state list (shared by both cache classes)."""
    from .group import join
    from .method import build_method

    if not state or not isinstance(state[-1], str):
        raise ConfigError("not a kvcompress cache state: its last entry must be the JSON metadata")
    m = json.loads(state[-1])
    reg = registry or LOAD_REGISTRY.get()
    method = build_method(_as_saved(m["config"], reg), registry=reg)
    info = LayerInfo(**m["info"])
    group = join(f"load:{m['group']}", info.layer, group_id=m["group"])
    return cls.restore(method, int(m["budget"]), state, info, group)


def _as_saved(config, registry=None):
    """A saved config with each named component's parameters completed by that component's own
    defaults: a file records every parameter its components had, so one they gained since takes
    the component's default (its behaviour before), not a method default added with it."""
    from .components import KINDS
    from .registry import get_registry

    if not isinstance(config, dict):
        return config
    reg = registry or get_registry()
    out = dict(config)
    for kind in KINDS:
        table = out.get(kind)
        if isinstance(table, dict) and isinstance(table.get("name"), str):
            out[kind] = {**reg.component(kind, table["name"]).params(), **table}
    return out
