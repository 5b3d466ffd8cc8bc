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

import json
from typing import Optional

import attrs
import mlx.core as mx

from ..errors import ConfigError

__all__ = ["Topology", "topology", "world", "STATS", "record", "agree"]

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
        for what, local, total in (("KV heads", kv_local, kv_total), ("attention heads", q_local, q_total)):
            if local and total and local < total and local * n != total:  # split, but not evenly
                raise ConfigError(
                    f"the model's {total} {what} do not divide by the {n} ranks of its tensor-parallel "
                    f"sharding ({local} per rank), so its attention cannot be computed: launch a number of "
                    f"ranks that divides {total}, or split the layers instead (pipeline parallelism)"
                )
        if kv_local and kv_total and kv_local * n == kv_total:
            out.update(tp_size=n, tp_rank=r, head_offset=r * kv_local, kv_heads=kv_total)
        elif q_local and q_total and q_local * n == q_total:
            # queries split, KV cache the same on every rank (MLA latent cache, or unsplit KV heads)
            out.update(tp_size=n, tp_rank=r, kv_heads=kv_local, kv_replicated=True)
    return Topology(**out)


#: bytes each rank sends in :func:`agree` (a JSON summary and, when its build failed, the error)
_AGREE_BYTES = 4096


def agree(summary: str, digest: str, error: Optional[str], action: str = "built") -> None:
    """Agree a cache build across the ranks with one ``all_gather`` of a few KB: each rank sends
    a digest of what it built (method config, global budgets, layer count, parallelism), a short
    summary, and its build error if it refused. Every rank then raises the same
    :class:`~kvcompress.ConfigError` if any rank refused (naming the rank and its reason) or the
    digests differ (naming what each rank built), instead of one rank dying with a ring error or
    the ranks hanging in a later step's collective. ``action`` says what the ranks did (built,
    loaded). No-op in a single process."""
    group = world()
    if group is None:
        return
    import numpy as np

    mine = {"summary": summary[:500], "digest": digest, "error": None if error is None else error[:3000]}
    data = json.dumps(mine).encode()[:_AGREE_BYTES]
    buf = np.zeros(_AGREE_BYTES, np.uint8)
    buf[: len(data)] = np.frombuffer(data, np.uint8)
    send = mx.array(buf)
    record(send)
    got = np.array(mx.distributed.all_gather(send, group=group, stream=mx.cpu)).reshape(group.size(), -1)
    ranks = []
    for row in got:
        try:
            ranks.append(json.loads(bytes(row).rstrip(b"\0").decode()))
        except ValueError:  # a message cut at the payload size
            ranks.append({"summary": "?", "digest": "?", "error": "its build failed (message too long to show)"})
    n = group.size()
    failed = [(r, x["error"]) for r, x in enumerate(ranks) if x.get("error")]
    if failed:
        r, why = failed[0]
        if len(failed) == n and all(w == why for _, w in failed):
            raise ConfigError(why)  # every rank refused alike: the reason itself
        raise ConfigError(f"rank {r} of {n} refused the cache: {why}")
    if len({x["digest"] for x in ranks}) > 1:
        built = "; ".join(f"rank {r}: {x['summary']}" for r, x in enumerate(ranks))
        raise ConfigError(
            f"the {n} ranks {action} different caches ({built}); every rank must use the same method, "
            "parameters and budgets (they would hang or keep different tokens)"
        )

