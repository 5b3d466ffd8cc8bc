"""The model's output projection, seen by the model hook: next-token predictions of a long call
without its ``[B, N, V]`` logits.

A scorer that requires ``predictions`` (selfinfo) needs ``log p(x_t | x_<t)`` for every token of
a prefill chunk; the logits of a 512-token chunk of a 49k-word vocabulary are 100 MB of float32
that a plain prefill never computes (mlx-lm discards a prompt chunk's output unevaluated). The
head modules get stateless subclasses (:func:`install_head_capture`) that, while the model hook
asks (:func:`capture`), record the hidden states they were given and how to project them. When
the model returned exactly what the head made (no soft-capping or scaling after it: checked by
identity), :meth:`Predictions.from_head` projects the hidden states a block of positions at a
time; otherwise the hook uses the logits the model returned, as before.
"""

from __future__ import annotations

import contextlib
import contextvars

import mlx.nn as nn

from ._hooks import _BASE, base_class, subclass

__all__ = ["install_head_capture", "capture"]

_CAPTURE: contextvars.ContextVar = contextvars.ContextVar("kvcompress_head_capture", default=None)
_TIED: dict = {}


def _record(hidden, project, out) -> None:
    seen = _CAPTURE.get()
    if seen is not None:
        seen.append((hidden, project, out))


def _linear_call(base, mod, args, kwargs):
    out = base.__call__(mod, *args, **kwargs)
    if len(args) == 1 and not kwargs:
        _record(args[0], lambda h: base.__call__(mod, h), out)
    return out


def _tied_class(base: type) -> type:
    """``base`` (an embedding) with an ``as_linear`` that records its input (tied weights)."""
    if base not in _TIED:
        def as_linear(self, x):
            out = base.as_linear(self, x)
            _record(x, lambda h: base.as_linear(self, h), out)
            return out

        _TIED[base] = type(base.__name__, (base,), {
            "as_linear": as_linear, _BASE: base, "__module__": base.__module__, "__doc__": base.__doc__})
    return _TIED[base]


def install_head_capture(model: nn.Module) -> None:
    """Give ``model``'s output projection (``lm_head``, and ``model.embed_tokens.as_linear`` for
    tied weights) the recording subclasses (idempotent; nothing changes outside :func:`capture`)."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Module) and callable(getattr(type(head), "__call__", None)):
        head.__class__ = subclass(base_class(head), _linear_call)
    inner = getattr(model, "model", None)
    emb = getattr(inner, "embed_tokens", None) if isinstance(inner, nn.Module) else None
    if isinstance(emb, nn.Module) and callable(getattr(type(emb), "as_linear", None)):
        emb.__class__ = _tied_class(base_class(emb))


@contextlib.contextmanager
def capture():
    """Record the head calls made inside the block; yields the list ``[(hidden, project, out)]``."""
    seen: list = []
    token = _CAPTURE.set(seen)
    try:
        yield seen
    finally:
        _CAPTURE.reset(token)
