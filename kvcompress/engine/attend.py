"""The engine's attention and observation: the exact slot mask, the fused attention-with-mass of
a compressing chunk, the scorer's update from the step's real queries (or the key-as-query
proxy), the cross-rank score agreement and the layer input/output service."""

from __future__ import annotations

import warnings
from typing import Any

import mlx.core as mx

from .. import _state, ops
from ..contexts import Observation
from ..errors import KVCompressError
from ..storage import QuantizedSlots, as_float
from .heads import PAD, attend_columns, attend_owned, head_columns
from .slots import OWNER_SHIFT

#: steps of at most this many tokens keep their queries so that ``trim`` can undo them exactly
UNDO_TOKENS = 16
_proxy_warned = False


class _AttendMixin:
    def step_mask(self, n: int) -> Any:
        """The mask of the step just stored: None / "causal" without empty slots, else bool."""
        if not self._slots.holes(self._rows.held):
            return None if n == 1 else "causal"
        if n == 1:
            return (self._slots.pos >= 0)[:, :, None, :]  # per KV head
        # after compaction every row's empty slots are the same in every head
        return ops.visibility(self._slots.pos[:, :1], self._qpos(n))

    def attend(self, sdpa, queries, keys, values, scale, mask, sinks=None):
        """The layer's attention; ``mask`` (the model's) is replaced by the exact slot mask."""
        n = queries.shape[2]
        if self._store.quantized:  # low-bit slots: kvcompress's attention reads the codes
            sdpa = _low_bit_sdpa
        if self._slots.g > 1:
            return self._attend_groups(sdpa, queries, keys, values, scale, mask, sinks)
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
        attend = self._hooks.disposition.attend
        if attend is not None:
            return attend(self._states["disposition"], queries, keys, values, scale, own, sinks, sdpa)
        mass = self._mass_wanted(n)
        plain = n == 1 and own is None  # one query seeing every slot: no mask at all
        if sinks is None and (mass or _grouped_attention_faster()) and (self._rounds or self._rows.over_budget()):
            # Once tokens leave: a compressing step (a chunk, or a decode step) whose scorer reads
            # the mass gets it from the step's own softmax; on a CPU every step attends with the
            # grouped products anyway (they read each key once per GQA group, where MLX's CPU
            # attention repeats the keys for every query head: ~1.7x the time of a decode step at
            # 2k slots, 3:1; a prompt chunk's softmax runs in the CPU kernels: ~2.7x). Below
            # budget the cache attends exactly as mlx-lm's KVCache does (its fused attention, in
            # the cache's dtype).
            _, valid, _ = self._pending
            out, self._step_mass = ops.attention(
                queries, keys, values, scale, None if plain else self._slots.pos, None if plain else self._qpos(n),
                query_weight=self._query_weight(valid, n), mass="group" if mass else None, bias=bias,
            )
            return out
        return sdpa(queries, keys, values, cache=None, scale=scale, mask=own, sinks=sinks)

    def _attend_groups(self, sdpa, queries, keys, values, scale, mask, sinks):
        """Head groups: each query head attends its own KV head's slots of the row."""
        n, g = queries.shape[2], self._slots.g
        bias = mask if isinstance(mask, mx.array) and mask.dtype != mx.bool_ else None
        self._attn_keys, self._bias = keys, bias
        if not any(self._rows.evicted) and not self._slots.holes(self._rows.held) and not (
            n > 1 and self._wants_mass and self._rows.over_budget()
        ):
            # nothing evicted yet: every head holds the same tokens in slot order, so un-interleave
            # the row and attend exactly as mlx-lm's KVCache does
            b, r, t, _ = keys.shape

            def split_one(a):
                return a.reshape(b, r, t // g, g, -1).transpose(0, 1, 3, 2, 4).reshape(b, r * g, t // g, -1)

            def split(a):
                return a.map(split_one) if isinstance(a, QuantizedSlots) else split_one(a)

            own = None if n == 1 else "causal"
            if bias is not None:
                own = bias
            return sdpa(queries, split(keys), split(values), cache=None, scale=scale, mask=own, sinks=sinks)
        _, valid, _ = self._pending
        plain = bias is None and isinstance(keys, mx.array) and isinstance(values, mx.array)
        if plain and n == 1 and sinks is None and valid == [1] * len(valid):  # a decode step: each head's columns
            return self._attend_columns(queries, keys, values, scale)
        pos, owner = self._slots.positions_and_owner()
        if n > UNDO_TOKENS and plain:  # a prompt chunk: each head's slots gathered
            return self._attend_heads(queries, keys, values, scale, pos, valid, sinks)
        # else (a short step, e.g. a draft to verify, whose gather's host read would cost more than
        # it saves; sinks, a model's additive mask, low-bit slots, padding queries): the exact
        # slot and owner mask in kvcompress's attention (its grouped products beat mlx's masked
        # CPU fallback, which broadcasts the keys over each group's query heads)
        out, mass = ops.attention(
            queries, keys, values, scale, pos, self._qpos(n), query_weight=self._query_weight(valid, n),
            mass="group" if self._mass_wanted(n) else None, bias=bias, sinks=sinks, owner=owner, heads_per_row=g,
        )
        self._step_mass = mass
        return out

    def _attend_heads(self, queries, keys, values, scale, pos, valid, sinks):
        """A chunk over head-group rows: each KV head's own slots gathered out of its row
        (:meth:`Slots.head_slots`, ``[B, H_kv, W, D]``) and attended as uniform GQA heads under
        the slot mask -- ``1 / g`` of the masked row's work -- the mass put back on the slots."""
        n = queries.shape[2]
        slot, ok = self._slots.head_slots()
        b, r, g, w = ok.shape
        t = pos.shape[-1]
        kc, vc = (mx.take_along_axis(a, slot[..., None], axis=2).reshape(b, r * g, w, -1) for a in (keys, values))
        pc = mx.where(ok, mx.take_along_axis(pos, slot, axis=-1).reshape(b, r, g, w), -1).reshape(b, r * g, w)
        out, mass = ops.attention(
            queries, kc, vc, scale, pc, self._qpos(n), query_weight=self._query_weight(valid, n),
            mass="group" if self._mass_wanted(n) else None, sinks=sinks,
        )
        if mass is not None:  # [B, H_kv, W] -> the row's slots (padding onto a dropped column: PAD wraps)
            dest = mx.where(ok, slot.reshape(b, r, g, w), PAD).reshape(b, r, g * w)
            mass = mx.put_along_axis(mx.zeros((b, r, t + 1), mx.float32), dest, mass.reshape(b, r, g * w), axis=-1)
            mass = mass[..., :t]
        self._step_mass = mass
        return out

    def _attend_columns(self, queries, keys, values, scale):
        """A decode step over head-group rows: each query head's softmax over its own KV head's
        slots only (heads.py: the CPU kernels' owner softmax over the row, else the column lists,
        the weights put back on the row), for the values and the mass."""
        slots = self._slots
        owned = attend_owned(queries, keys, values, scale, slots.pos, OWNER_SHIFT, slots.g, self._mass_wanted(1))
        if owned is None:
            owned = attend_columns(queries, keys, values, scale, head_columns(slots), self._mass_wanted(1))
        out, self._step_mass = owned
        return out

    def _mass_wanted(self, n: int) -> bool:
        """Whether a step of ``n`` queries computes the scorer's mass with its attention: every
        step for ``step_mass``, one-token steps for ``last_mass``."""
        return self._wants_mass or (n == 1 and self._wants_last_mass)

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

    def step_arrays(self) -> list:
        """What the last step updated lazily: scores, positions, the scorer's state arrays. The
        attention wrapper makes the layer's output depend on them. mlx-lm's decode evaluates only
        the model's output, and below budget nothing in it reads these, so without the tie their
        graph would grow every step, holding each step's keys (memory growing with every token)."""
        if self._slots.score is None:
            return []
        return [self._slots.score, self._slots.pos, *_state.held_arrays(self._states["scorer"]), *self._plan.arrays(),
                *self._slots.derived_arrays()]

    def _unobserved_step(self) -> None:
        """The model attended without mlx-lm's attention function: score with key-as-query."""
        global _proxy_warned
        if self._query_steps:
            raise KVCompressError(
                f"layer {self.info.layer}: this cache scored with the model's real queries so far, but the "
                "model's last step did not call mlx-lm's scaled_dot_product_attention with it, so it would "
                "continue with the key-as-query proxy (a different eviction than the uninterrupted run): "
                "call kvcompress.install(model) before using the cache with this model"
            )
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
        if self._store.quantized:
            raise KVCompressError(
                f"layer {self.info.layer}: this model did not call mlx-lm's scaled_dot_product_attention with "
                "its cache, so nothing could attend the low-bit slots (kv_bits); call kvcompress.install(model), "
                "or use float storage with this model"
            )
        S = self._pending[0]
        k = self.keys_and_values()[0]
        q = k[..., self._slots.n - S :, :] if self._slots.last is None else mx.take_along_axis(
            k, self._slots.last[..., None], axis=2
        )
        self._score_step(q, q.shape[-1] ** -0.5, proxy=True)
        self._proxy_steps += 1

    def _proxy_blocked(self) -> bool:
        return self.BATCHED or self._slots.holes(self._rows.held) or self._slots.g > 1

    def _score_step(self, queries, scale, proxy) -> None:
        S, valid, qpos = self._pending
        if qpos is None:
            qpos = self._qpos(S)
        k = self._attended if self._attended is not None else self._viewed_keys()
        bias = None
        if not proxy and self._attn_keys is not None:  # what the attention really used
            k, bias = self._attn_keys, self._bias
        k = as_float(k)
        self._attended = self._attn_keys = self._bias = None
        mass, self._step_mass = self._step_mass, None
        before = (self._slots.score, self._states["scorer"])
        pos, owner = self._slots.positions_and_owner()
        # a key the step attends differs from the stored one only if rotated (view_keys)
        written = None if proxy or self._hooks.disposition.view_keys is not None else \
            self._slots.written_slots("observed")
        obs = Observation(
            queries=queries, keys=k, positions=pos, query_positions=qpos, n_new=S, scale=scale,
            offset=self._offset(), offsets=tuple(self._rows.seen()), layer=self.info,
            n_valid=tuple(valid), query_weight=self._query_weight(valid, S), proxy=proxy,
            all_visible=S == 1 and not self._slots.holes(self._rows.held) and self._slots.g == 1, bias=bias, values=self._slots.float_kv()[1],
            state=_state.snapshot(self._states["scorer"]), tokens=self._step_tokens, group=self.group,
            owner=owner, heads_per_row=self._slots.g, written=written,
        )
        if mass is not None and not proxy:
            obs.seed_attention_mass(mass)
        score = self.method.scorer.observe(self._slots.score, obs)
        if score.shape[1] != self._slots.pos.shape[1]:  # attention over per-head projections of shared
            score = score.mean(axis=1, keepdims=True)  # KV (MLA prefill): the group's mean
        self._slots.score = score if score.dtype == mx.float32 else score.astype(mx.float32)
        self._states["scorer"] = obs.state
        self._slots.observed = (self._slots.keys, [])
        self._pending = None
        self._unreduced = self._reduce
        keep_q = S <= UNDO_TOKENS and not proxy
        self._undo = (S, valid, qpos, before, queries if keep_q else None, scale, proxy)
        self._undo_tokens, self._step_tokens = self._step_tokens, None
        self._undo_predictions = None
        if not proxy and not self._wants_predictions:  # else planned once the predictions are in
            self._plan_next()

    def observe_predictions(self, predictions) -> None:
        """The model's :class:`~kvcompress.Predictions` over the call this layer just stepped
        in (scorers that require ``predictions``): the scorer's ``observe_predictions`` hook
        rescores before the next step can evict. Kept, for a short step, so that ``trim`` can
        re-observe what stays."""
        if self._pending is not None:  # a model whose attention bypassed the wrapper
            self._unobserved_step()
        S, valid, qpos, _, _, scale, _ = self._undo
        obs = Observation(
            queries=None, keys=self._slots.float_kv()[0], positions=self._slots.positions(),
            query_positions=self._qpos(S) if qpos is None else qpos, n_new=S, scale=scale,
            offset=self._offset(), offsets=tuple(self._rows.seen()), layer=self.info, n_valid=tuple(valid),
            state=_state.snapshot(self._states["scorer"]), tokens=self._undo_tokens,
            predictions=predictions, group=self.group, owner=self._slots.owner(), heads_per_row=self._slots.g,
        )
        score = self._hooks.scorer.observe_predictions(self._slots.score, obs)
        self._slots.score = score if score.dtype == mx.float32 else score.astype(mx.float32)
        self._states["scorer"] = obs.state
        # False: observed, but too long a step to keep (trim may then only remove all of it)
        self._undo_predictions = predictions if predictions.steps is not None else False
        if not self._undo[-1]:
            self._plan_next()  # the next eviction, planned on the scores these predictions made

    def set_slot_scores(self, scores: mx.array) -> None:
        """Replace every slot's running score (``[B, H_kv / g, T]``, as ``slot_scores`` reads
        them): oracle and ablation studies steer the next eviction this way."""
        now = self._slots.score
        if now is None or tuple(scores.shape) != tuple(now.shape):
            raise ValueError(f"scores must have the slots' shape {None if now is None else now.shape}, "
                             f"got {scores.shape}")
        self._slots.score = scores.astype(mx.float32)

    @property
    def awaits_reduction(self) -> bool:
        """Whether this cache's last scores still wait for the cross-rank agreement."""
        return self._unreduced

    def reduction(self) -> mx.array:
        """This rank's part of the cross-rank score agreement: the scores (one head's row when
        every head shares them)."""
        return self._slots.score[:, :1] if self._head_shared and not self.info.kv_replicated else self._slots.score

    def set_reduced(self, value: mx.array) -> None:
        """The agreed scores (the mean over ranks of :meth:`reduction`)."""
        self._slots.score = mx.broadcast_to(value, self._slots.score.shape) if value.shape != self._slots.score.shape else value
        self._unreduced = False

    def _viewed_keys(self) -> mx.array:
        k = self.keys_and_values()[0]
        view = self._hooks.disposition.view_keys
        return k if view is None else view(self._states["disposition"], k, self._slots.positions(), self._offset())

    def wants_layer_io(self) -> bool:
        """Whether the next forward is this prompt's first and the budget wants to see it."""
        return self._wants_io and not self._io_seen and self.keys is None

    def hold_layer_input(self, x) -> None:
        """The glue hands over the layer's input while the layer runs (``None``: the layer is
        done); :meth:`take_layer_input` returns it once, to pair it with the attention output."""
        self._io_input = x

    def take_layer_input(self):
        x, self._io_input = self._io_input, None
        return x

    def observe_layer_io(self, x: mx.array, out: mx.array) -> None:
        """The layer's input ``x`` and attention output ``out`` ``[B, N, d]`` of the first forward."""
        self._io_seen = True
        n = x.shape[1]
        weight = None
        if any(v != n for v in self._last_valid):
            weight = (mx.arange(n).reshape(1, n) < mx.array(self._last_valid).reshape(-1, 1)).astype(mx.float32)
        self._states["budget"] = self._hooks.budget.observe_layer(self._states["budget"], x, out, weight)
        if self._hooks.budget.rebudget is not None and all(c._io_seen for c in self.group.caches()):
            if self.info.pp_size > 1:
                self.group.rebudget_pending = True  # agreed across ranks at the next step's start
            else:
                self.group.rebudget()


def _grouped_attention_faster() -> bool:
    """Whether a step is faster in :func:`kvcompress.ops.attention` than in MLX's fused
    attention: on the CPU, whose ``scaled_dot_product_attention`` repeats the keys over each GQA
    group's query heads and takes a scalar ``exp`` (GPU kernels read the keys once, and beat
    these products)."""
    return mx.default_device().type == mx.DeviceType.cpu


def _low_bit_sdpa(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
    """mlx-lm's attention for low-bit slots (:class:`~kvcompress.storage.QuantizedSlots`)."""
    return ops.attention(queries, keys, values, scale, mask=mask, sinks=sinks)[0]
