"""``--variant METHOD:NAME=VALUE,...``: a registered method with some parameters changed, run next
to the defaults (the long-context workloads' way to compare a paper value or a candidate
default without editing code)."""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from ..generate import param_value
from ._caches import entries, label

__all__ = ["variant", "cache_entries"]


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets and quotes (``ids=[1,2],n=3`` -> 2 items)."""
    items, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth or quote:
        raise argparse.ArgumentTypeError(f"unbalanced brackets or quotes in {text!r}")
    return items + [text[start:]]


def variant(text: str) -> tuple[str, dict]:
    """argparse type: ``snapkv:kernel=11,recent=8`` -> ``("snapkv", {"kernel": 11, "recent": 8})``
    (values as :func:`kvcompress.generate.param_value` reads them: JSON, ``True``/``False``/``None``, else strings;
    a JSON list's commas do not split: ``selfinfo:keep_ids=[1,2]``)."""
    name, _, rest = text.partition(":")
    params: dict[str, Any] = {}
    try:
        items = _split_top(rest)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"expected METHOD:NAME=VALUE[,NAME=VALUE], got {text!r}: {exc}") from None
    for item in filter(None, (x.strip() for x in items)):
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
