"""How a cache holds the slots it keeps: in the model's dtype, or as low-bit affine codes.

A method decides *what* to keep; the storage decides *how* it is held. With ``kv_bits`` set,
every stored key and value vector is held as ``mx.quantize`` codes (affine, group-wise along the
head dimension: each group of ``group_size`` entries keeps a scale ``s`` and a bias ``z``, and
entry ``i`` is ``s * q_i + z`` with ``q_i`` an integer of ``bits`` bits). Keys and values may take
different bits (``kv_bits=(8, 4)``: K8V4). Scales and biases are kept in float16 for a float32
model, else in the model's dtype. Positions, scores and every component's logic stay float32 and
unchanged; components see the stored vectors dequantized (lazily: only what they read is
computed), and attention reads the codes directly (:func:`kvcompress.ops.attention`).

:class:`QuantizedSlots` holds one ``[B, H, T, D]`` store as its three arrays and applies every
layout operation of the engine (take, put, append, slice, concatenate, pad) to each of them along
the slot axis, so a float store and a low-bit one go through the same code.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import attrs
import mlx.core as mx

from .errors import ConfigError

__all__ = ["KVStorage", "QuantizedSlots", "VALID_BITS", "VALID_GROUP_SIZES", "as_float", "keys_product", "put_slots",
           "take_slots", "values_product"]

VALID_BITS = (2, 3, 4, 5, 6, 8)
VALID_GROUP_SIZES = (32, 64, 128)


def _bits(value: Any, what: str) -> Optional[int]:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value not in VALID_BITS:
        raise ConfigError(f"{what} must be one of {', '.join(map(str, VALID_BITS))} (or None for the model's "
                          f"dtype), got {value!r}")
    return value


@attrs.frozen
class KVStorage:
    """``k_bits`` / ``v_bits``: bits per stored key / value entry (None: the model's dtype);
    ``group_size``: entries per scale and bias along the head dimension."""

    k_bits: Optional[int] = None
    v_bits: Optional[int] = None
    group_size: int = 64

    def __attrs_post_init__(self):
        same = self.k_bits == self.v_bits
        _bits(self.k_bits, "kv_bits" if same else "kv_bits (keys)")
        _bits(self.v_bits, "kv_bits" if same else "kv_bits (values)")
        if isinstance(self.group_size, bool) or self.group_size not in VALID_GROUP_SIZES:
            raise ConfigError(f"kv_group_size must be one of {', '.join(map(str, VALID_GROUP_SIZES))}, "
                              f"got {self.group_size!r}")

    @classmethod
    def of(cls, kv_bits: Union[int, tuple, list, str, None] = None, kv_group_size: Any = 64) -> "KVStorage":
        """From the user's ``kv_bits`` (``4``, ``(8, 4)``, ``"8,4"``, ``"K8V4"``, None) and
        ``kv_group_size``."""
        if isinstance(kv_group_size, str) and kv_group_size.strip().isdigit():
            kv_group_size = int(kv_group_size)
        if isinstance(kv_bits, str):
            text = kv_bits.strip().upper()
            if text in ("", "NONE"):
                kv_bits = None
            else:
                parts = text[1:].replace("V", ",").split(",") if text.startswith("K") else text.split(",")
                if not all(p.strip().isdigit() for p in parts) or len(parts) > 2:
                    raise ConfigError(f"kv_bits {kv_bits!r} is not a number of bits (4), a pair (8,4) or K8V4; "
                                      f"bits: {', '.join(map(str, VALID_BITS))}")
                kv_bits = tuple(int(p) for p in parts)
        if isinstance(kv_bits, (tuple, list)):
            if len(kv_bits) == 1:
                kv_bits = kv_bits[0]
            elif len(kv_bits) != 2:
                raise ConfigError(f"kv_bits is one number of bits or a (keys, values) pair, got {kv_bits!r}")
        k, v = kv_bits if isinstance(kv_bits, (tuple, list)) else (kv_bits, kv_bits)
        return cls(k_bits=k, v_bits=v, group_size=kv_group_size)

    @property
    def quantized(self) -> bool:
        return self.k_bits is not None or self.v_bits is not None

    def to_dict(self) -> dict:
        """The config form (empty for float storage): ``{"kv_bits": 4 | [8, 4], "kv_group_size"}``."""
        if not self.quantized:
            return {}
        bits = self.k_bits if self.k_bits == self.v_bits else [self.k_bits, self.v_bits]
        return {"kv_bits": bits, "kv_group_size": self.group_size}

    def describe(self) -> str:
        if not self.quantized:
            return ""
        k = "16" if self.k_bits is None else str(self.k_bits)
        v = "16" if self.v_bits is None else str(self.v_bits)
        return f"K{k}V{v}/g{self.group_size}"

    def check_head_dim(self, d_k: int, d_v: int) -> None:
        for name, bits, d in (("key", self.k_bits, d_k), ("value", self.v_bits, d_v)):
            if bits is not None and d % self.group_size:
                raise ConfigError(
                    f"kv_group_size {self.group_size} does not divide the model's {name} head dimension {d}; "
                    f"use a kv_group_size that does ({', '.join(str(g) for g in VALID_GROUP_SIZES if d % g == 0) or 'none does: keep float storage'})"
                )

    def store(self, x: mx.array, kind: str):
        """``x`` ``[B, H, S, D]`` as this storage holds ``kind`` (``"keys"`` / ``"values"``)."""
        bits = self.k_bits if kind == "keys" else self.v_bits
        return x if bits is None else QuantizedSlots.quantize(x, bits, self.group_size)


def option_params(bits: Any, group: Any, params: dict) -> dict:
    """``kv_bits`` / ``kv_group_size`` from the ``--kv-bits`` / ``--kv-group-size`` options (each
    checked alone, so that an error names the option it came from)."""
    out = {}
    for flag, name, value in (("--kv-bits", "kv_bits", bits), ("--kv-group-size", "kv_group_size", group)):
        if value is None:
            continue
        if name in params:
            raise ConfigError(f"give {name} once: {flag} or --param {name}=..., not both")
        try:
            KVStorage.of(value) if name == "kv_bits" else KVStorage.of(None, value)
        except ConfigError as exc:
            raise ConfigError(f"{flag} {value}: {exc}") from None
        out[name] = int(value) if name == "kv_group_size" else value
    return out


def _scale_dtype(dtype: mx.Dtype) -> mx.Dtype:
    return mx.float16 if dtype == mx.float32 else dtype


class QuantizedSlots:
    """A ``[B, H, T, D]`` store of ``dtype`` vectors held as ``(codes, scales, biases)``:
    ``codes`` ``[B, H, T, D * bits / 32]`` uint32, ``scales``/``biases`` ``[B, H, T, D / group]``.

    ``shape``, ``dtype`` and ``ndim`` are those of the vectors it stands for; ``nbytes`` what it
    really holds. Indexing selects along the leading three axes only (never within a vector)."""

    __slots__ = ("codes", "scales", "biases", "bits", "group_size", "dtype")
    ndim = 4

    def __init__(self, codes, scales, biases, bits: int, group_size: int, dtype: mx.Dtype):
        self.codes, self.scales, self.biases = codes, scales, biases
        self.bits, self.group_size, self.dtype = int(bits), int(group_size), dtype

    @classmethod
    def quantize(cls, x: mx.array, bits: int, group_size: int) -> "QuantizedSlots":
        codes, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
        sd = _scale_dtype(x.dtype)
        return cls(codes, scales.astype(sd), biases.astype(sd), bits, group_size, x.dtype)

    @property
    def shape(self) -> tuple:
        return (*self.codes.shape[:-1], self.codes.shape[-1] * 32 // self.bits)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.biases.nbytes

    def leaves(self) -> tuple:
        return self.codes, self.scales, self.biases

    def map(self, fn) -> "QuantizedSlots":
        return QuantizedSlots(*(fn(a) for a in self.leaves()), self.bits, self.group_size, self.dtype)

    def like(self, x: mx.array) -> "QuantizedSlots":
        """``x`` (vectors) quantized as this store holds them."""
        return x if isinstance(x, QuantizedSlots) else QuantizedSlots.quantize(x.astype(self.dtype), self.bits,
                                                                              self.group_size)

    def dequantize(self) -> mx.array:
        """The vectors ``s * q + z``, computed in their own dtype (as attention reads the codes)."""
        s, z = self.scales, self.biases
        if s.dtype != self.dtype:
            s, z = s.astype(self.dtype), z.astype(self.dtype)
        return mx.dequantize(self.codes, s, z, group_size=self.group_size, bits=self.bits)

    def _key(self, key):
        parts = key if isinstance(key, tuple) else (key,)
        if Ellipsis in parts:
            if parts[-1] != slice(None):
                raise IndexError("QuantizedSlots indexes slots, not entries of a vector: end with ', :]'")
            return key
        if len(parts) > 3:
            raise IndexError("QuantizedSlots indexes at most its three leading axes")
        return key

    def __getitem__(self, key) -> "QuantizedSlots":
        key = self._key(key)
        return self.map(lambda a: a[key])

    def __setitem__(self, key, value) -> None:
        key, value = self._key(key), self.like(value)
        for a, b in zip(self.leaves(), value.leaves()):
            a[key] = b

    def __reduce__(self):  # copies and pickles (mx.Dtype itself cannot be pickled)
        return _slots, (*self.leaves(), self.bits, self.group_size, dtype_name(self.dtype))

    def __repr__(self) -> str:
        return f"QuantizedSlots(shape={self.shape}, bits={self.bits}, group_size={self.group_size}, dtype={self.dtype})"


# ---- layout operations on a store (a float array or QuantizedSlots), along the slot axis 2 ----


def as_float(a):
    """The vectors of a store (lazily dequantized; a float store as it is)."""
    return a.dequantize() if isinstance(a, QuantizedSlots) else a


def take_slots(a, idx: mx.array):
    """``a[b, h, idx[b, h, j]]``: ``idx`` ``[B, H, J]`` int32 (or ``[B, H, J, 1]``)."""
    idx = idx if idx.ndim == 4 else idx[..., None]
    if isinstance(a, QuantizedSlots):
        return a.map(lambda x: mx.take_along_axis(x, idx, axis=2))
    return mx.take_along_axis(a, idx, axis=2)


def fill_from_end(pos: mx.array, k: int) -> tuple:
    """``(dst, src)`` ``[B, H, k]``: the ``k`` lowest empty slots (``pos < 0``) and the ``k``
    highest live ones, paired; moving ``src`` into ``dst`` leaves slots ``[0, T - k)`` live when
    each (row, head) holds ``T - k``. A pair whose hole lies above its live slot (nothing to
    move) copies the hole onto itself."""
    t = pos.shape[-1]
    ar = mx.arange(t, dtype=mx.int32)
    live = pos >= 0
    dst = mx.argsort(mx.where(live, ar + t, ar), axis=-1)[..., :k].astype(mx.int32)
    src = mx.argsort(mx.where(live, t - ar, 2 * t), axis=-1)[..., :k].astype(mx.int32)
    return dst, mx.where(dst < src, src, dst)


def put_slots(a, idx: mx.array, new):
    """``a`` with ``new`` ``[B, H, J, D]`` written into slots ``idx`` ``[B, H, J]``."""
    idx = idx if idx.ndim == 4 else idx[..., None]
    if isinstance(a, QuantizedSlots):
        new = a.like(new)
        return QuantizedSlots(*(mx.put_along_axis(x, mx.broadcast_to(idx, idx.shape[:3] + (x.shape[-1],)), y, axis=2)
                                for x, y in zip(a.leaves(), new.leaves())), a.bits, a.group_size, a.dtype)
    return mx.put_along_axis(a, mx.broadcast_to(idx, idx.shape[:3] + (a.shape[-1],)), new, axis=2)


def concat_slots(parts: list, axis: int = 2):
    if isinstance(parts[0], QuantizedSlots):
        p = parts[0]
        return QuantizedSlots(*(mx.concatenate(list(x), axis=axis) for x in zip(*(q.leaves() for q in parts))),
                              p.bits, p.group_size, p.dtype)
    return mx.concatenate(parts, axis=axis)


def pad_slots(a, before: int):
    """``before`` empty (zero) slots in front of every row."""
    pad = [(0, 0), (0, 0), (before, 0), (0, 0)]
    if isinstance(a, QuantizedSlots):
        return a.map(lambda x: mx.pad(x, pad))
    return mx.pad(a, pad)


def contiguous(a):
    return a.map(mx.contiguous) if isinstance(a, QuantizedSlots) else mx.contiguous(a)


def zeros_like_rows(like, b: int, h: int, t: int):
    """``[b, h, t, D]`` zero slots stored as ``like`` is (a float array or QuantizedSlots)."""
    if isinstance(like, QuantizedSlots):
        d = like.shape[-1]
        sd = like.scales.dtype
        return QuantizedSlots(mx.zeros((b, h, t, d * like.bits // 32), mx.uint32),
                              mx.zeros((b, h, t, d // like.group_size), sd),
                              mx.zeros((b, h, t, d // like.group_size), sd), like.bits, like.group_size, like.dtype)
    return mx.zeros((b, h, t, like.shape[-1]), like.dtype)


def to_state(a):
    """What ``state`` saves for a store: the array, or its ``(codes, scales, biases)``."""
    return a.leaves() if isinstance(a, QuantizedSlots) else a


_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def from_state(saved, bits: Optional[int], group_size: int, dtype_name: Optional[str] = None):
    """A store from :func:`to_state`'s form (``dtype_name``: the vectors' dtype, as saved)."""
    packed = isinstance(saved, (list, tuple))
    if packed != (bits is not None):
        raise ConfigError(
            "this cache state does not match its method's storage: it holds "
            f"{'low-bit codes' if packed else 'float slots'}, the method says kv_bits={bits}"
        )
    if bits is None:
        return saved
    codes, scales, biases = saved
    dtype = _DTYPES.get(dtype_name or "", scales.dtype)
    return QuantizedSlots(codes, scales, biases, bits, group_size, dtype)


def dtype_name(dtype: mx.Dtype) -> str:
    return next((k for k, v in _DTYPES.items() if v == dtype), str(dtype))


def _slots(codes, scales, biases, bits, group_size, dtype: str) -> QuantizedSlots:
    return QuantizedSlots(codes, scales, biases, bits, group_size, _DTYPES[dtype])


def rewritten(new, seen, held, written: Optional[tuple] = None):
    """The store after a disposition returned ``new`` for the vectors ``seen`` of ``held``:
    a float store takes ``new``; a low-bit one stays as it is where the disposition returned what
    it was given (drop), re-stores only the rows it says it wrote (``written``: ``(slots, rows or
    None)``, see ``Eviction.rewritten``), else is quantized again where a vector changed."""
    if not isinstance(held, QuantizedSlots):
        return new
    if new is seen:
        return held
    if written is not None:
        slots, rows = written
        return held if rows is None else put_slots(held, slots, rows)
    again, same = held.like(new), mx.all(new == seen, axis=-1, keepdims=True)
    return QuantizedSlots(*(mx.where(same, a, b) for a, b in zip(held.leaves(), again.leaves())),
                          held.bits, held.group_size, held.dtype)


# ---- the two products of attention over a store, read directly from low-bit codes ----


def keys_product(q: mx.array, keys, t: int) -> mx.array:
    """``q`` ``[B, H, G, n, D]`` (float32) times the first ``t`` stored keys, transposed:
    ``[B, H, G, n, t]`` logits (each KV head's ``G * n`` query rows in one product)."""
    b, h, g, n, d = q.shape
    if isinstance(keys, QuantizedSlots):
        from ._lowbit import quantized_matmul

        k = keys if keys.shape[2] == t else keys[..., :t, :]
        qmm = quantized_matmul if k.bits in (2, 4, 8) else mx.quantized_matmul
        out = qmm(q.reshape(b, h, g * n, d), k.codes, k.scales, k.biases, transpose=True,
                  group_size=k.group_size, bits=k.bits)
        return out.reshape(b, h, g, n, t)
    k = keys if keys.shape[2] == t else keys[..., :t, :]
    k = k if k.dtype == mx.float32 else k.astype(mx.float32)
    return (q.reshape(b, h, g * n, d) @ k.swapaxes(-1, -2)).reshape(b, h, g, n, t)


def values_product(w: mx.array, values) -> mx.array:
    """Attention weights ``w`` ``[B, H, G, n, t]`` (float32) times the first ``t`` stored values:
    ``[B, H, G, n, D_v]`` float32 (the project's few-row low-bit CPU kernel for codes)."""
    from ._lowbit import quantized_matmul

    b, h, g, n, t = w.shape
    v = values if values.shape[2] == t else values[..., :t, :]
    if isinstance(v, QuantizedSlots):
        qmm = quantized_matmul if v.bits in (2, 4, 8) else _qmm_plain
        out = qmm(w.reshape(b, h, g * n, t), v.codes, v.scales, v.biases,
                               group_size=v.group_size, bits=v.bits)
        return out.reshape(b, h, g, n, -1)
    v = v if v.dtype == mx.float32 else v.astype(mx.float32)
    return (w.reshape(b, h, g * n, t) @ v).reshape(b, h, g, n, -1)


def _qmm_plain(x, w, scales, biases, *, group_size, bits):
    return mx.quantized_matmul(x, w, scales, biases, transpose=False, group_size=group_size, bits=bits)


#: a step of more queries than this on the CPU (a prompt chunk) dequantizes the store once for
#: the step and multiplies with BLAS: at chunk sizes that beats any kernel reading codes, and the
#: copy is the chunk's transient like its logits; decode steps and short drafts read the codes
DIRECT_MAX_QUERIES = 16


def for_step(store, n_queries: int):
    """The store as a step of ``n_queries`` queries should read it (see :data:`DIRECT_MAX_QUERIES`)."""
    if isinstance(store, QuantizedSlots) and n_queries > DIRECT_MAX_QUERIES and mx.default_device() == mx.cpu:
        return store.dequantize()
    return store
