"""StreamingLLM's position shift as a disposition: drop, then close the gaps in RoPE positions.

StreamingLLM (``pos_shift/modify_llama.py``) caches keys *before* RoPE and re-rotates them every
step to their rank in the cache, ``0 .. n-1``, with the query at ``n``. mlx-lm models rotate
keys before the cache sees them, and the cache's ``offset`` must stay the true token count, so
this disposition produces the same attention through RoPE's relative property instead:

* storage keeps every key rotated at its true position ``p_j`` (one rounding, no drift);
* the keys a step attends are re-rotated by ``delta_j = (offset - n) + rank_j - p_j``, i.e. to
  the contiguous positions ``offset - n + rank_j``; the step's queries sit at their true
  positions ``offset - S .. offset - 1``, which are exactly ``offset - n + rank`` of the new
  tokens. Every query-key distance therefore equals StreamingLLM's ``rank_q - rank_k``, and since
  ``q R(a)^T R(b) k = q R(a - b) k`` for a rotary embedding, the attention weights are
  StreamingLLM's (up to floating-point rounding).

The rotation by ``delta_j`` uses the model's own RoPE frequencies, read from each attention
module's ``rope`` in :meth:`PositionShift.bind`, and is applied with ``mx.fast.rope`` using a
per-slot offset vector. RoPE variants whose angle is not ``position * frequency`` (dynamic NTK
scaling) cannot be shifted and are refused with a :class:`~kvcompress.ConfigError`.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import attrs
import mlx.core as mx
import mlx.nn as nn

from kvcompress import ConfigError

__all__ = ["PositionShift", "RopeParams", "rope_params"]



@attrs.frozen
class RopeParams:
    """The rotation a RoPE module applies: angle ``scale * p / freqs_i`` (or ``base`` form)."""

    dims: int
    traditional: bool
    base: Optional[float]
    scale: float
    freqs: Optional[mx.array] = attrs.field(default=None, eq=False)

    def rotate(self, x: mx.array, delta: mx.array) -> mx.array:
        """Rotate each vector ``x[..., j, :]`` by its own position offset ``delta[..., j]``."""
        shape = x.shape
        flat = x.reshape(-1, 1, shape[-1])
        out = mx.fast.rope(
            flat,
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=delta.reshape(-1).astype(mx.int32),
            freqs=self.freqs,
        )
        return out.reshape(shape)


def rope_params(module) -> RopeParams:
    """Read the rotation of an mlx / mlx-lm RoPE module, or raise ConfigError if unsupported."""
    name = type(module).__name__
    if isinstance(module, nn.RoPE):
        return RopeParams(int(module.dims), bool(module.traditional), float(module.base), float(module.scale))
    freqs = getattr(module, "_freqs", None)
    dims = getattr(module, "dims", getattr(module, "dim", None))
    if isinstance(freqs, mx.array) and dims is not None:
        # Llama3RoPE, YarnRoPE, SuScaledRoPE, ProportionalRoPE: mx.fast.rope(..., base=None,
        # scale=1.0, freqs=_freqs); their input scaling (mscale) is already in the stored keys.
        return RopeParams(int(dims), bool(getattr(module, "traditional", False)), None, 1.0, freqs)
    raise ConfigError(
        f"position shift cannot re-rotate keys for RoPE module {name!r}: it supports nn.RoPE and "
        "mlx-lm RoPE modules with fixed frequencies (Llama3, YaRN, SuScaled, Proportional); use "
        "disposition='drop' (no shift) for this model"
    )


@attrs.define
class ShiftState:
    """Per-cache state: the layer's RoPE rotation (set by :meth:`PositionShift.bind`) and whether
    anything was evicted yet (before that every rank equals its position: no rotation)."""

    rope: Optional[RopeParams] = None
    shifted: bool = False


def _attention(layer):
    return getattr(layer, "self_attn", getattr(layer, "attention", None))


@attrs.frozen
class PositionShift:
    """Drop evicted tokens and attend the survivors at contiguous positions (StreamingLLM).

    See the module docstring for the math. Values, scores and storage are untouched; only the
    keys handed to attention (and to query-based scorers) are re-rotated.
    """

    requires: ClassVar[frozenset] = frozenset({"positions", "keys"})
    provides: ClassVar[frozenset] = frozenset({"position_shift"})

    def dispose(self, ev):
        if isinstance(ev.state, ShiftState) and not ev.state.shifted:
            ev.state = attrs.evolve(ev.state, shifted=True)
        return ev.keys, ev.values, ev.scores

    def init_state(self, layer) -> ShiftState:
        return ShiftState()

    def bind(self, model, layers, states) -> list:
        """Each layer's RoPE parameters read into its state."""
        blocks, out = list(model.layers), []
        for info, state in zip(layers, states):
            block = info.block if info.block is not None else info.layer
            attn = _attention(blocks[block])
            rope = getattr(attn, "rope", None)
            if rope is None:
                raise ConfigError(
                    f"position shift needs the RoPE module of layer {block} "
                    f"({type(attn).__name__} has no 'rope' attribute)"
                )
            out.append(attrs.evolve(state or ShiftState(), rope=rope_params(rope)))
        return out

    def view_keys(self, state: ShiftState, keys: mx.array, positions: mx.array, offset: mx.array) -> mx.array:
        """Keys re-rotated to ``offset - n + rank`` (``n`` held tokens of the row, ``rank`` the
        slot's rank by position among them); empty slots are left as they are."""
        if not state.shifted:
            return keys
        if state.rope is None:
            raise ConfigError(
                "position shift has no RoPE parameters: build the cache with "
                "kvcompress.make_prompt_cache(model, ...) so the disposition can bind to the model"
            )
        held = positions >= 0
        key = mx.where(held, positions, 2**30)
        rank = mx.argsort(mx.argsort(key, axis=-1), axis=-1).astype(mx.int32)
        n = held.astype(mx.int32).sum(axis=-1, keepdims=True)
        delta = mx.where(held, (offset - n) + rank - positions, 0)
        return state.rope.rotate(keys, delta)
