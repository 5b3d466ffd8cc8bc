"""kvcompress's CPU kernels: a few-row low-bit matmul and a float32 row softmax.

**Softmax** (:func:`row_softmax`): ``softmax(x, axis=-1)`` of float32 logits in one vectorised
pass per row (AVX2 or SSE2 lanes; ``e^z`` by the same range reduction and polynomial as
:func:`kvcompress._exp._exp_nonpositive`, within ~2 ulp), the rows of a large input split over
the CPU's threads. MLX's CPU ``exp`` is scalar (~12 ns an element): on this kind of machine the
softmax, not the products, was most of a long prompt chunk's attention (a 768 x 2560 block of
logits per KV head: 73 ms in ``mx.softmax``, 12 ms here). :func:`kvcompress.ops.attention` uses
it for every float32 softmax on the CPU, decode steps and prompt chunks alike.
:func:`owner_softmax` is its masked form for head-group rows (AdaKV's storage): each query head's
softmax over its own KV head's slots of the row, the owner read from the slots' packed positions,
in one pass instead of a gather, a softmax and a scatter.

**Low-bit matmul**: ``x @ dequantize(w)`` (or ``x @ dequantize(w).T``) for packed affine codes.

A drop-in for ``mx.quantized_matmul(x, w, scales, biases, transpose, group_size, bits)`` with few
rows of ``x`` (decode steps: a KV head's query heads). MLX's CPU kernel for ``transpose=False``
unpacks every code again for each row of ``x``; this one (an MLX custom primitive in ``csrc/``,
lazy like any MLX op, on the CPU stream's own thread) unpacks each 16-column tile once per block
of four rows and accumulates in float32 (AVX2+FMA where the CPU has it, SSE2 otherwise): at KIVI's
decode shapes (4 rows, 2-bit codes, 3.6k tokens) it is ~7x MLX's kernel. ``transpose=True``
(queries times low-bit keys) unpacks each key row once for four query rows and sums each group's
products as vectors before its scale: ``s * sum(x q) + z * sum(x)``. Float32 ``x`` gives MLX's result up to float32 rounding; half-precision ``x`` is
accumulated in float32 where MLX accumulates in half precision.

It is compiled on first use against the installed mlx (see :mod:`._build`); elsewhere (not Linux
x86-64, a GPU stream, ``KVCOMPRESS_LOWBIT=0``, a failed build) MLX's kernel runs.
"""

from __future__ import annotations

import os
import platform
import sys
import threading

import mlx.core as mx
import numpy as np

from . import _build

__all__ = ["owner_softmax", "prepare", "quantized_matmul", "row_softmax", "status"]

_lock = threading.Lock()
_resolved: dict = {}  # once per process: {"module": module or None, "reason": str or None}


def _not_applicable() -> str | None:
    if os.environ.get("KVCOMPRESS_LOWBIT", "1") == "0":
        return "disabled by KVCOMPRESS_LOWBIT=0"
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return f"only built on Linux x86-64 (this is {sys.platform} {platform.machine()}); MLX's kernel is used"
    return None


def _kernel():
    """The compiled module, or None (the reason is kept for :func:`status`)."""
    if "module" in _resolved:
        return _resolved["module"]
    with _lock:
        if "module" not in _resolved:
            module, reason = None, _not_applicable()
            if reason is None:
                try:
                    module = _build.load()
                    _probe(module)
                except _build.BuildError as e:
                    module, reason = None, str(e)
            _resolved.update(module=module, reason=reason)
    return _resolved["module"]


def _probe(module) -> None:
    """One small product against MLX's, so a binary that cannot exchange mlx arrays (a nanobind
    other than mlx's) or computes wrongly is refused before any cache uses it."""
    rng = np.random.default_rng(0)
    w = mx.array(rng.normal(size=(2, 64, 64)).astype(np.float32))
    q, s, b = mx.quantize(w, group_size=32, bits=2)
    x = mx.array(rng.normal(size=(2, 3, 64)).astype(np.float32))
    want = mx.quantized_matmul(x, q, s, b, transpose=False, group_size=32, bits=2)
    want_t = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=32, bits=2)
    logits = mx.array(rng.normal(size=(3, 37)).astype(np.float32) * 8)
    heads = mx.array(rng.integers(-1, 2, size=(2, 37)).astype(np.int32))  # 2 heads, -1 empty
    own = heads[:, None, None, :] == mx.arange(2).reshape(1, 2, 1, 1)
    grouped = mx.array(rng.normal(size=(2, 2, 3, 37)).astype(np.float32) * 8)
    try:
        soft = bool(mx.allclose(module.softmax(logits, stream=mx.cpu), mx.softmax(logits, axis=-1),
                                rtol=1e-5, atol=1e-7).item()) and bool(mx.allclose(
            module.owner_softmax(grouped, heads, stream=mx.cpu),
            mx.softmax(mx.where(own, grouped, -mx.inf), axis=-1), rtol=1e-5, atol=1e-7).item())
        got = module.qmm(x, q, s, b, group_size=32, bits=2, stream=mx.cpu)
        got_t = module.qmm(x, q, s, b, group_size=32, bits=2, transpose=True, stream=mx.cpu)
        ok = bool(mx.allclose(got, want, rtol=1e-4, atol=1e-4).item()) and bool(
            mx.allclose(got_t, want_t, rtol=1e-4, atol=1e-4).item())
    except (TypeError, RuntimeError, ValueError) as e:
        raise _build.BuildError(
            f"the built low-bit kernel cannot be called ({e}); nanobind {_build._nanobind_version()} "
            f"is probably not the version mlx {mx.__version__} was built with"
        ) from None
    if not ok:
        raise _build.BuildError("the built low-bit kernel disagrees with mx.quantized_matmul; not used")
    if not soft:
        raise _build.BuildError("the built CPU softmax disagrees with mx.softmax; not used")


def prepare() -> bool:
    """Resolve the kernels now, building them on first use (a notice on stderr, ~40 s), when MLX's
    default device is the CPU; whether they will be used. Every compressed cache calls it when it
    is made (its attention's softmax runs here), so the build never lands inside a timed decode
    step or between the tokens of a streamed answer."""
    return mx.default_device() == mx.cpu and _kernel() is not None


def row_softmax():
    """The kernels' ``softmax(x)`` over the last axis of float32 ``x`` on the CPU stream, or None
    where they are not used (another device, another platform, ``KVCOMPRESS_LOWBIT=0``, a failed
    build): then MLX's softmax runs. Resolves (builds, the first time) the kernels."""
    if mx.default_device() != mx.cpu:
        return None
    module = _kernel()
    return None if module is None else module.softmax


def owner_softmax():
    """The kernels' per-head softmax over a head-group row, ``f(x, v, shift=...)`` (``x`` float32
    ``[..., g, rep, T]``, ``v`` int32 ``[..., T]``; row ``(.., h, i)`` the softmax over the columns
    whose ``v >> shift`` is ``h``, ``v < 0`` none, 0 elsewhere), or None where they are not used
    (as :func:`row_softmax`)."""
    if mx.default_device() != mx.cpu:
        return None
    module = _kernel()
    return None if module is None else module.owner_softmax


def quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, *,
                     group_size: int, bits: int, transpose: bool = False) -> mx.array:
    """``mx.quantized_matmul(x, w, scales, biases, transpose, group_size, bits)`` (affine)."""
    if mx.default_device() == mx.cpu:
        module = _kernel()
        if module is not None:
            return module.qmm(x, w, scales, biases, group_size=group_size, bits=bits, transpose=transpose)
    return mx.quantized_matmul(x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits)


def status(build: bool = False) -> dict:
    """Whether the kernel is used here and why not (``build=True`` builds it if needed)."""
    if build:
        _kernel()
    if "module" in _resolved:
        module, reason = _resolved["module"], _resolved["reason"]
        return {"available": module is not None, "reason": reason,
                "avx2": bool(module.has_avx2()) if module is not None else None}
    reason = _not_applicable()
    if reason is None:
        entry = _build.entry_dir()
        failed = entry / "FAILED"
        if failed.exists():
            reason = failed.read_text().strip()
        elif not any(entry.glob(_build.MODULE + "*")):
            reason = _build._missing() or f"not built yet (builds on first use, cached in {entry})"
    return {"available": reason is None, "reason": reason, "avx2": None}
