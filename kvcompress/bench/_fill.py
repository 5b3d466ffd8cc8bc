"""The synthetic fill of the speed workloads: caches brought to a context through the cache
protocol, without the model's forward.

A model prefill of 8k tokens costs minutes per cache on a CPU; what a decode-speed comparison
needs is only each layer's cache holding its budget of an 8k-token context. :func:`synthetic_fill`
feeds every layer seeded random post-RoPE keys and values (``update_and_fetch``) and, for the
compressed caches, random queries (``observe``, as the attention wrapper would), in the chunks a
prefill would use, so each method scores, selects and evicts as it does in a prefill. The same
inputs reach every cache kind (drawn per layer and chunk start). Methods whose scorer needs the
model itself (token ids, predictions, reconstruction passes: ``kvzip``, ``selfinfo``) cannot be
filled this way and are refused with the reason.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from ..errors import KVCompressError
from ._harness import chunks
from ._profile import _cache_arrays, _layer_inputs

__all__ = ["synthetic_fill"]


def synthetic_fill(shape, seed: int = 0) -> Callable[[list, int, int, int], int]:
    """``fill(cache, start, end, step)``: tokens ``start .. end`` of every layer of ``cache`` (a
    list of layer caches) in chunks whose boundaries fall on multiples of ``step``, like
    :func:`~kvcompress.bench._harness.prefill`; returns ``end``. ``shape`` gives the heads, head
    dimension and dtype (:class:`~kvcompress.bench._model.ModelShape`)."""
    from kvcompress import CompressedKVCache

    scale = shape.head_dim ** -0.5

    def fill(cache: list, start: int, end: int, step: int) -> int:
        for pos, stop in chunks(start, end, step):
            for layer, c in enumerate(cache):
                # three keys per (layer, chunk start): key, key + 1, key + 2
                k, v, q = _layer_inputs(shape, stop - pos, 3 * (seed * 1_000_003 + layer * 65_537 + pos))
                try:
                    c.update_and_fetch(k, v)
                    if isinstance(c, CompressedKVCache):
                        c.observe(q, scale)
                except KVCompressError as exc:
                    why = str(exc).split(", but")[0]  # what the method needs from the model
                    raise ValueError(f"the synthetic fill feeds the cache without the model ({why}): "
                                     "use fill 'prompt'") from exc
            mx.eval([a for c in cache for a in _cache_arrays(c)])
        return end

    return fill
