"""The ``squeeze`` budget: measure layer importance on the prompt, then re-split the budget.

Until the prompt has been seen every layer has the uniform budget ``b``. :meth:`SqueezeBudget.bind`
(called by :func:`kvcompress.make_prompt_cache`) swaps the class of each transformer block and
of its ``self_attn`` in *this model instance* for a subclass that, during the first forward
(the caches are still empty: prefill, or its first chunk), records for each layer

    c_l = mean over batch and tokens of cos(x, x + self_attn(input_layernorm(x)))

with ``x`` the block's input. When every compressed layer has reported, the budgets of
:func:`~kvcompress_squeeze.allocate.squeeze_budgets` are written to ``cache.budget``. The
first forward never evicts (eviction is deferred to the next ``update_and_fetch``), so the
new budgets take effect before any eviction. Later forwards pass straight through.

Works for mlx-lm models whose ``model.layers`` blocks have ``input_layernorm`` and ``self_attn``
with ``h = x + self_attn(input_layernorm(x), mask, cache)`` (Llama, Mistral, Qwen2/3, Phi-3, ...).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, ClassVar, Optional

import attrs
import mlx.core as mx
import mlx.nn as nn
from attrs.validators import ge, gt, instance_of, le

from kvcompress.errors import ConfigError

from .allocate import squeeze_budgets

__all__ = ["SqueezeBudget", "unbind"]

_BASE = "_kvcompress_squeeze_base"


@attrs.frozen
class SqueezeBudget:
    """SqueezeAttention (Wang et al., 2024): layer budgets from attention's effect on the prompt.

    ``budget``: the mean per-layer budget (total = ``n_layers * budget``); ``squeeze_ratio``: the
    least important cluster's budget as a fraction of ``budget`` (SqueezeAttention's
    ``KV_class3 / ini_size``); ``n_clusters``: k of the k-means; ``seed``: k-means++ starts.
    """

    budget: int = attrs.field(default=512, validator=[instance_of(int), ge(1)])
    squeeze_ratio: float = attrs.field(default=0.4, converter=float, validator=[gt(0.0), le(1.0)])
    n_clusters: int = attrs.field(default=3, validator=[instance_of(int), ge(1)])
    seed: int = attrs.field(default=0, validator=instance_of(int))

    requires: ClassVar[frozenset] = frozenset()
    provides: ClassVar[frozenset] = frozenset({"layer_budgets"})

    def layer_budgets(self, info) -> list[int]:
        """Uniform until the prompt is observed (see :meth:`bind`)."""
        return [self.budget] * info.n_layers

    def allocate(self, similarity, min_budget: int = 1) -> list[int]:
        return squeeze_budgets(
            similarity, self.budget, self.squeeze_ratio, self.n_clusters, self.seed, min_budget
        )

    def bind(self, model: nn.Module, caches: list) -> None:
        """Install the prompt observers on ``model`` for ``caches`` (one per compressed layer)."""
        blocks = _compressed_blocks(model, len(caches))
        rec = _Recorder(self, caches)
        made: dict = {}
        for block in blocks:
            for obj, hook in ((block, rec.block_call), (block.self_attn, rec.attn_call)):
                base = getattr(type(obj), _BASE, type(obj))
                key = (base, hook.__name__)
                if key not in made:
                    made[key] = _subclass(base, hook)
                obj.__class__ = made[key]


def unbind(model: nn.Module) -> None:
    """Give the blocks and attention modules of ``model`` their original classes back."""
    for block in getattr(model, "layers", []):
        for obj in (block, getattr(block, "self_attn", None)):
            base = getattr(type(obj), _BASE, None) if obj is not None else None
            if base is not None:
                obj.__class__ = base


def _compressed_blocks(model: nn.Module, n_caches: int) -> list:
    from mlx_lm.models.cache import KVCache

    layers = getattr(model, "layers", None)
    if layers is None:
        raise ConfigError(f"the squeeze budget needs an mlx-lm model with .layers; {type(model).__name__} has none")
    default = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in layers]
    slots = [i for i, c in enumerate(default) if type(c) is KVCache]
    if len(slots) != n_caches:
        raise ConfigError(f"squeeze: {n_caches} compressed caches but {len(slots)} full-attention layers")
    blocks = [layers[i] for i in slots]
    for i, blk in zip(slots, blocks):
        if not (hasattr(blk, "input_layernorm") and isinstance(getattr(blk, "self_attn", None), nn.Module)):
            raise ConfigError(
                f"the squeeze budget measures cos(x, x + self_attn(input_layernorm(x))) and needs "
                f"Llama-like blocks with input_layernorm and self_attn; layer {i} is "
                f"{type(blk).__module__}.{type(blk).__name__}"
            )
    return blocks


def _subclass(base: type, hook) -> type:
    def __call__(self, *args, **kwargs):
        return hook(base, self, args, kwargs)

    return type(
        f"Squeeze{base.__name__}",
        (base,),
        {"__call__": __call__, _BASE: base, "__module__": base.__module__, "__doc__": base.__doc__},
    )


class _Recorder:
    """Collects the per-layer cosines of the first forward, then sets the budgets once."""

    def __init__(self, comp: SqueezeBudget, caches: list):
        self.comp = comp
        self.refs = {id(c): (i, weakref.ref(c)) for i, c in enumerate(caches)}
        self.inputs: dict[int, mx.array] = {}
        self.cos: dict[int, mx.array] = {}
        self.done = False
        self.similarity: Optional[list[float]] = None

    def _cache_in(self, args, kwargs) -> Any:
        for a in (*args, *kwargs.values()):
            entry = self.refs.get(id(a))
            if entry is not None and entry[1]() is a:
                return a
        return None

    def block_call(self, base, block, args, kwargs):
        cache = None if self.done else self._cache_in(args, kwargs)
        if cache is None or cache.offset != 0:
            return base.__call__(block, *args, **kwargs)
        self.inputs[id(cache)] = args[0] if args else next(iter(kwargs.values()))
        try:
            return base.__call__(block, *args, **kwargs)
        finally:
            self.inputs.pop(id(cache), None)

    def attn_call(self, base, attn, args, kwargs):
        out = base.__call__(attn, *args, **kwargs)
        if self.inputs:
            cache = self._cache_in(args, kwargs)
            x = self.inputs.pop(id(cache), None) if cache is not None else None
            if x is not None:
                self._record(self.refs[id(cache)][0], x, out)
        return out

    def _record(self, layer: int, x: mx.array, r: mx.array) -> None:
        x = x.astype(mx.float32)
        h = x + r.astype(mx.float32)
        cos = (x * h).sum(-1) / (mx.sqrt((x * x).sum(-1) * (h * h).sum(-1)) + 1e-12)
        self.cos[layer] = cos.mean()
        if len(self.cos) == len(self.refs):
            self._finish()

    def _finish(self) -> None:
        self.done = True
        sims = mx.stack([self.cos[i] for i in range(len(self.refs))])
        self.similarity = [float(s) for s in sims.tolist()]
        caches = [ref() for _, ref in sorted(self.refs.values(), key=lambda e: e[0])]
        caches = [c for c in caches if c is not None]
        if len(caches) != len(self.refs) or any(c.evictions for c in caches):
            warnings.warn("squeeze: caches changed before the prompt was observed; budgets left uniform",
                          RuntimeWarning, stacklevel=2)
            return
        sel = caches[0].method.selector
        min_b = 1
        while sel.reserved(min_b) >= min_b:
            min_b += 1
        budgets = self.comp.allocate(self.similarity, min_budget=min_b)
        for c, b in zip(caches, budgets):
            c.budget = int(b)
            c.shared.setdefault("squeeze", {"similarity": self.similarity, "budgets": budgets})
