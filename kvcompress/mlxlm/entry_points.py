"""mlx-lm's entry points that meet a model and a cache list: given kvcompress caches, they make the
model ready for them and refuse batches that cannot be exact.

A cache list loaded from a file in a fresh process (``load_prompt_cache`` + ``mlx_lm.generate``,
mlx-lm's idiom) meets its model for the first time in mlx-lm's code. Three of its functions are
wrapped, once, when kvcompress is imported or first used (:func:`wrap`, given
:func:`kvcompress.install`):

* ``generate_step`` and ``speculative_generate_step`` (``generate``, ``stream_generate``, the
  CLIs): given a ``prompt_cache`` holding kvcompress caches they install the model hook
  (:func:`kvcompress.install`) on the model (and the draft model), so the list is checked against
  the model, token-scoring methods (KVzip) get their ids and SqueezeAttention its layer I/O, as in
  the process that built the caches;
* ``BatchGenerator.insert_segments`` (``insert``, ``batch_generate``): the same, and a batch that
  mixes kvcompress rows with rows of another cache kind or method (mlx-lm's ``BatchKVCache``
  would take a compressed row in unchecked, or fail with an ``AttributeError`` when one joins a
  running batch) is refused with a :class:`~kvcompress.ConfigError` before anything changes.

Calls without kvcompress caches go to mlx-lm's functions unchanged (one scan of the cache list).
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Optional

from ..engine import Engine
from ..errors import ConfigError

__all__ = ["wrap", "check_batch"]

_MARK = "__kvcompress_entry__"


def _has_engine(cache_list) -> bool:
    return isinstance(cache_list, (list, tuple)) and any(isinstance(c, Engine) for c in cache_list)


def _step(original, install, with_draft: bool = False):
    @functools.wraps(original)
    def generate_step(prompt, model, *args, **kwargs):
        if _has_engine(kwargs.get("prompt_cache")):
            install(model)
            draft = kwargs.get("draft_model", args[0] if args else None) if with_draft else None
            if draft is not None:
                install(draft)
        return original(prompt, model, *args, **kwargs)

    setattr(generate_step, _MARK, original)
    return generate_step


def _signature(c) -> Optional[tuple]:
    """What rows of one layer must share to batch: a kvcompress cache's method and layer (None:
    any other cache, which mlx-lm batches itself)."""
    return (c.method.config, c.info) if isinstance(c, Engine) else None


def _describe(c) -> str:
    return f"a kvcompress {c.method.name!r} cache" if isinstance(c, Engine) else f"an mlx-lm {type(c).__name__}"


def _mismatch(a, b) -> str:
    if isinstance(a, Engine) and isinstance(b, Engine) and a.method.name == b.method.name:
        return f"kvcompress {a.method.name!r} caches built with different parameters or for different layers"
    return f"{_describe(a)} and {_describe(b)}"


def _running_rows(gen) -> list:
    """One representative cache list of the rows the generator already holds (or none)."""
    out = []
    for seq in getattr(gen, "_unprocessed_sequences", ()) or ():
        out.append(("a queued row", seq[3]))
    for name, what in (("_prompt_batch", "the prompt batch"), ("_generation_batch", "the running batch")):
        batch = getattr(gen, name, None)
        caches = getattr(batch, "prompt_cache", None)
        if caches and len(getattr(batch, "uids", ()) or ()) > 0:
            out.append((what, caches))
    return out


def check_batch(rows: list) -> None:
    """Raise a ConfigError unless every ``(label, cache_list)`` row can share one batch with the
    others: the same number of layers, and per layer the same kvcompress method and layer
    identity, or no kvcompress cache in any row."""
    if not rows:
        return
    label0, first = rows[0]
    sig0 = [_signature(c) for c in first]
    for label, caches in rows[1:]:
        if len(caches) != len(first):
            raise ConfigError(f"cannot batch {label} ({len(caches)} layer caches) with {label0} ({len(first)})")
        for i, c in enumerate(caches):
            if _signature(c) != sig0[i]:
                raise ConfigError(
                    f"cannot batch {label} with {label0}: their layer {i} holds {_mismatch(c, first[i])}; "
                    "a batch's rows must all hold caches of one kvcompress method (rows given caches=None "
                    "get the model's own: kvcompress.attach(model) makes those compressed); nothing was inserted"
                )


def _insert(original, module, install):
    @functools.wraps(original)
    def insert_segments(self, segments, max_tokens=None, caches=None, *args, **kwargs):
        running = _running_rows(self)
        if _has_engine_rows(caches) or any(_has_engine(c) for _, c in running):
            caches = [c if c is not None else module.make_prompt_cache(self.model, getattr(self, "max_kv_size", None))
                      for c in (caches or [None] * len(segments))]
            check_batch(running + [(f"new row {i}", c) for i, c in enumerate(caches)])
            install(self.model)
        return original(self, segments, max_tokens, caches, *args, **kwargs)

    setattr(insert_segments, _MARK, original)
    return insert_segments


def _has_engine_rows(caches: Optional[list]) -> bool:
    return bool(caches) and any(_has_engine(c) for c in caches if c is not None)


def _wrap_attr(owner: Any, name: str, make) -> None:
    fn = getattr(owner, name, None)
    if fn is not None and not hasattr(fn, _MARK):
        setattr(owner, name, make(fn))


def wrap(install: Callable[[Any], Any]) -> None:
    """Wrap mlx-lm's entry points so they call ``install(model)`` (:func:`kvcompress.install`) on a
    model given kvcompress caches (idempotent; nothing happens before ``mlx_lm.generate`` is
    imported)."""
    gen = sys.modules.get("mlx_lm.generate")
    if gen is None or getattr(gen, _MARK, False):
        return
    _wrap_attr(gen, "generate_step", lambda fn: _step(fn, install))
    _wrap_attr(gen, "speculative_generate_step", lambda fn: _step(fn, install, with_draft=True))
    batch = getattr(gen, "BatchGenerator", None)
    if batch is not None:
        _wrap_attr(batch, "insert_segments", lambda fn: _insert(fn, gen, install))
    setattr(gen, _MARK, True)
