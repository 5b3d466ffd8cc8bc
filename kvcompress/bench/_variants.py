"""``--variant METHOD:NAME=VALUE,...``: a registered method with some parameters changed, run next
to the defaults (the long-context workloads' way to compare a paper value or a candidate
default without editing code)."""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from ..generate import param_value
from ._caches import entries, label

__all__ = ["variant", "cache_entries"]


def variant(text: str) -> tuple[str, dict]:
    """argparse type: ``snapkv:kernel=11,recent=8`` -> ``("snapkv", {"kernel": 11, "recent": 8})``
    (values as :func:`kvcompress.generate.param_value` reads them: JSON, ``True``/``False``/``None``, else strings)."""
    name, _, rest = text.partition(":")
    params: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, raw = item.partition("=")
        if not eq or not key.strip():
            raise argparse.ArgumentTypeError(f"expected METHOD:NAME=VALUE[,NAME=VALUE], got {text!r}")
        params[key.strip()] = param_value(raw)
    if not name.strip() or not params:
        raise argparse.ArgumentTypeError(f"expected METHOD:NAME=VALUE[,NAME=VALUE], got {text!r}")
    return name.strip(), params


def cache_entries(methods, registry, variants: Sequence = ()) -> list[tuple]:
    """``(kind, method, params, label)`` of ``rotating``, the methods (None: every registered one)
    and every variant (whether or not its method is among ``methods``); a variant naming an
    unregistered method or a parameter its method does not take is a ``ValueError``."""
    from kvcompress import build_method

    out = [e for e in entries(methods, registry) if e[1] != "full"]
    for name, params in variants or ():
        if name not in registry.methods:
            raise ValueError(f"--variant {name}: unknown method; registered: {', '.join(sorted(registry.methods))}")
        if "budget" in params and params["budget"] not in registry.components["budget"]:
            raise ValueError(f"--variant {label(name, params)}: budget= names a budget component "
                             f"({', '.join(sorted(registry.components['budget']))}); the sweep sets the size "
                             "(--ratios)")
        try:
            build_method(name, registry=registry, **params)
        except Exception as exc:  # ConfigError and friends: one line
            raise ValueError(f"--variant {label(name, params)}: {' '.join(str(exc).split())}") from None
        out.append(("method", name, dict(params), label(name, params)))
    return out
