"""What a persistent prompt-cache file was made by, so that it is only ever used for the same.

A cache file is valid only for the model whose keys and values it holds, the method (and budget)
that chose what it keeps, and the formats of the code that wrote it. :func:`cache_identity`
describes all of that as one JSON text; the file stores it and a reader compares it exactly.

* **model** -- its class, its configuration, and a fingerprint of its weights as loaded
  (adapters included): every parameter's name, shape and dtype, and 96 of its values (the first
  16, the last 16 and 64 evenly spaced), hashed. Any fine-tune, re-quantization or other
  checkpoint changes it; the same weights under another path do not (the cache is the same).
* **draft model** (speculative decoding) -- the same, as its caches follow the main model's.
* **method** -- the built method's configuration (every component's parameters, the budget and the
  storage of the kept slots, ``kv_bits`` / ``kv_group_size``, included) and its description.
* **formats** -- this file format's version, kvcompress's version, mlx-lm's minor version.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Optional

import attrs
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

__all__ = ["Identity", "FORMAT", "cache_identity", "weights_fingerprint"]

#: version of what ``kvcompress serve`` writes in a cache file's metadata
FORMAT = "1"


@attrs.frozen
class Identity:
    """``text``: the JSON description; ``digest``: 20 hex characters of its hash (file names)."""

    text: str
    digest: str

    @classmethod
    def of(cls, description: dict) -> "Identity":
        text = json.dumps(description, sort_keys=True, separators=(",", ":"), default=str)
        return cls(text, hashlib.blake2b(text.encode(), digest_size=10).hexdigest())


def _sample(p: mx.array) -> mx.array:
    flat = p.reshape(-1)
    n = flat.size
    idx = np.unique(np.concatenate([np.arange(min(16, n)), np.arange(max(0, n - 16), n),
                                    np.linspace(0, n - 1, num=min(64, n)).astype(np.int64)]))
    picked = flat[mx.array(idx)]
    return picked.view(mx.uint16) if p.dtype == mx.bfloat16 else picked


def weights_fingerprint(model) -> str:
    """Hash of every parameter's name, shape, dtype and 96 sampled values (see the module
    docstring); evaluates on the calling thread."""
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    samples = [_sample(p) for _, p in params]
    mx.eval(samples)
    h = hashlib.blake2b(digest_size=16)
    for (name, p), s in zip(params, samples):
        h.update(f"{name}|{p.dtype}|{tuple(p.shape)}|".encode())
        h.update(np.ascontiguousarray(np.array(s)).tobytes())
    return h.hexdigest()


def _model_description(model) -> Optional[dict]:
    if model is None:
        return None
    args = getattr(model, "args", None)
    return {"class": f"{type(model).__module__}.{type(model).__qualname__}", "args": repr(args),
            "weights": weights_fingerprint(model)}


def cache_identity(model, draft_model, method) -> Identity:
    """The identity of the caches ``method`` builds for ``model`` (+ ``draft_model``)."""
    import mlx_lm

    from .. import __version__

    return Identity.of({
        "format": FORMAT,
        "kvcompress": __version__,
        "mlx_lm": ".".join(mlx_lm.__version__.split(".")[:2]),
        "model": _model_description(model),
        "draft_model": _model_description(draft_model),
        "method": {"config": method.config.to_dict(), "description": method.describe()},
    })


def provider_identity(provider, method, model_key: Any, known: dict) -> Optional[Identity]:
    """The identity for ``model_key`` (mlx-lm's ``(model, adapter, draft)``), computed from the
    provider's loaded models when they are the ones of ``model_key`` and remembered in ``known``
    (per key and loaded model object); None when it cannot be known (another model is loaded)."""
    model = getattr(provider, "model", None)
    if provider.model_key == model_key and model is not None:
        got = known.get(model_key)
        if got is None or got[0] != id(model):
            got = known[model_key] = (id(model), cache_identity(model, provider.draft_model, method))
        return got[1]
    got = known.get(model_key)
    return got[1] if got is not None else None
