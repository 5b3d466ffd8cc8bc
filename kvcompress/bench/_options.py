"""What every workload's command line shares: option types, the output options, settings checks.

A workload module exposes ``add_arguments(parser)`` and ``run(args)`` (``kvcompress bench
<workload>`` and the ``benchmarks/`` scripts call them). Impossible settings (a zero budget, a
negative count, ...) are a ``ValueError`` naming the setting, the valid range and the value,
raised before anything runs or is written; ``kvcompress bench`` prints it as one error line.
Results go to ``kvcompress-results/`` under the current folder unless ``--out`` names another.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = [
    "DEFAULT_OUT",
    "int_list",
    "name_list",
    "NameList",
    "check_at_least",
    "check_minimums",
    "at_least",
    "one_of",
    "options_given",
    "settings_from_args",
    "add_output_arguments",
    "out_dir",
    "check_out_dir",
    "check_file_stem",
]

#: The default output folder, relative to the current working directory: the user's own folder,
#: never a checkout's committed ``docs/results`` (``--out docs/results`` refreshes those).
DEFAULT_OUT = "kvcompress-results"


def int_list(v: Any) -> tuple:
    """``"1,2 3"`` or an iterable of numbers -> ``(1, 2, 3)`` (a command-line option type)."""
    if isinstance(v, str):
        v = v.replace(",", " ").split()
    return tuple(int(x) for x in v)


def name_list(text: str) -> tuple:
    """``"a, b,"`` -> ``("a", "b")`` (a command-line option type)."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


class NameList(argparse.Action):
    """``--methods a,b c``: names separated by commas and/or spaces, in one argument or several
    (use with ``nargs="+"``); stored as a tuple. Naming nothing (``--methods ""``) is an error,
    not "every method"."""

    def __call__(self, parser, namespace, values, option_string=None):
        values = [values] if isinstance(values, str) else values
        names = tuple(x for v in values for x in v.replace(",", " ").split())
        if not names:
            raise argparse.ArgumentError(self, "no method named; give names separated by commas or spaces")
        setattr(namespace, self.dest, names)


def check_at_least(name: str, value: Any, low: int, hint: str = "") -> None:
    """Raise ``ValueError`` unless ``value`` (an integer, or a non-empty list of them) is
    ``>= low``; ``hint`` says why, e.g. ``" (budget = context // ratio)"``."""
    many = isinstance(value, (list, tuple))
    values = list(value) if many else [value]
    ok = values and all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in values)
    if not ok:
        what = "a non-empty list of integers" if many else "an integer"
        shown = ",".join(str(v) for v in values) if many else repr(value)
        raise ValueError(f"{name} must be {what} >= {low}{hint}, got {shown or 'nothing'}")


def check_minimums(settings: Mapping[str, Any], minimum: Mapping[str, int]) -> None:
    """:func:`check_at_least` for every setting named in ``minimum`` that is not None."""
    for name, low in minimum.items():
        if settings.get(name) is not None:
            check_at_least(name, settings[name], low)


def at_least(low: int, hint: str = ""):
    """An ``attrs`` validator: :func:`check_at_least` (None passes: "not set")."""
    def validate(inst, attribute, value):
        if value is not None:
            check_at_least(attribute.name, value, low, hint)

    return validate


def one_of(choices: Sequence[str]):
    """An ``attrs`` validator: the value is one of ``choices`` (each one of them, for a list)."""
    def validate(inst, attribute, value):
        values = value if isinstance(value, (list, tuple)) else [value]
        bad = [v for v in values if v not in choices]
        if bad or not values:
            raise ValueError(f"{attribute.name} must be one of {', '.join(choices)}; got {value!r}")

    return validate


def options_given(args, names: Sequence[str], quick: Mapping[str, Any]) -> dict:
    """``quick`` with ``--quick``, then every option among ``names`` given on the command line."""
    kw = dict(quick) if getattr(args, "quick", False) else {}
    kw.update({n: getattr(args, n) for n in names if getattr(args, n, None) is not None})
    return kw


def settings_from_args(args, defaults: Mapping[str, Any], quick: Mapping[str, Any]) -> dict:
    """Workload settings: ``defaults``, then ``quick`` with ``--quick``, then every option given
    (``out`` included, so a result file records the folder it was written to)."""
    return {**defaults, **options_given(args, list(defaults), quick)}


def add_output_arguments(parser, what: str) -> None:
    """The options every workload shares: ``--out`` (alias ``--out-dir``), ``--no-plot``,
    ``--plain``, ``--markdown``."""
    parser.add_argument("--out", "--out-dir", dest="out", default=DEFAULT_OUT,
                        help=f"folder for {what} (default: ./{DEFAULT_OUT})")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--plain", action="store_true", help="plain-text tables (no rich)")
    parser.add_argument("--markdown", action="store_true", help="also print markdown tables")


def out_dir(args) -> Path:
    """The output folder ``--out`` names (relative paths: under the current folder)."""
    return Path(getattr(args, "out", None) or DEFAULT_OUT)


def check_out_dir(path, option: str = "--out") -> None:
    """Raise ``ValueError`` (one line) unless ``path`` is a folder results can be written to, or
    one that can be created: called before a run, so a long run never fails at its last step."""
    import os

    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"{option} {path}: not a folder (a file is there); name a folder for the results")
    probe = path
    while not probe.exists():  # the nearest existing folder is where it will be created
        if probe.is_symlink():
            raise ValueError(f"{option} {path}: {probe} is a broken link")
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{option} {path}: {probe} is a file, not a folder; name a folder for the results")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: {probe} is not writable; name a folder you can write to")


def check_file_stem(stem: str, option: str = "--out-name") -> None:
    """Raise ``ValueError`` unless ``stem`` is a plain file name stem (no folder, not empty)."""
    if not stem or stem in (".", "..") or "/" in stem or "\\" in stem or "\0" in stem or stem.strip() != stem:
        raise ValueError(f"{option} must be a plain file name stem (no folders, not empty), got {stem!r}; "
                         "use --out to choose the folder")
