"""Where a sharded mlx-lm model's layers and heads sit in the whole model (``mlx.distributed``).

``mlx_lm.utils.sharded_load`` shards a model in one of two ways:

* **tensor parallelism** (``model.shard(group)``): every rank holds every layer; rank ``r`` holds
  the contiguous block ``r`` of the KV heads of each layer (with their query heads). Models whose
  KV cache is not split by heads (MLA, DeepSeek-V3: one latent "head") keep it *replicated* on
  every rank while their query heads are split.
* **pipeline parallelism** (``model.model.pipeline(group)``): rank ``r`` holds a contiguous block of
  layers with all their heads; rank 0 holds the last layers. The model's cache list has
  ``end_idx`` entries and its forward uses the first ``end_idx - start_idx`` for its own layers.

:func:`topology` reads this from a loaded model, so caches get their *global* layer index and
head offset (budgets, seeds and components follow global identities), and the engine knows when
scores need agreeing across ranks (:meth:`PromptGroup.reduce_scores`).
"""

from __future__ import annotations

from typing import Optional

import attrs
import mlx.core as mx

__all__ = ["Topology", "topology", "world", "STATS", "record"]

#: collectives kvcompress issued in this process (``calls``, payload ``bytes``), for benchmarks
STATS = {"calls": 0, "bytes": 0}


def record(array: mx.array) -> None:
    """Count one collective of ``array``'s payload in :data:`STATS`."""
    STATS["calls"] += 1
    STATS["bytes"] += array.nbytes


@attrs.frozen
class Topology:
    """The part of the model this process holds."""

    layer_offset: int = 0  # global index of this rank's first layer (pipeline)
    n_layers: Optional[int] = None  # layers in the whole model (None: this process holds all)
    n_local: Optional[int] = None  # layers this rank runs (pipeline), else all
    pp_size: int = 1
    pp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    head_offset: int = 0  # global index of this rank's first KV head (tensor parallelism)
    kv_heads: Optional[int] = None  # KV heads of a layer in the whole model
    kv_replicated: bool = False  # every rank holds the same KV heads, queries are split (MLA)


def world() -> Optional[mx.distributed.Group]:
    """The global group when this process is one of several, else None."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def _args(model):
    return getattr(model, "args", None) or getattr(getattr(model, "model", None), "args", None)


def _attention(model):
    for layer in getattr(model, "layers", []) or []:
        if layer is None:
            continue
        attn = getattr(layer, "self_attn", getattr(layer, "attention", None))
        if attn is not None:
            return attn
    return None


def topology(model) -> Topology:
    """Read the model's place in a sharded run (a plain :class:`Topology` when not sharded)."""
    inner = getattr(model, "model", None)
    pp_size = int(getattr(inner, "pipeline_size", 1) or 1)
    args = _args(model)
    out = {}
    if pp_size > 1:
        start, end = int(inner.start_idx), int(inner.end_idx)
        total = getattr(args, "num_hidden_layers", None) or getattr(inner, "num_hidden_layers", None)
        out.update(layer_offset=start, n_local=end - start, n_layers=int(total), pp_size=pp_size,
                   pp_rank=int(inner.pipeline_rank))
    group = world()
    attn = _attention(model)
    if group is not None and attn is not None and pp_size == 1:
        kv_local = getattr(attn, "n_kv_heads", None) or getattr(attn, "num_key_value_heads", None)
        kv_total = getattr(args, "num_key_value_heads", None)
        q_local = getattr(attn, "n_heads", None) or getattr(attn, "num_heads", None)
        q_total = getattr(args, "num_attention_heads", None)
        n, r = group.size(), group.rank()
        if kv_local and kv_total and kv_local * n == kv_total:
            out.update(tp_size=n, tp_rank=r, head_offset=r * kv_local, kv_heads=kv_total)
        elif q_local and q_total and q_local * n == q_total:
            # queries split, KV cache the same on every rank (MLA latent cache, or unsplit KV heads)
            out.update(tp_size=n, tp_rank=r, kv_heads=kv_local, kv_replicated=True)
    return Topology(**out)
