"""The method-agnostic compressed KV cache, obeying mlx-lm's cache protocol.

Guarantees (each one tested):

* ``offset`` is the number of tokens seen, so RoPE positions stay right after eviction; the
  stored length is :meth:`size`.
* Eviction is deferred: a step's tokens are all attended by that step; compression happens
  at the *next* ``update_and_fetch``, using the scores the previous steps' real queries left.
  Before appending ``S`` tokens the cache keeps at most ``budget - 1`` old ones, so a decode
  step attends exactly ``budget`` tokens and a chunk of ``S`` tokens attends ``budget - 1 + S``
  (the rule of mlx-lm's ``RotatingKVCache``).
* New tokens of a multi-token step are appended after every stored token, so the
  bottom-right aligned ``"causal"`` mask is exact after eviction.
* In decode the freed slot is reused for the incoming token (attention is order-free once RoPE
  is applied); each slot remembers its position. No Python loop runs per head or per token.
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from ._attention_math import attention_with_mass
from .components import Eviction, Observation, Selection
from .errors import ConfigError

__all__ = ["CompressedKVCache"]

_STATE_VERSION = 1
#: dispositions that never merge may return this to skip the merge counter
_NO_MERGES = None
_proxy_warned = False


def _fit_mask(mask: Any, t: int) -> Any:
    """An array mask sized for another layer, re-fitted to this layer's ``t`` attended slots.

    Some mlx-lm models build one array mask per forward from layer 0's cache and pass it to
    every layer; with per-layer budgets the layers store different numbers of slots. In every
    layer the step's tokens are the last columns and all older slots are visible to all of the
    step's queries, so the mask is aligned bottom-right: extra leading columns are cropped,
    missing ones are added as visible (True / 0).
    """
    if not isinstance(mask, mx.array) or mask.shape[-1] == t:
        return mask
    tm = mask.shape[-1]
    if tm > t:
        return mask[..., tm - t :]
    shape = mask.shape[:-1] + (t - tm,)
    fill = mx.ones(shape, mx.bool_) if mask.dtype == mx.bool_ else mx.zeros(shape, mask.dtype)
    return mx.concatenate([fill, mask], axis=-1)


class CompressedKVCache(_BaseCache):
    """A bounded KV cache for one attention layer, driven by a :class:`~kvcompress.Method`.

    Args:
        method: the composition (scorer, selector, disposition, budget).
        budget: tokens kept for this layer (the decode attention span).
        layer: the layer index (seeds draws, labels diagnostics).
    """

    step = 256

    def __init__(self, method, budget: int, layer: int = 0, shared: Optional[dict] = None):
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise ConfigError(f"budget of layer {layer} must be a positive int, got {budget!r}")
        reserved = method.selector.reserved(budget)
        if reserved >= budget:
            raise ConfigError(
                f"layer {layer}: budget {budget} leaves no room to evict: the selector always keeps "
                f"{reserved} tokens (sinks + recent window); use a budget > {reserved} or fewer "
                "protected tokens"
            )
        self.method = method
        self.budget = budget
        self.layer = layer
        self.shared = {} if shared is None else shared
        self._step_mass = None  # attention mass computed together with a chunk's attention
        init = getattr(method.disposition, "init_state", None)
        self.disposition_state = init() if init is not None else None
        # Optional disposition hook: the keys a step attends (and scorers observe) may be a view
        # of the stored ones, e.g. re-rotated to contiguous positions; storage is unchanged.
        self._view_keys = getattr(method.disposition, "view_keys", None)
        self._attended = None
        self.keys = None
        self.values = None
        self._pos = None  # [B, H, n] int32 position of each slot
        self._score = None  # [B, H, n] float32 scorer state
        self.offset = 0
        self._n = 0
        self._pending = None  # new keys of the last step, until its queries are observed
        self._rounds = 0
        self._evicted = 0
        self._merges = mx.array(0, dtype=mx.int32)
        self._query_steps = 0
        self._proxy_steps = 0

    # ----------------------------------------------------------------------------------------
    # mlx-lm protocol
    # ----------------------------------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store a step's post-RoPE ``keys``/``values`` ``[B, H_kv, S, D]``; return all stored."""
        self._check_input(keys, values)
        if self._pending is not None:
            self._observe_proxy()
        S = keys.shape[2]
        n_evict = self._n_evict(S)
        if n_evict > 0:
            k, v, scores, evict = self._select(n_evict)
            if S == 1 and evict.shape[-1] == 1:
                self._write_into_slot(k, v, scores, evict, keys, values)
            else:
                self._compact(k, v, scores, evict)
                self._append(keys, values)
        else:
            self._append(keys, values)
        self._pending = keys
        self.offset += S
        k, v = self.keys_and_values()
        if self._view_keys is not None:
            k = self._attended = self._view_keys(self.disposition_state, k, self._pos, self.offset)
        return k, v

    def keys_and_values(self):
        if self.keys.shape[2] == self._n:
            return self.keys, self.values
        return self.keys[..., : self._n, :], self.values[..., : self._n, :]

    def size(self) -> int:
        return self._n

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes of every array the cache holds (key/value buffers, positions, scores)."""
        extra = sum(a.nbytes for a in self._disposition_arrays())
        if self.keys is None:
            return extra
        return self.keys.nbytes + self.values.nbytes + self._pos.nbytes + self._score.nbytes + extra

    def _disposition_arrays(self) -> list:
        fn = getattr(self.method.disposition, "state_arrays", None)
        return list(fn(self.disposition_state)) if fn is not None else []

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        """Mask for the next step of ``N`` tokens, for the layout after that step's eviction."""
        if window_size is not None:
            if self._evicted:
                raise NotImplementedError(
                    "kvcompress caches do not support sliding-window attention layers after "
                    "eviction; compress only the full-attention layers of this model"
                )
            return create_causal_mask(N, self.offset, window_size=window_size)
        if N == 1:
            return None
        if not return_array:
            return "causal"
        t = self._n - self._evict_count(N) + N
        q = mx.arange(t - N, t)[:, None]
        return q >= mx.arange(t)[None]

    def is_trimmable(self) -> bool:
        """Trimming is exact only while nothing has been evicted."""
        return self._evicted == 0

    def trim(self, n: int) -> int:
        if not self.is_trimmable():
            return 0
        n = min(self._n, n)
        self._n -= n
        self.offset -= n
        if self.keys is not None:
            self._pos = self._pos[..., : self._n]
            self._score = self._score[..., : self._n]
        self._pending = None
        return n

    @property
    def state(self):
        meta = json.dumps(self._meta())
        extra = self._disposition_arrays()
        if self.keys is None:
            return [*extra, meta]
        k, v = self.keys_and_values()
        return [*extra, k, v, self._pos, self._score, meta]

    @state.setter
    def state(self, v):
        *arrays, meta = v
        m = json.loads(meta)
        if m.get("version") != _STATE_VERSION:
            raise ConfigError(f"unsupported kvcompress cache state version {m.get('version')!r}")
        n_extra = int(m.get("n_extra", 0))
        extra, arrays = arrays[:n_extra], arrays[n_extra:]
        restore = getattr(self.method.disposition, "restore_state", None)
        if restore is not None:
            self.disposition_state = restore(extra)
        if arrays:
            self.keys, self.values, self._pos, self._score = arrays
            self._pos = self._pos.astype(mx.int32)
            self._score = self._score.astype(mx.float32)
        else:
            self.keys = self.values = self._pos = self._score = None
        self.offset, self._n = int(m["offset"]), int(m["n"])
        self._rounds, self._evicted = int(m["rounds"]), int(m["evicted"])
        self._merges = mx.array(int(m["merges"]), dtype=mx.int32)
        self._query_steps, self._proxy_steps = int(m["query_steps"]), int(m["proxy_steps"])
        self._pending = None

    @property
    def meta_state(self):
        return (json.dumps(self._meta()),)

    @meta_state.setter
    def meta_state(self, v):
        pass  # everything lives in ``state`` (mlx-lm >= 0.30 saves only ``state``)

    @classmethod
    def from_state(cls, state, meta_state=None, registry=None):
        """Rebuild a cache saved with ``save_prompt_cache`` (see :func:`kvcompress.load_prompt_cache`)."""
        from .method import build_method

        m = json.loads(state[-1])
        method = build_method(m["config"], registry=registry)
        obj = cls(method, int(m["budget"]), int(m["layer"]))
        obj.state = state
        return obj

    def _meta(self) -> dict:
        return {
            "version": _STATE_VERSION,
            "config": self.method.config.to_dict(),
            "budget": self.budget,
            "layer": self.layer,
            "offset": self.offset,
            "n": self._n,
            "rounds": self._rounds,
            "evicted": self._evicted,
            "merges": int(self._merges.item()),
            "query_steps": self._query_steps,
            "proxy_steps": self._proxy_steps,
            "n_extra": len(self._disposition_arrays()),
        }

    # ----------------------------------------------------------------------------------------
    # Attention and observation (called by the scaled_dot_product_attention wrapper)
    # ----------------------------------------------------------------------------------------

    def attend(self, sdpa, queries, keys, values, scale, mask, sinks=None):
        """The layer's attention: mlx-lm's ``sdpa`` unless the disposition keeps more tokens."""
        mask = _fit_mask(mask, keys.shape[2])
        attend = getattr(self.method.disposition, "attend", None)
        if attend is not None:
            return attend(self.disposition_state, queries, keys, values, scale, mask, sinks, sdpa)
        if (
            queries.shape[2] > 1
            and sinks is None
            and self.offset > self.budget
            and "queries" in self.method.scorer.requires
        ):
            # A compressing prefill chunk: one softmax gives both the output and the scores.
            out, self._step_mass = attention_with_mass(queries, keys, values, scale, mask)
            return out
        return sdpa(queries, keys, values, cache=self, scale=scale, mask=mask, sinks=sinks)

    def observe(self, queries: mx.array, scale: float, mask: Any) -> None:
        """Update scores from the real queries of the step that was just attended."""
        if self._pending is None:
            return
        self._score_step(queries, scale, _fit_mask(mask, self._n), proxy=False)
        self._query_steps += 1

    def _observe_proxy(self) -> None:
        global _proxy_warned
        if not _proxy_warned:
            warnings.warn(
                "kvcompress: the model did not call mlx-lm's scaled_dot_product_attention with this "
                "cache, so scores use the key-as-query proxy (see cache.score_source). Call "
                "kvcompress.install(model) or use kvcompress.make_prompt_cache(model, ...).",
                RuntimeWarning,
                stacklevel=3,
            )
            _proxy_warned = True
        q = self._pending
        mask = "causal" if q.shape[2] > 1 else None
        self._score_step(q, q.shape[-1] ** -0.5, mask, proxy=True)
        self._proxy_steps += 1

    def _score_step(self, queries, scale, mask, proxy):
        k = self._attended if self._attended is not None else self.keys_and_values()[0]
        self._attended = None
        mass, self._step_mass = self._step_mass, None
        obs = Observation(
            queries=queries,
            keys=k,
            positions=self._pos,
            n_new=self._pending.shape[2],
            scale=scale,
            mask=mask,
            layer=self.layer,
            offset=self.offset,
            proxy=proxy,
            shared=self.shared,
        )
        if mass is not None and not proxy:
            obs.seed_attention_mass(mass)
        self._score = self.method.scorer.observe(self._score, obs).astype(mx.float32)
        self._pending = None

    # ----------------------------------------------------------------------------------------
    # Internals
    # ----------------------------------------------------------------------------------------

    def _check_input(self, keys, values):
        if not (isinstance(keys, mx.array) and isinstance(values, mx.array)):
            raise TypeError("update_and_fetch expects mx.array keys and values")
        if keys.ndim != 4 or values.ndim != 4:
            raise ValueError(
                f"keys/values must be [B, H_kv, S, D]; got shapes {keys.shape} and {values.shape}"
            )
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"keys {keys.shape} and values {values.shape} disagree on [B, H_kv, S]")
        if not mx.issubdtype(keys.dtype, mx.floating) or keys.dtype != values.dtype:
            raise TypeError(f"keys/values must share a floating dtype; got {keys.dtype}, {values.dtype}")
        if self.keys is not None:
            if keys.shape[:2] != self.keys.shape[:2] or keys.shape[3] != self.keys.shape[3] or (
                values.shape[3] != self.values.shape[3]
            ):
                raise ValueError(
                    f"keys {keys.shape} do not match the cache's [B, H_kv, *, D] = "
                    f"{self.keys.shape[:2] + (self.keys.shape[3],)}"
                )
            if keys.dtype != self.keys.dtype:
                raise TypeError(f"keys dtype {keys.dtype} does not match the cache's {self.keys.dtype}")

    def _n_evict(self, S: int) -> int:
        if self._n + S <= self.budget:
            return 0
        return max(self._n - (self.budget - 1), 0)

    def _evict_count(self, S: int) -> int:
        """Slots the next ``S``-token update will free (a selector may free more than needed)."""
        n = self._n_evict(S)
        count = getattr(self.method.selector, "evict_count", None)
        return int(count(n)) if count is not None and n > 0 else n

    def _select(self, n_evict: int):
        k, v = self.keys_and_values()
        sel = self.method.selector
        protected = sel.protected(self._pos, self.offset, self.budget)
        evict = sel.select(
            Selection(
                self._score, self._pos, n_evict, self.budget, self.offset, self.layer, self.shared, protected
            )
        ).astype(mx.int32)
        ev = Eviction(
            k, v, self._score, self._pos, evict, protected, self.layer, self._rounds,
            self.disposition_state, self.shared, self.offset,
        )
        k, v, scores, merged = self.method.disposition.dispose(ev)
        self._rounds += 1
        self._evicted += evict.shape[-1]
        if merged is not _NO_MERGES:
            self._merges = self._merges + merged
            if self._rounds % 128 == 0:  # keep the lazy counter's graph from growing unbounded
                mx.async_eval(self._merges)
        return k, v, scores, evict

    def _write_into_slot(self, k, v, scores, evict, keys, values):
        idx = evict[..., None]  # evict: [B, H, 1]
        b, h = keys.shape[:2]
        self.keys = mx.put_along_axis(k, mx.broadcast_to(idx, (b, h, 1, k.shape[-1])), keys, axis=2)
        self.values = mx.put_along_axis(
            v, mx.broadcast_to(idx, (b, h, 1, v.shape[-1])), values, axis=2
        )
        pos = mx.full((b, h, 1), self.offset, dtype=mx.int32)
        self._pos = mx.put_along_axis(self._pos, evict, pos, axis=2)
        self._score = mx.put_along_axis(scores, evict, mx.zeros((b, h, 1), mx.float32), axis=2)

    def _compact(self, k, v, scores, evict):
        n, n_evict = self._n, evict.shape[-1]
        flag = mx.put_along_axis(
            mx.zeros(self._pos.shape, mx.int32), evict, mx.ones(evict.shape, mx.int32), axis=2
        )
        order = mx.argsort(flag * n + mx.arange(n, dtype=mx.int32), axis=-1)[..., : n - n_evict]
        self.keys = mx.take_along_axis(k, order[..., None], axis=2)
        self.values = mx.take_along_axis(v, order[..., None], axis=2)
        self._pos = mx.take_along_axis(self._pos, order, axis=2)
        self._score = mx.take_along_axis(scores, order, axis=2)
        self._n = n - n_evict

    def _append(self, keys, values):
        b, h, S, dk = keys.shape
        dv = values.shape[3]
        prev = self._n
        if self.keys is None or prev + S > self.keys.shape[2]:
            # grow in steps (like KVCache), but never past what this layer can hold
            need = prev + S
            cap = (need + self.step - 1) // self.step * self.step
            cap = min(cap, self.budget) if need <= self.budget else need
            grow = cap - prev
            new_k = mx.zeros((b, h, grow, dk), keys.dtype)
            new_v = mx.zeros((b, h, grow, dv), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
                self._pos = mx.zeros((b, h, 0), mx.int32)
                self._score = mx.zeros((b, h, 0), mx.float32)
            else:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
        self.keys[..., prev : prev + S, :] = keys
        self.values[..., prev : prev + S, :] = values
        pos = mx.broadcast_to(mx.arange(self.offset, self.offset + S, dtype=mx.int32), (b, h, S))
        self._pos = mx.concatenate([self._pos, pos], axis=2)
        self._score = mx.concatenate([self._score, mx.zeros((b, h, S), mx.float32)], axis=2)
        self._n = prev + S

    # ----------------------------------------------------------------------------------------
    # Diagnostics
    # ----------------------------------------------------------------------------------------

    @property
    def tokens_kept(self) -> int:
        """Tokens currently stored (per head; every head keeps the same count)."""
        return self._n

    @property
    def compression_ratio(self) -> float:
        """Full-cache K/V bytes for ``offset`` tokens over the K/V bytes kept (> 1 = savings)."""
        return self.offset / self._n if self._n else 1.0

    @property
    def evictions(self) -> int:
        """Tokens evicted so far (per head)."""
        return self._evicted

    @property
    def merges(self) -> int:
        """Evicted tokens merged into survivors (summed over batch and heads)."""
        return int(self._merges.item())

    @property
    def merge_mode(self) -> Optional[str]:
        return getattr(self.method.disposition, "merge", None)

    @property
    def merge_gate(self) -> Optional[bool]:
        return getattr(self.method.disposition, "merge_gate", None)

    @property
    def score_source(self) -> str:
        """``"queries"`` (real queries), ``"proxy"`` (key-as-query), ``"mixed"`` or ``"none"``."""
        if self._proxy_steps and self._query_steps:
            return "mixed"
        if self._proxy_steps:
            return "proxy"
        return "queries" if self._query_steps else "none"

    @property
    def diagnostics(self) -> dict:
        return {
            "method": self.method.name,
            "layer": self.layer,
            "budget": self.budget,
            "offset": self.offset,
            "tokens_kept": self.tokens_kept,
            "compression_ratio": self.compression_ratio,
            "evictions": self.evictions,
            "merges": self.merges,
            "merge_mode": self.merge_mode,
            "merge_gate": self.merge_gate,
            "score_source": self.score_source,
            "nbytes": self.nbytes,
        }

    def __repr__(self) -> str:
        return (
            f"CompressedKVCache(method={self.method.name!r}, layer={self.layer}, "
            f"budget={self.budget}, offset={self.offset}, kept={self._n})"
        )
