"""The options every command that builds a method shares (``generate``, ``chat``, ``serve``):
``--method/--budget/--config/--param`` and the storage's ``--kv-bits/--kv-group-size``, and the
option value types, each checked before a model loads (a bad value is one line naming it)."""

from __future__ import annotations

import argparse
import json
from typing import Any

__all__ = ["METHOD_OPTIONS", "add_method_arguments", "method_from_args", "param_value", "positive_int", "seed_int"]

#: options that choose the method; refused with --prompt-cache-file (the file holds the method)
METHOD_OPTIONS = ("method", "budget", "config", "param", "kv_bits", "kv_group_size")


def positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _float_in(lo: float, hi: float, lo_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not ((lo < value if lo_open else lo <= value) and value <= hi):
            want = f">= {lo:g}" if hi == float("inf") else f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise argparse.ArgumentTypeError(f"expected a number {want}, got {text!r}")
        return value

    return parse


def seed_int(text: str) -> int:
    """argparse type: a sampling seed, an int in [0, 2**64) (what ``mx.random.seed`` takes)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64 - 1], got {text!r}")
    return value


_PY_WORDS = {"True": True, "False": False, "None": None}


def param_value(raw: str) -> Any:
    """A parameter's command-line value: JSON (``8``, ``0.5``, ``true``, ``[1, 2]``), Python's
    ``True`` / ``False`` / ``None`` as written in the method tables, else the string itself."""
    raw = raw.strip()
    if raw in _PY_WORDS:
        return _PY_WORDS[raw]
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _param(text: str) -> tuple[str, Any]:
    """argparse type: ``NAME=VALUE``, the value as :func:`param_value` reads it."""
    name, eq, raw = text.partition("=")
    if not eq or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name.strip(), param_value(raw)


def add_method_arguments(p: argparse.ArgumentParser) -> None:
    """``--method/--budget/--config/--param``: the compression, as every command takes it."""
    p.add_argument("--method", default=None, help="a registered method (default cam; see kvcompress methods)")
    p.add_argument("--budget", type=positive_int, default=None,
                   help="the method's budget parameter: tokens kept per layer, or the mean over "
                        "layers for per-layer budgets (pyramid, squeeze)")
    p.add_argument("--config", default=None, help="TOML/JSON method config (instead of --method)")
    p.add_argument("--param", type=_param, action="append", default=[], metavar="NAME=VALUE",
                   help="extra method parameter, e.g. --param n_sink=4 (repeatable)")
    p.add_argument("--kv-bits", default=None, metavar="BITS",
                   help="store the kept keys and values in low bits: 2, 3, 4, 5, 6 or 8, or keys,values "
                        "(8,4 or K8V4); every kept slot from the first token (default: the model's dtype)")
    p.add_argument("--kv-group-size", default=None, metavar="N",
                   help="with --kv-bits: entries per scale and bias, 32, 64 or 128 (default 64); must "
                        "divide the model's head dimension")
    # mlx-lm's option, refused with a reason (kvcompress quantizes from the first token)
    p.add_argument("--quantized-kv-start", default=None, help=argparse.SUPPRESS)


def method_from_args(args):
    """The method ``--method/--budget/--config/--param`` and ``--kv-bits/--kv-group-size``
    describe (ConfigError if they cannot). The storage options are the method's (its
    ``storage``), never mlx-lm's ``kv_bits``, which would quantize a full cache."""
    from .config import load_config
    from .errors import ConfigError
    from .method import build_method
    from .storage import option_params

    if args.config and args.method:
        raise ConfigError("give either --method or --config, not both")
    if getattr(args, "quantized_kv_start", None) is not None:
        raise ConfigError("--quantized-kv-start is mlx-lm's; kvcompress stores every kept slot in low bits from "
                          "the first token (--kv-bits), so there is no start to choose: drop it")
    params = dict(args.param)
    if args.budget is not None:
        params["budget"] = args.budget
    group = getattr(args, "kv_group_size", None)
    params.update(option_params(getattr(args, "kv_bits", None), group, params))
    method = build_method(load_config(args.config) if args.config else (args.method or "cam"), **params)
    if group is not None and not method.storage.quantized:
        raise ConfigError("--kv-group-size sets the groups of low-bit storage; give --kv-bits too")
    return method
