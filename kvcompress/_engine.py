"""The method-agnostic engine behind :class:`CompressedKVCache` and :class:`BatchCompressedKVCache`.

Storage is ``[B, H, T, D]`` with a position per slot (``-1``: empty). Rows may hold different
numbers of tokens; the host keeps, per row, the tokens seen (``offset``), the tokens held and
the budget, so no step needs a device sync to know what to do. One step of ``S`` tokens:

1. **Evict (deferred).** A row over budget with its new tokens keeps ``budget - 1`` old ones:
   ``e = n - (budget - 1)`` slots leave (``evict_count(e)`` for chunk selectors), chosen by the
   selector on the scores the previous steps left, folded in by the disposition, and become
   empty. The count does not depend on ``S``, so a step trimmed afterwards is exact.
2. **Store.** A single token goes into an empty slot of its row; a chunk is appended after
   the held slots (empty slots moved to the left first).
3. **Attend.** The mask comes from the slot positions (:func:`kvcompress.ops.visibility`), so it
   is exact for any layout; without empty slots it is plain ``None`` / ``"causal"``.
4. **Observe.** The scorer updates the scores from the step's real queries.
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Optional

import attrs
import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from . import _state, ops
from .contexts import Eviction, LayerInfo, Observation, Selection
from .errors import ConfigError, KVCompressError
from .group import PromptGroup, new_group

_STATE_VERSION = 2
#: steps of at most this many tokens keep their queries so that ``trim`` can undo them exactly
UNDO_TOKENS = 16
_proxy_warned = False


def _ensure_wrapped() -> None:
    from .mlxlm.attention import ensure_wrapped

    ensure_wrapped()


class _Engine(_BaseCache):
    step = 256

    def __init__(self, method, budget, layer=0, group: Optional[PromptGroup] = None, info: Optional[LayerInfo] = None):
        self.method = method
        self.info = info if info is not None else LayerInfo(layer=int(layer))
        self._hooks = method.hooks()
        self._b_default = self._check_budget(budget)
        self.group = group if group is not None else new_group()
        self.group.add(self.info.layer, self)
        self._states = {k: (h["init_state"](self.info) if "init_state" in h else None) for k, h in self._hooks.items()}
        self._wants_mass = "step_mass" in method.scorer.requires
        self._wants_io = "layer_io" in method.budget.requires
        self._needs_queries = "queries" in method.scorer.requires
        # scores that must agree across tensor-parallel ranks: a decision over all heads of the
        # layer ("head_shared"), or KV heads every rank holds while their queries are split (MLA)
        self._head_shared = "head_shared" in method.scorer.provides
        self._reduce = self.info.tp_size > 1 and (self.info.kv_replicated or self._head_shared)
        self._unreduced = False
        self.keys = self.values = self._pos = self._score = None
        self._n = 0  # stored width T
        self._rows_n: list[int] = []  # tokens held per row
        self._rows_off: list[int] = []  # tokens seen per row (RoPE offset of the next step)
        self._rows_budget: list[int] = []
        self._rows_evicted: list[int] = []
        self._rounds = 0
        self._query_steps = self._proxy_steps = 0
        self._pending = None  # (S, valid per row, query positions) of a step not yet observed
        self._undo = None
        self._step_mass = None
        self._attended = None
        self._io_seen = False
        self._io_input = None  # the layer's input during a prompt's first forward
        self._last_valid: list = []
        self._last_slots = None
        self._new_valid: Optional[list] = None  # right-padding bookkeeping (batch prefill)
        self._off_cache: tuple = (None, None)
        self._attn_keys = self._bias = None
        self._pad: Optional[list] = None  # right padding stored per row so far (until finalize)

    def __deepcopy__(self, memo):
        """A copy that continues exactly like the original; copies of a prompt's caches made in
        one ``deepcopy`` share one new group."""
        import copy

        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            new.__dict__[name] = copy.deepcopy(value, memo)
        new.group.add(new.info.layer, new)
        return new

    # ----------------------------------------------------------------------------------------
    # Budget and rows
    # ----------------------------------------------------------------------------------------

    def _check_budget(self, budget) -> int:
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
            raise ConfigError(f"budget of layer {self.info.layer} must be a positive int, got {budget!r}")
        reserved = self.method.selector.reserved(budget)
        if reserved >= budget:
            raise ConfigError(
                f"layer {self.info.layer}: budget {budget} leaves no room to evict: the selector "
                f"always keeps {reserved} tokens (sinks + recent window); use a budget > {reserved} "
                "or fewer protected tokens"
            )
        return budget

    def _ensure_rows(self, b: int) -> None:
        if not self._rows_n:
            self._rows_n, self._rows_off = [0] * b, [0] * b
            self._rows_budget, self._rows_evicted = [self._b_default] * b, [0] * b

    def _set_budgets(self, budgets: list) -> None:
        self._rows_budget = [self._check_budget(int(b)) for b in budgets]

    def _budget_arg(self):
        """The budget components see: one int, or ``[B, 1, 1]`` when rows differ."""
        b = self._rows_budget
        return b[0] if len(set(b)) == 1 else self._arr(b)

    def _holes(self) -> bool:
        return any(n != self._n for n in self._rows_n)

    def _arr(self, values: list) -> mx.array:
        """``[B, 1, 1]`` int32 of per-row host values (a 0-d array when every row agrees)."""
        if len(values) > 1 and values.count(values[0]) != len(values):
            return mx.array(values, dtype=mx.int32).reshape(-1, 1, 1)
        return mx.array(values[0] if values else 0, dtype=mx.int32)

    def _offset(self) -> mx.array:
        """The offsets as an array, built once per value of the host offsets."""
        seen = self._seen()
        key = tuple(seen)
        if self._off_cache[0] != key:
            self._off_cache = (key, self._arr(seen))
        return self._off_cache[1]

    def _qpos(self, S: int) -> mx.array:
        """``[B, 1, S]`` int32 positions of the last step's tokens."""
        if S == 1:
            return (self._offset() - 1).reshape(-1, 1, 1) if len(set(self._rows_off)) > 1 else mx.full(
                (len(self._rows_off), 1, 1), self._rows_off[0] - 1, mx.int32)
        start = mx.array([o - S for o in self._rows_off], dtype=mx.int32).reshape(-1, 1, 1)
        return start + mx.arange(S, dtype=mx.int32).reshape(1, 1, S)

    # ----------------------------------------------------------------------------------------
    # update_and_fetch
    # ----------------------------------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Store a step's post-RoPE ``keys``/``values`` ``[B, H, S, D]``; return all stored."""
        self._check_input(keys, values)
        if self._pending is not None:
            self._unobserved_step()
        if self._unreduced:
            self.group.reduce_scores()
        if self.group.rebudget_pending:
            self.group.rebudget()
        # every update, not only an empty cache's first: a cache loaded (or unpickled) in a fresh
        # process must find the wrapper installed too (a no-op once no new module was imported)
        _ensure_wrapped()
        b, _, S, _ = keys.shape
        self._ensure_rows(b)
        valid = self._take_valid(S)
        need = [
            max(n - (bud - 1), 0) if n + v > bud else 0
            for n, v, bud in zip(self._rows_n, valid, self._rows_budget)
        ]
        freed = self._evict(need) if any(need) else None
        if S == 1 and all(n < self._n for n in self._rows_n) and self._n <= max(self._rows_n) + 1:
            self._write_into_holes(keys, values, freed, valid)
        else:
            if freed is not None:
                self._mark_freed(*freed)
            if self._holes():
                self._compact()
            self._append(keys, values, valid)
        self._rows_off = [o + S for o in self._rows_off]
        if self._pad is not None or any(v < S for v in valid):
            # a right-padded prompt: offsets count the padding until finalize(); components see
            # the tokens each row really has seen
            self._pad = [p + S - v for p, v in zip(self._pad or [0] * len(valid), valid)]
        self._pending = (S, valid, None)
        self._last_valid = valid
        self._undo = None
        v = self.keys_and_values()[1]
        k = self._attended = self._viewed_keys()
        return k, v

    def reduction(self) -> mx.array:
        """This rank's part of the cross-rank score agreement: the scores (one head's row when
        every head shares them)."""
        return self._score[:, :1] if self._head_shared and not self.info.kv_replicated else self._score

    def set_reduced(self, value: mx.array) -> None:
        """The agreed scores (the mean over ranks of :meth:`reduction`)."""
        self._score = mx.broadcast_to(value, self._score.shape) if value.shape != self._score.shape else value
        self._unreduced = False

    def _seen(self) -> list:
        """Tokens each row has really seen (``_rows_off`` without a prompt's right padding)."""
        if self._pad is None:
            return self._rows_off
        return [o - p for o, p in zip(self._rows_off, self._pad)]

    def _viewed_keys(self) -> mx.array:
        k = self.keys_and_values()[0]
        view = self._hooks["disposition"].get("view_keys")
        return k if view is None else view(self._states["disposition"], k, self._pos, self._offset())

    def _take_valid(self, S: int) -> list:
        if self._new_valid is None:
            return [S] * len(self._rows_n)
        out = [min(S, r) for r in self._new_valid]
        self._new_valid = [r - v for r, v in zip(self._new_valid, out)]
        return out

    def keys_and_values(self):
        if self.keys.shape[2] == self._n:
            return self.keys, self.values
        return self.keys[..., : self._n, :], self.values[..., : self._n, :]

    def _evict(self, need: list):
        """Free ``need[b]`` slots (or the selector's whole chunks) per row; returns
        ``(slots [B, H, E], real [B, H, E] or None)``."""
        count = self._hooks["selector"].get("evict_count")
        counts = [int(count(e)) if count and e else e for e in need]
        uniform = len(set(counts)) == 1
        k, v = self.keys_and_values()
        seen = self._seen()
        off, offs, bud = self._offset(), tuple(seen), self._budget_arg()
        sel_c = self.method.selector
        protected = sel_c.protected(self._pos, off, bud)
        if self._holes():
            protected = protected | (self._pos < 0)
        slots = sel_c.select(
            Selection(
                scores=self._score, positions=self._pos, protected=protected, n_evict=max(need),
                budget=bud, offset=off, offsets=offs, layer=self.info,
                row_counts=None if uniform else self._arr(need), state=self._states["selector"],
                group=self.group,
            )
        ).astype(mx.int32)
        real = None if uniform else mx.arange(slots.shape[-1]).reshape(1, 1, -1) < self._arr(counts)
        ev = Eviction(
            keys=k, values=v, scores=self._score, positions=self._pos, evict=slots, protected=protected,
            offset=off, offsets=offs, layer=self.info, counts=tuple(counts), draw_id=self._rounds, real=real,
            state=self._states["disposition"], group=self.group,
        )
        k, v, self._score = self.method.disposition.dispose(ev)
        self._states["disposition"] = ev.state
        self.keys, self.values = k, v
        self._rounds += 1
        self._rows_n = [n - c for n, c in zip(self._rows_n, counts)]
        self._rows_evicted = [t + c for t, c in zip(self._rows_evicted, counts)]
        return (slots, real)

    def _mark_freed(self, slots: mx.array, real) -> None:
        """Freed slots become empty (position -1)."""
        gone = mx.full(slots.shape, -1, mx.int32)
        if real is not None:
            gone = mx.where(real, gone, mx.take_along_axis(self._pos, slots, axis=-1))
        self._pos = mx.put_along_axis(self._pos, slots, gone, axis=-1)

    def _write_into_holes(self, keys, values, freed, valid) -> None:
        b, h = keys.shape[:2]
        if freed is not None and freed[1] is None and freed[0].shape[-1] == 1:
            slot = freed[0]  # the slot each (row, head) just freed: the token goes there
        else:
            if freed is not None:
                self._mark_freed(*freed)
            slot = mx.argmax(self._pos < 0, axis=-1, keepdims=True).astype(mx.int32)
        idx = slot[..., None]
        self.keys = mx.put_along_axis(self.keys, mx.broadcast_to(idx, (b, h, 1, keys.shape[-1])), keys, axis=2)
        self.values = mx.put_along_axis(self.values, mx.broadcast_to(idx, (b, h, 1, values.shape[-1])), values, axis=2)
        pos = self._new_positions(valid, 1, b, h)
        self._pos = mx.put_along_axis(self._pos, slot, pos, axis=-1)
        self._score = mx.put_along_axis(self._score, slot, mx.zeros((b, h, 1), mx.float32), axis=-1)
        self._rows_n = [n + x for n, x in zip(self._rows_n, valid)]
        self._last_slots = slot

    def _new_positions(self, valid: list, S: int, b: int, h: int) -> mx.array:
        """Positions of a step's tokens before the offsets advance (-1 for padding)."""
        if S == 1 and all(x == 1 for x in valid) and min(self._rows_off) >= 0:
            if len(set(self._rows_off)) == 1:
                return mx.full((b, h, 1), self._rows_off[0], mx.int32)
            return mx.broadcast_to(mx.array(self._rows_off, dtype=mx.int32).reshape(-1, 1, 1), (b, h, 1))
        pos = mx.array(self._rows_off, dtype=mx.int32).reshape(-1, 1, 1) + mx.arange(S, dtype=mx.int32).reshape(1, 1, S)
        if any(x < S for x in valid) or any(o < 0 for o in self._rows_off):
            ok = (mx.arange(S).reshape(1, 1, S) < mx.array(valid, dtype=mx.int32).reshape(-1, 1, 1)) & (pos >= 0)
            pos = mx.where(ok, pos, -1)
        return mx.broadcast_to(pos, (b, h, S))

    def _compact(self) -> None:
        """Move empty slots to the left and drop those every row has."""
        t = self._n
        w = max(self._rows_n)
        ar = mx.arange(t, dtype=mx.int32)
        order = mx.argsort(mx.where(self._pos >= 0, ar + t, ar), axis=-1)[..., t - w :]
        k, v = self.keys_and_values()
        self.keys = mx.take_along_axis(k, order[..., None], axis=2)
        self.values = mx.take_along_axis(v, order[..., None], axis=2)
        self._pos = mx.take_along_axis(self._pos, order, axis=-1)
        self._score = mx.take_along_axis(self._score, order, axis=-1)
        self._n = w

    def _append(self, keys, values, valid) -> None:
        b, h, S, dk = keys.shape
        dv = values.shape[3]
        prev = self._n
        if self.keys is None or prev + S > self.keys.shape[2]:
            need = prev + S
            cap = (need + self.step - 1) // self.step * self.step
            top = max(self._rows_budget)
            cap = min(cap, top) if need <= top else need
            new_k = mx.zeros((b, h, cap - prev, dk), keys.dtype)
            new_v = mx.zeros((b, h, cap - prev, dv), values.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
                self._pos = mx.zeros((b, h, 0), mx.int32)
                self._score = mx.zeros((b, h, 0), mx.float32)
            else:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
        self.keys[..., prev : prev + S, :] = keys
        self.values[..., prev : prev + S, :] = values
        self._pos = mx.concatenate([self._pos, self._new_positions(valid, S, b, h)], axis=2)
        self._score = mx.concatenate([self._score, mx.zeros((b, h, S), mx.float32)], axis=2)
        self._n = prev + S
        self._rows_n = [n + x for n, x in zip(self._rows_n, valid)]
        self._last_slots = None

    # ----------------------------------------------------------------------------------------
    # Attention and observation (called by the scaled_dot_product_attention wrapper)
    # ----------------------------------------------------------------------------------------

    def step_mask(self, n: int) -> Any:
        """The mask of the step just stored: None / "causal" without empty slots, else bool."""
        if not self._holes():
            return None if n == 1 else "causal"
        if n == 1:
            return (self._pos >= 0)[:, :, None, :]  # per KV head
        # after compaction every row's empty slots are the same in every head
        return ops.visibility(self._pos[:, :1], self._qpos(n))

    def attend(self, sdpa, queries, keys, values, scale, mask, sinks=None):
        """The layer's attention; ``mask`` (the model's) is replaced by the exact slot mask."""
        n = queries.shape[2]
        own = self.step_mask(n)
        h_q, h = queries.shape[1], keys.shape[1]
        if isinstance(own, mx.array) and own.shape[1] == h and h_q != h:
            own = mx.repeat(own, h_q // h, axis=1)
        # A model's additive mask is part of its attention scores (MLA's RoPE part): keep it,
        # and hide empty slots from it. The keys it attends may be a projection of the stored ones.
        bias = mask if isinstance(mask, mx.array) and mask.dtype != mx.bool_ else None
        self._attn_keys, self._bias = keys, bias
        if bias is not None:
            own = bias if not isinstance(own, mx.array) else mx.where(own, bias, mx.finfo(bias.dtype).min)
        attend = self._hooks["disposition"].get("attend")
        if attend is not None:
            return attend(self._states["disposition"], queries, keys, values, scale, own, sinks, sdpa)
        if n > 1 and sinks is None and self._wants_mass and (self._rounds or self._over_budget()):
            # A compressing chunk: one softmax gives both the output and the scorer's mass.
            _, valid, _ = self._pending
            out, self._step_mass = ops.attention(
                queries, keys, values, scale, self._pos, self._qpos(n),
                query_weight=self._query_weight(valid, n), mass="group", bias=bias,
            )
            return out
        return sdpa(queries, keys, values, cache=None, scale=scale, mask=own, sinks=sinks)

    def _over_budget(self) -> bool:
        return any(o > b for o, b in zip(self._rows_off, self._rows_budget))

    def _query_weight(self, valid: list, n: int):
        if all(x == n for x in valid):
            return None
        return (mx.arange(n).reshape(1, 1, n) < mx.array(valid, dtype=mx.int32).reshape(-1, 1, 1)).astype(mx.float32)

    def observe(self, queries: mx.array, scale: float) -> None:
        """Update scores from the real queries of the step that was just attended."""
        if self._pending is None:
            return
        self._score_step(queries, scale, proxy=False)
        self._query_steps += 1

    def _unobserved_step(self) -> None:
        """The model attended without mlx-lm's attention function: score with key-as-query."""
        global _proxy_warned
        if self._proxy_blocked():
            raise KVCompressError(
                "this model did not call mlx-lm's scaled_dot_product_attention with its cache, so "
                "the cache cannot see the step's queries or mask its empty slots; batched and "
                "padded compressed caches need that path (kvcompress.install(model))"
            )
        if not _proxy_warned:
            warnings.warn(
                "kvcompress: the model did not call mlx-lm's scaled_dot_product_attention with this "
                "cache, so scores use the key-as-query proxy (see cache.score_source). Call "
                "kvcompress.install(model) or use kvcompress.make_prompt_cache(model, ...).",
                RuntimeWarning,
                stacklevel=3,
            )
            _proxy_warned = True
        S = self._pending[0]
        k = self.keys_and_values()[0]
        q = k[..., self._n - S :, :] if self._last_slots is None else mx.take_along_axis(
            k, self._last_slots[..., None], axis=2
        )
        self._score_step(q, q.shape[-1] ** -0.5, proxy=True)
        self._proxy_steps += 1

    def _proxy_blocked(self) -> bool:
        return self._holes()

    def _score_step(self, queries, scale, proxy) -> None:
        S, valid, qpos = self._pending
        if qpos is None:
            qpos = self._qpos(S)
        k = self._attended if self._attended is not None else self._viewed_keys()
        bias = None
        if not proxy and self._attn_keys is not None:  # what the attention really used
            k, bias = self._attn_keys, self._bias
        self._attended = self._attn_keys = self._bias = None
        mass, self._step_mass = self._step_mass, None
        before = (self._score, self._states["scorer"])
        obs = Observation(
            queries=queries, keys=k, positions=self._pos, query_positions=qpos, n_new=S, scale=scale,
            offset=self._offset(), offsets=tuple(self._seen()), layer=self.info,
            n_valid=tuple(valid), query_weight=self._query_weight(valid, S), proxy=proxy,
            all_visible=S == 1 and not self._holes(), bias=bias,
            state=_state.snapshot(self._states["scorer"]), group=self.group,
        )
        if mass is not None and not proxy:
            obs.seed_attention_mass(mass)
        score = self.method.scorer.observe(self._score, obs)
        if score.shape[1] != self._pos.shape[1]:  # attention over per-head projections of shared
            score = score.mean(axis=1, keepdims=True)  # KV (MLA prefill): the group's mean
        self._score = score if score.dtype == mx.float32 else score.astype(mx.float32)
        self._states["scorer"] = obs.state
        self._pending = None
        self._unreduced = self._reduce
        keep_q = S <= UNDO_TOKENS and not proxy
        self._undo = (S, valid, qpos, before, queries if keep_q else None, scale, proxy)

    # ----------------------------------------------------------------------------------------
    # Trimming
    # ----------------------------------------------------------------------------------------

    def is_trimmable(self) -> bool:
        """True: the last step's tokens can always be trimmed exactly (see :meth:`trim`)."""
        return True

    def can_trim(self, n: int) -> bool:
        """Whether :meth:`trim` can remove the last ``n`` tokens exactly."""
        if n <= 0 or self.keys is None:
            return True
        if self._undo is None:
            return False
        S, valid, _, _, queries, _, _ = self._undo
        if n > S or any(x != S for x in valid):
            return False
        return queries is not None or not self._needs_queries or n == S

    def trim(self, n: int) -> int:
        """Remove the last ``n`` tokens exactly, as if they had never been seen.

        Eviction is deferred and its count does not depend on the step's size, so the tokens of
        the last step can leave exactly: their slots are freed, and the scores are those of the
        remaining tokens' queries. Anything older cannot be undone; that raises before anything
        changes.
        """
        if n <= 0 or self.keys is None:
            return 0
        if not self.can_trim(n):
            last = 0 if self._undo is None else self._undo[0]
            raise KVCompressError(
                f"cannot trim {n} token(s) exactly from a compressed cache: only the last step's "
                f"{last} token(s) can be removed (older tokens already shaped evictions and scores)"
            )
        S, valid, qpos, (scores, sstate), queries, scale, proxy = self._undo
        keep = S - n
        if self._last_slots is not None:  # a single token written into a freed slot
            self._pos = mx.put_along_axis(self._pos, self._last_slots, mx.full(self._last_slots.shape, -1, mx.int32), axis=-1)
            self._score = scores
        else:
            self._n -= n
            self._pos = self._pos[..., : self._n]
            self._score = scores[..., : self._n]
        self._rows_n = [x - n for x in self._rows_n]
        self._rows_off = [o - n for o in self._rows_off]
        self._states["scorer"] = sstate
        self._undo = None
        if not keep:  # the whole step leaves: so does its observation
            if proxy:
                self._proxy_steps -= 1
            else:
                self._query_steps -= 1
        if keep:
            self._pending = (keep, [keep] * len(self._rows_n), None)
            self._score_step(queries[:, :, :keep] if queries is not None else None, scale, proxy=False)
        return n

    # ----------------------------------------------------------------------------------------
    # Input checks
    # ----------------------------------------------------------------------------------------

    def _check_input(self, keys, values):
        if not (isinstance(keys, mx.array) and isinstance(values, mx.array)):
            raise TypeError("update_and_fetch expects mx.array keys and values")
        if keys.ndim != 4 or values.ndim != 4:
            raise ValueError(f"keys/values must be [B, H_kv, S, D]; got shapes {keys.shape} and {values.shape}")
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"keys {keys.shape} and values {values.shape} disagree on [B, H_kv, S]")
        if not mx.issubdtype(keys.dtype, mx.floating) or keys.dtype != values.dtype:
            raise TypeError(f"keys/values must share a floating dtype; got {keys.dtype}, {values.dtype}")
        if self._rows_n and keys.shape[0] != len(self._rows_n):
            raise ValueError(f"keys have {keys.shape[0]} rows but the cache holds {len(self._rows_n)}")
        if self.keys is not None:
            if keys.shape[1] != self.keys.shape[1] or keys.shape[3] != self.keys.shape[3] or (
                values.shape[3] != self.values.shape[3]
            ):
                raise ValueError(
                    f"keys {keys.shape} do not match the cache's [B, H_kv, *, D] = "
                    f"{self.keys.shape[:2] + (self.keys.shape[3],)}"
                )
            if keys.dtype != self.keys.dtype:
                raise TypeError(f"keys dtype {keys.dtype} does not match the cache's {self.keys.dtype}")

    # ----------------------------------------------------------------------------------------
    # Layer input/output (budgets that require "layer_io")
    # ----------------------------------------------------------------------------------------

    def wants_layer_io(self) -> bool:
        """Whether the next forward is this prompt's first and the budget wants to see it."""
        return self._wants_io and not self._io_seen and self.keys is None

    def observe_layer_io(self, x: mx.array, out: mx.array) -> None:
        """The layer's input ``x`` and attention output ``out`` ``[B, N, d]`` of the first forward."""
        self._io_seen = True
        n = x.shape[1]
        weight = None
        if any(v != n for v in self._last_valid):
            weight = (mx.arange(n).reshape(1, n) < mx.array(self._last_valid).reshape(-1, 1)).astype(mx.float32)
        self._states["budget"] = self._hooks["budget"]["observe_layer"](self._states["budget"], x, out, weight)
        if "rebudget" in self._hooks["budget"] and all(c._io_seen for c in self.group.caches()):
            if self.info.pp_size > 1:
                self.group.rebudget_pending = True  # agreed across ranks at the next step's start
            else:
                self.group.rebudget()

    # ----------------------------------------------------------------------------------------
    # State (mlx-lm protocol) and diagnostics
    # ----------------------------------------------------------------------------------------

    def _meta(self) -> dict:
        comp, n_arrays, arrays = {}, {}, []
        for kind in ("scorer", "selector", "disposition", "budget"):
            meta, arrs = _state.flatten_state(self._states[kind])
            comp[kind] = meta
            n_arrays[kind] = len(arrs)
            arrays += arrs
        return {
            "version": _STATE_VERSION,
            "config": self.method.config.to_dict(),
            "info": attrs.asdict(self.info),
            "budget": self._b_default,
            "group": self.group.id,
            "n": self._n,
            "rows_n": self._rows_n,
            "rows_off": self._rows_off,
            "rows_budget": self._rows_budget,
            "rows_evicted": self._rows_evicted,
            "rounds": self._rounds,
            "query_steps": self._query_steps,
            "proxy_steps": self._proxy_steps,
            "unreduced": self._unreduced,
            "components": comp,
            "n_component_arrays": n_arrays,
        }, arrays

    @property
    def state(self):
        meta, extra = self._meta()
        text = json.dumps(meta)
        if self.keys is None:
            return [*extra, text]
        k, v = self.keys_and_values()
        return [*extra, k, v, self._pos, self._score, text]

    @state.setter
    def state(self, v):
        *arrays, text = v
        m = json.loads(text)
        if m.get("version") != _STATE_VERSION:
            raise ConfigError(f"unsupported kvcompress cache state version {m.get('version')!r} (expected {_STATE_VERSION})")
        n_extra = sum(m["n_component_arrays"].values())
        extra, arrays = arrays[:n_extra], arrays[n_extra:]
        i = 0
        for kind in ("scorer", "selector", "disposition", "budget"):
            k = m["n_component_arrays"][kind]
            comp = self.method.component(kind)
            self._states[kind] = _state.restore_state(comp, m["components"][kind], extra[i : i + k])
            i += k
        if arrays:
            self.keys, self.values, pos, score = arrays
            self._pos, self._score = pos.astype(mx.int32), score.astype(mx.float32)
        else:
            self.keys = self.values = self._pos = self._score = None
        self._b_default = int(m["budget"])
        self._n = int(m["n"])
        self._rows_n, self._rows_off = list(m["rows_n"]), list(m["rows_off"])
        self._rows_budget, self._rows_evicted = list(m["rows_budget"]), list(m["rows_evicted"])
        self._rounds = int(m["rounds"])
        self._query_steps, self._proxy_steps = int(m["query_steps"]), int(m["proxy_steps"])
        self._unreduced = bool(m.get("unreduced", False)) and self._reduce
        self._pending = self._undo = None

    @property
    def meta_state(self):
        return ""

    @meta_state.setter
    def meta_state(self, v):
        pass  # everything lives in ``state``

    def size(self) -> int:
        return self._n

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        """Bytes of every array the cache holds (key/value buffers, positions, scores, states)."""
        extra = sum(a.nbytes for kind in self._states for a in _state.flatten_state(self._states[kind])[1])
        if self.keys is None:
            return extra
        return self.keys.nbytes + self.values.nbytes + self._pos.nbytes + self._score.nbytes + extra

    @property
    def score_source(self) -> str:
        """``"queries"`` (real queries), ``"proxy"`` (key-as-query), ``"mixed"`` or ``"none"``."""
        if self._proxy_steps and self._query_steps:
            return "mixed"
        if self._proxy_steps:
            return "proxy"
        return "queries" if self._query_steps else "none"

    def _rowwise(self, values: list):
        """A per-row figure as users see it (one value for a single-sequence cache)."""
        raise NotImplementedError

    def full_cache_nbytes(self) -> int:
        """Bytes mlx-lm's ``KVCache`` would hold for the tokens seen (it grows in steps of 256)."""
        if self.keys is None:
            return 0
        _, h, _, dk = self.keys.shape
        dv = self.values.shape[-1]
        per_token = h * (dk * self.keys.dtype.size + dv * self.values.dtype.size)
        step = 256
        return sum(-(-max(o, 0) // step) * step for o in self._rows_off) * per_token

    @property
    def diagnostics(self) -> dict:
        """What the cache did: budget, tokens seen and kept, evictions (per row, per KV head),
        the compression in tokens and in bytes, where scores came from, plus each component's
        own figures (e.g. merges)."""
        kept = self._rows_n or [0]
        seen = self._rows_off or [0]
        held = self.nbytes
        out = {
            "method": self.method.name,
            "layer": self.info.layer,
            "budget": self._rowwise(self._rows_budget or [self._b_default]),
            "offset": self._rowwise(seen),
            "tokens_kept": self._rowwise(kept),
            "compression_tokens": self._rowwise([o / n if n else 1.0 for o, n in zip(seen, kept)]),
            "compression_bytes": self.full_cache_nbytes() / held if held and self.keys is not None else 1.0,
            "evictions": self._rowwise(self._rows_evicted or [0]),
            "score_source": self.score_source,
            "nbytes": held,
        }
        for kind, hooks in self._hooks.items():
            if "diagnostics" in hooks:
                for key, value in hooks["diagnostics"](self._states[kind]).items():
                    out[key] = self._rowwise(value) if isinstance(value, list) else value
        return out

    @property
    def tokens_kept(self):
        """Tokens currently held (per row; every KV head holds the same count)."""
        return self._rowwise(self._rows_n or [0])

    @property
    def evictions(self):
        """Tokens evicted so far (per row, per KV head)."""
        return self._rowwise(self._rows_evicted or [0])
