"""Save and load prompt caches that contain compressed layers (mlx-lm's file format).

Files are written and read by mlx-lm's own ``save_prompt_cache`` / ``load_prompt_cache`` (the
kvcompress classes are registered with mlx-lm, so its loader reads them too). kvcompress adds a
digest to the file's metadata covering every layer's class and state (arrays, strings, scalars)
and the user metadata (``model``, chat template, notes, ...); :func:`load_prompt_cache` checks it,
so a file damaged anywhere -- header, metadata or tensor data -- is reported, never loaded. The
digest is mandatory for a file holding kvcompress layers (a plain mlx-lm file has none and loads
as mlx-lm's loader reads it). mlx-lm's own two functions are wrapped to do the same
(:mod:`kvcompress.mlxlm.loader`). Files written before the digest covered the metadata (a bare
hex digest, layers only) still load, with their layers checked. A file written before a
component gained a parameter loads too (its rebuilt layers name the new parameter at its
default): the digest is then checked over the layers as the file stores them.

Given ``model=``, :func:`load_prompt_cache` also refuses a cache list made for another model
(:func:`kvcompress.mlxlm.fit.check_fit`) and installs the model hook, as
:func:`kvcompress.make_prompt_cache` does.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as _mlx_cache

from ._autoload import DIGEST_KEY, is_kvcompress_file, original
from .cache import LOAD_REGISTRY
from .errors import KVCompressError

__all__ = ["save_prompt_cache", "load_prompt_cache", "CorruptCacheFile"]

#: the digest format written now: ``"<_FORMAT>:<hex>"`` (a bare hex digest: the layers only)
_FORMAT = "v2"


class CorruptCacheFile(KVCompressError):
    """A prompt-cache file that cannot be read back exactly."""


def _update(h, x) -> None:
    if x is None:
        h.update(b"none")
        return
    if isinstance(x, str):
        h.update(b"str:" + x.encode())
        return
    if not isinstance(x, mx.array):  # an int / float / bool: hashed as mlx-lm stores it
        x = mx.array(x)
    a = x.view(mx.uint16) if x.dtype == mx.bfloat16 else x
    h.update(f"{x.dtype}{x.shape}".encode())
    h.update(np.ascontiguousarray(np.array(a)).tobytes())


def _digest_layers(cache: list) -> str:
    """The digest of files written before the metadata was covered (arrays and strings only)."""
    h = hashlib.blake2b(digest_size=16)
    for _, x in tree_flatten([c.state for c in cache]):
        if isinstance(x, mx.array):
            _update(h, x)
        elif isinstance(x, str):
            h.update(x.encode())
    return h.hexdigest()


def _digest(cache: list, metadata: dict) -> str:
    """``v2:<hex>``: every layer's class and state entries (with their place in the state tree),
    the number of layers, and the user metadata as mlx-lm stores it (flattened keys)."""
    return _digest_of([type(c).__name__ for c in cache], tree_flatten([c.state for c in cache]), metadata)


def _digest_of(classes: list, entries, metadata: dict) -> str:
    h = hashlib.blake2b(digest_size=16, person=b"kvcompress-v2")
    h.update(json.dumps(classes).encode())
    for key, x in entries:
        h.update(f"|{key}=".encode())
        _update(h, x)
    meta = {k: v for k, v in tree_flatten(metadata) if k != DIGEST_KEY}
    h.update(json.dumps(meta, sort_keys=True, default=repr).encode())
    return f"{_FORMAT}:{h.hexdigest()}"


def _stored_digest(file_name: str, metadata: dict) -> Optional[str]:
    """:func:`_digest` of the layers *as the file stores them* (mlx-lm's encoding of strings and
    scalars undone), so that a file written before a component gained a parameter -- which the
    rebuilt layer's state now names with its default -- still checks; None when the file's
    entries are not the plain list paths mlx-lm writes."""
    arrays, flat = mx.load(file_name, return_metadata=True)
    _, classes, scalars = tree_unflatten(list(flat.items()))  # mlx-lm's [metadata, classes, scalars]
    kinds = dict(scalars[1:])  # entry path -> "scalar" | "string" | "none"
    entries = {}
    for key, a in arrays.items():
        kind = kinds.get(key)
        entries[key] = (a.item() if kind == "scalar" else "".join(map(chr, a.tolist())) if kind == "string"
                        else None if kind == "none" else a)
    try:
        order = sorted(entries, key=lambda k: [int(p) for p in k.split(".")])
    except ValueError:
        return None
    return _digest_of(classes, [(k, entries[k]) for k in order], metadata)


def save_prompt_cache(file_name: str, cache: list, metadata: Optional[dict] = None) -> None:
    """Write ``cache`` (any mix of mlx-lm and kvcompress layers) to a ``.safetensors`` file."""
    meta = dict(metadata or {})
    meta.pop(DIGEST_KEY, None)
    meta[DIGEST_KEY] = _digest(cache, meta)
    original(_mlx_cache.save_prompt_cache)(file_name, cache, meta)


def _header(file_name: str) -> Optional[dict]:
    """The JSON header of a ``.safetensors`` file (tensor names -> entries, ``__metadata__``), or
    None when it cannot be read (mlx's loader then says why)."""
    import struct

    try:
        with open(file_name, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                return None
            header = json.loads(f.read(n))
        return header if isinstance(header, dict) else None
    except (OSError, ValueError, struct.error):
        return None


def _check_complete(file_name: str) -> None:
    """Raise :class:`CorruptCacheFile` naming the first missing tensor when the file lacks one
    that its layers' structure implies (a layer, or an entry of a layer's state list): mlx-lm's
    loader would put an empty dict there and the cache would fail only when used."""
    header = _header(file_name)
    if header is None:
        return
    meta = header.pop("__metadata__", None) or {}
    n_layers = sum(1 for k in meta if k.startswith("1.") and k[2:].isdigit())  # the cache classes
    children: dict = {}
    for name in header:
        parts = name.split(".")
        for depth in range(len(parts)):
            children.setdefault(".".join(parts[:depth]), set()).add(parts[depth])
    if n_layers:
        children.setdefault("", set())
    for parent, names in sorted(children.items()):
        if not all(x.isdigit() for x in names):
            continue
        want = n_layers if parent == "" and n_layers else max(map(int, names)) + 1
        missing = [i for i in range(want) if str(i) not in names]
        if missing:
            key = f"{parent}.{missing[0]}" if parent else str(missing[0])
            layer = key.split(".")[0]
            what = f"layer {layer} (all its tensors)" if not parent else f"tensor {key!r} of layer {layer}"
            raise CorruptCacheFile(f"{file_name}: the file is damaged or incomplete: missing {what}")


def load_prompt_cache(file_name: str, return_metadata: bool = False, registry=None, model=None) -> Any:
    """Read a cache written by :func:`save_prompt_cache` (or mlx-lm's), checking its digest.

    Compressed layers rebuild their method from ``registry`` (default: the process-wide one).
    Raises :class:`CorruptCacheFile` naming the file if it cannot be read back exactly (a file
    with kvcompress layers must carry a valid digest). Given ``model``, a cache list made for
    another model raises :class:`~kvcompress.mlxlm.fit.CacheMismatch` and the model gets the
    hook :func:`kvcompress.install` gives it (mlx-lm's ``generate`` installs it itself).
    """
    file_name = str(file_name)
    _check_complete(file_name)
    kvc_file = is_kvcompress_file(file_name)
    token = LOAD_REGISTRY.set(registry)
    try:
        cache, meta = original(_mlx_cache.load_prompt_cache)(file_name, return_metadata=True)
    except KVCompressError:
        raise
    except FileNotFoundError:
        raise CorruptCacheFile(f"prompt-cache file {str(file_name)!r} does not exist") from None
    except Exception as exc:  # safetensors header, JSON or structure errors
        raise CorruptCacheFile(
            f"{file_name}: not a readable prompt-cache file ({type(exc).__name__}: {exc})"
        ) from None
    finally:
        LOAD_REGISTRY.reset(token)
    meta = dict(meta)
    _check_digest(file_name, cache, meta, kvc_file)
    meta.pop(DIGEST_KEY, None)
    if model is not None:
        from .mlxlm.attention import install
        from .mlxlm.fit import check_fit

        check_fit(model, cache, where=f"{file_name}")
        install(model)
    return (cache, meta) if return_metadata else cache


def _check_digest(file_name: str, cache: list, meta: dict, kvc_file: bool) -> None:
    from .engine import Engine

    want = meta.get(DIGEST_KEY)
    if want is None:
        if kvc_file or any(isinstance(c, Engine) for c in cache):
            raise CorruptCacheFile(
                f"{file_name}: the file holds kvcompress layers but no kvcompress digest (its header is "
                "damaged, or it was not written by kvcompress.save_prompt_cache); it cannot be checked, "
                "so it is not loaded"
            )
        return  # a plain mlx-lm file
    if not isinstance(want, str):
        raise CorruptCacheFile(f"{file_name}: the kvcompress digest entry is damaged")
    fmt, sep, _ = want.partition(":")
    if sep and fmt == _FORMAT:
        got = _digest(cache, meta)
        if got != want:  # the layers as stored (a component's newer parameters change the rebuilt state)
            got = _stored_digest(file_name, meta) or got
    elif not sep and len(want) == 32:  # written before the digest covered the metadata
        got = _digest_layers(cache)
    else:
        raise CorruptCacheFile(
            f"{file_name}: unknown kvcompress digest format {fmt!r} (this version writes {_FORMAT!r}); "
            "the file is damaged or was written by a newer kvcompress"
        )
    if got != want:
        raise CorruptCacheFile(f"{file_name}: the cache data or metadata does not match its digest; "
                               "the file is damaged")
