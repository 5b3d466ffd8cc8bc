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
module's ``rope`` in :meth:`PositionShift.bind`: tables of the rotations by ``r * 2048^l``
positions (``l < 3``), computed once by ``mx.fast.rope`` itself, and ``R(delta)`` as the
product of one row of each (:meth:`RopeParams.rotate`). RoPE variants whose angle is not ``position * frequency`` (dynamic NTK
scaling) cannot be shifted and are refused with a :class:`~kvcompress.ConfigError`.
"""

from __future__ import annotations

import functools
from typing import ClassVar, Optional

import attrs
import mlx.core as mx
import mlx.nn as nn

from kvcompress import ConfigError, ops

__all__ = ["PositionShift", "RopeParams", "rope_params"]



#: rows per table level; a rotation by ``|delta| = d0 + d1 K + d2 K^2`` (digits ``< K``) is the
#: product of one row of each level, so three levels cover every int32 position
_RADIX = 2048
_LEVEL_ROWS = (_RADIX, _RADIX, 2**31 // _RADIX**2)
#: the tables of each distinct rotation (one per model, not per layer: a few MB at most)
_TABLES: dict = {}


@attrs.frozen
class RopeParams:
    """The rotation a RoPE module applies: angle ``scale * p / freqs_i`` (or ``base`` form)."""

    dims: int
    traditional: bool
    base: Optional[float]
    scale: float
    freqs: Optional[mx.array] = attrs.field(default=None, eq=False)

    def _rope(self, x: mx.array, offset: mx.array) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale,
                            offset=offset.astype(mx.int32), freqs=self.freqs)

    def tables(self) -> list:
        """Per level ``l``, ``[rows, dims]``: row ``r`` holds ``cos`` then ``sin`` of the rotation
        by ``r * K^l`` positions, one per rotated pair -- the model's RoPE itself applied to unit
        pairs, so its layout, base, scale and frequencies are the module's own. Built once per
        distinct rotation."""
        key = (self.dims, self.traditional, self.base, self.scale,
               None if self.freqs is None else tuple(self.freqs.tolist()))
        if key not in _TABLES:
            half = self.dims // 2
            unit = mx.array([1.0, 0.0] * half if self.traditional else [1.0] * half + [0.0] * half)
            out = []
            for level, rows in enumerate(_LEVEL_ROWS):
                t = self._rope(mx.broadcast_to(unit, (rows, 1, self.dims)), mx.arange(rows) * _RADIX**level)[:, 0]
                out.append(mx.concatenate([t[:, 0::2], t[:, 1::2]], -1) if self.traditional else t)
            mx.eval(out)
            _TABLES[key] = out
        return _TABLES[key]

    def rotate(self, x: mx.array, delta: mx.array) -> mx.array:
        """Rotate each vector ``x[..., j, :]`` by its own position offset ``delta[..., j]`` (any
        sign): ``R(delta) = R(d2 K^2) R(d1 K) R(d0)``, each factor one row of :meth:`tables`
        (products of cosines and sines instead of a sine and a cosine per key element, which
        ``mx.fast.rope`` with a per-slot offset computes: ~4x the time on a CPU)."""
        fn = _rotate_compiled(self.traditional, self.dims) if ops.COMPILE else _rotation(self.traditional, self.dims)
        return fn(x, delta.astype(mx.int32), *self.tables())


def _rotation(traditional: bool, dims: int):
    """``(x, delta, t0, t1, t2) -> x`` rotated (see :meth:`RopeParams.rotate`)."""
    half = dims // 2

    def rot(x, delta, t0, t1, t2):
        a = mx.abs(delta)
        rows = (t0[a % _RADIX], t1[(a // _RADIX) % _RADIX], t2[a // _RADIX**2])
        c, s = rows[0][..., :half], rows[0][..., half:]
        for r in rows[1:]:
            c, s = c * r[..., :half] - s * r[..., half:], s * r[..., :half] + c * r[..., half:]
        s = mx.where((delta < 0)[..., None], -s, s)  # R(-a) = R(a)^T
        xf = x.astype(mx.float32)
        x1, x2 = (xf[..., 0:dims:2], xf[..., 1:dims:2]) if traditional else (xf[..., :half], xf[..., half:dims])
        y1, y2 = x1 * c - x2 * s, x1 * s + x2 * c
        y = mx.stack([y1, y2], -1).reshape(*y1.shape[:-1], dims) if traditional else mx.concatenate([y1, y2], -1)
        if dims < x.shape[-1]:  # partial rotary: the rest passes through
            y = mx.concatenate([y, xf[..., dims:]], -1)
        return y.astype(x.dtype)

    return rot


@functools.lru_cache(maxsize=None)
def _rotate_compiled(traditional: bool, dims: int):
    return mx.compile(_rotation(traditional, dims))


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
