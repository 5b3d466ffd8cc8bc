"""Shared output helpers for the benchmarks: machine metadata, JSON, plots, terminal tables.

Every result file is ``{"benchmark", "machine", "settings", ...}`` so a number is never separated
from the machine and settings that produced it. Plots carry the same facts as a caption; tables
print with ``rich`` when it is installed and as aligned plain text otherwise.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

__all__ = [
    "machine_info",
    "machine_summary",
    "settings_summary",
    "write_json",
    "read_json",
    "save_figure",
    "print_table",
    "markdown_table",
    "fmt",
    "openblas_note",
    "warn_openblas",
    "caption",
    "pyplot",
    "save_plot",
    "result_labels",
    "progress_bar",
    "finish",
    "report_sweep",
]


def _version(dist: str) -> Optional[str]:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_state() -> dict:
    """Commit of the kvcompress checkout (and whether it had uncommitted changes), if any."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {}
    if head.returncode:
        return {}
    return {"git_commit": head.stdout.strip(), "git_dirty": bool(dirty.stdout.strip())}


def machine_info() -> dict:
    """Facts about this machine and software that change benchmark numbers.

    Includes the platform, CPU model and count, the 1/5/15-minute load average (other processes
    competing for the CPUs make timings noisy), Python/MLX/mlx-lm/kvcompress versions, the MLX
    default device, ``LD_PRELOAD`` and whether OpenBLAS is preloaded (35x matmul speed on Linux
    CPUs), the UTC date, and the git commit of the checkout (``git_dirty``: uncommitted edits).
    """
    from kvcompress._blas import find_openblas, openblas_preloaded

    try:
        import mlx.core as mx

        device = str(mx.default_device())
        mlx_version = mx.__version__
    except Exception:  # pragma: no cover - mlx is a hard dependency
        device, mlx_version = "?", None
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        load = None
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average": load,
        "python": sys.version.split()[0],
        "mlx": mlx_version,
        "mlx_lm": _version("mlx-lm") or _version("mlx_lm"),
        "kvcompress": _version("kvcompress"),
        "mlx_device": device,
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
        "openblas_preloaded": openblas_preloaded(),
        "openblas_found": find_openblas(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **_git_state(),
    }


def openblas_note() -> str:
    """A warning line when OpenBLAS exists but is not preloaded (timings ~35x slower), else ''."""
    from kvcompress._blas import FIX_HINT, find_openblas, openblas_preloaded

    if find_openblas() and not openblas_preloaded():
        return f"warning: OpenBLAS is not preloaded; MLX CPU matmuls will be slow. Fix: {FIX_HINT}"
    return ""


def warn_openblas() -> None:
    """Print :func:`openblas_note` to stderr when it has something to say."""
    note = openblas_note()
    if note:
        print(note, file=sys.stderr)


def finish(payload: Mapping[str, Any], json_path: Path, plot, args) -> None:
    """The end of every workload's ``run``: draw ``plot(payload, <json_path>.png)`` unless
    ``--no-plot`` (a missing matplotlib is a hint, not an error), then print one ``wrote <path>``
    line per file written (to stderr, with the progress; the tables go to stdout)."""
    json_path = Path(json_path)
    written = [json_path]
    if not getattr(args, "no_plot", False):
        try:
            written.append(Path(plot(payload, json_path.with_suffix(".png"))))
        except ImportError as exc:
            print(f"no plot ({exc}); pip install 'kvcompress[bench]'", file=sys.stderr)
    print(f"finished in {float(payload['seconds_total']):.1f}s", file=sys.stderr)
    for path in written:
        print(f"wrote {path}", file=sys.stderr)


def machine_summary(m: Mapping[str, Any]) -> str:
    """One line: CPU, core count, load, MLX version, BLAS status, date."""
    blas = "OpenBLAS preloaded" if m.get("openblas_preloaded") else "no OpenBLAS preload"
    load = m.get("load_average")
    load_s = f", load {load[0]:.1f}" if load else ""
    return (
        f"{m.get('cpu', '?')} ({m.get('cpu_count', '?')} cores{load_s}), {m.get('platform', '?')}, "
        f"MLX {m.get('mlx', '?')} on {m.get('mlx_device', '?')}, mlx-lm {m.get('mlx_lm', '?')}, "
        f"{blas}, {str(m.get('date_utc', ''))[:10]}"
    )


def settings_summary(settings: Mapping[str, Any], keys: Optional[Iterable[str]] = None) -> str:
    """``k=v, ...`` for the chosen settings (all when ``keys`` is None)."""
    items = settings.items() if keys is None else ((k, settings[k]) for k in keys if k in settings)
    out = []
    for k, v in items:
        if isinstance(v, (list, tuple)):
            v = "/".join(str(x) for x in v)
        out.append(f"{k}={v}")
    return ", ".join(out)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy / mlx scalars
        try:
            return _jsonable(x.item())
        except Exception:
            pass
    return x


def write_json(path: os.PathLike | str, payload: Mapping[str, Any]) -> Path:
    """Write ``payload`` (which must hold ``machine`` and ``settings``) as indented JSON."""
    missing = [k for k in ("machine", "settings") if k not in payload]
    if missing:
        raise ValueError(f"benchmark results need {missing} metadata")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(_jsonable(dict(payload)), indent=2) + "\n")
    return p


def read_json(path: os.PathLike | str) -> dict:
    return json.loads(Path(path).read_text())


def save_figure(fig, path: os.PathLike | str, caption: str) -> Path:
    """Save a matplotlib figure with ``caption`` (machine + settings) printed under the axes."""
    import textwrap

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    width_in, height_in = fig.get_size_inches()
    wrapped = textwrap.fill(caption, width=max(60, int(width_in * 16)))
    n_lines = wrapped.count("\n") + 1
    caption_in = n_lines * 7 * 1.35 / 72 + 0.1  # 7 pt monospace lines
    fig.subplots_adjust(bottom=min(0.6, (caption_in + 0.55) / height_in))
    fig.text(0.01, 0.01, wrapped, ha="left", va="bottom", fontsize=7, family="monospace")
    fig.savefig(p, dpi=120)
    return p


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend (ImportError without matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(fig, path: os.PathLike | str, caption: str) -> Path:
    """Lay out ``fig``, save it with ``caption`` (:func:`save_figure`) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    p = save_figure(fig, path, caption)
    plt.close(fig)
    return p


def caption(payload: Mapping[str, Any], keys: Iterable[str], lead: str = "", extra: str = "",
            settings: Optional[Mapping[str, Any]] = None) -> str:
    """The line under a plot: ``{lead}Settings: k=v, ...{extra}. Machine: ...``."""
    shown = settings_summary(settings if settings is not None else payload["settings"], keys)
    return f"{lead}Settings: {shown}{extra}. Machine: {machine_summary(payload['machine'])}"


def fmt(x: Any, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if not math.isfinite(x):
            return "-"
        return f"{x:.{digits}f}"
    return str(x)


def print_table(
    title: str,
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    file=None,
    plain: Optional[bool] = None,
) -> str:
    """Print a table (``rich`` when available and ``plain`` is not set) and return plain text."""
    cells = [[fmt(c) for c in r] for r in rows]
    text = _plain_table(title, columns, cells)
    use_rich = not plain
    if use_rich:
        try:
            from rich.console import Console
            from rich.markup import escape
            from rich.table import Table
        except ImportError:
            use_rich = False
    if use_rich:
        width = max(len(line) for line in text.splitlines()) + 3 * len(columns) + 4
        table = Table(title=title)
        for i, c in enumerate(columns):
            table.add_column(escape(c), justify="left" if i == 0 else "right")
        for r in cells:
            table.add_row(*(escape(c) for c in r))
        console = Console(file=file)
        console.width = max(console.width, width)
        console.print(table)
    else:
        print(text, file=file or sys.stdout)
    return text


def _plain_table(title: str, columns: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    widths = [len(c) for c in columns]
    for r in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, r)]
    line = "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(columns, widths)))
    sep = "-" * len(line)
    body = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
        for r in cells
    ]
    return "\n".join([title, sep, line, sep, *body, sep])


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table."""
    cells = [[fmt(c) for c in r] for r in rows]
    head = "| " + " | ".join(columns) + " |"
    rule = "|" + "|".join(["---"] + ["---:"] * (len(columns) - 1)) + "|"
    return "\n".join([head, rule, *("| " + " | ".join(r) + " |" for r in cells)])


def result_labels(payload: Mapping[str, Any]) -> list[str]:
    """The distinct ``label`` of ``payload["results"]``, in first-seen order."""
    return list(dict.fromkeys(r["label"] for r in payload["results"]))


def progress_bar(items: Optional[Iterable] = None, **kw):
    """A ``tqdm`` bar on stderr (over ``items``, or with ``total=``); without tqdm, ``items``."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, file=sys.stderr, **kw)


def report_sweep(payload: dict, args, name: str, title: str, table, plot, where) -> dict:
    """The end of a sweep workload's ``run``: write ``<out>/<name>.json``, print ``table(payload)``
    (and as markdown with ``--markdown``) and a line per failed record (``where(record)`` says
    which setting), then :func:`finish`; return ``payload``."""
    from ._options import out_dir

    json_path = write_json(out_dir(args) / f"{name}.json", payload)
    cols, rows = table(payload)
    print_table(title, cols, rows, plain=getattr(args, "plain", False))
    for r in payload["results"]:
        if "error" in r:
            print(f"  {r['label']} ({where(r)}): {r['error']}")
    if getattr(args, "markdown", False):
        print(markdown_table(cols, rows))
    finish(payload, json_path, plot, args)
    return payload
